"""Why a setting is refused, in words that name the variable and the fix: the rules that involve two settings, an
unknown `FT_*` name's likely meaning, and the refused value as the error shows it (secrets masked).

settings.py's `load` gathers these with environs' own per-variable errors into one ConfigError (exit 2).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from typing import Any

from trainer.core.secrets import SECRET_NAME
from trainer.core.volume import Volume

MAX_SEQUENCES_PER_STEP = 2**16  # FT_BATCH_SIZE x FT_GRADIENT_ACCUMULATION_STEPS: the memory plan tries every split of it


def cross_checks(values: dict[str, Any], invalid: set[str] | frozenset[str] = frozenset()) -> dict[str, str]:
    """Rules that involve two settings; each names the variable to change.  A rule that reads a setting in `invalid`
    (one that did not parse: its refusal is reported already) is left for the run after it is fixed."""
    problems = {}

    def parsed(*names: str) -> bool:
        return not invalid.intersection(names)

    if parsed("save_steps", "eval_steps") and values["save_steps"] != "auto" and values["save_steps"] % values["eval_steps"]:  # auto saves at evaluation steps
        problems["FT_SAVE_STEPS"] = (f"must be a multiple of FT_EVAL_STEPS={values['eval_steps']} so "
                                     "every checkpoint has an eval loss for picking the best model")
    if parsed("batch_size", "gradient_accumulation_steps") and values["batch_size"] * values["gradient_accumulation_steps"] > MAX_SEQUENCES_PER_STEP:
        problems["FT_BATCH_SIZE"] = (f"times FT_GRADIENT_ACCUMULATION_STEPS={values['gradient_accumulation_steps']} "
                                     f"must be at most {MAX_SEQUENCES_PER_STEP} sequences per optimizer step")
    for name in ("eval_fraction", "warmup_ratio"):
        if parsed(name) and not 0.0 <= values[name] < 1.0:
            problems[f"FT_{name.upper()}"] = "must be >= 0 and < 1"
    for name, why in (("output_dir", "must name a folder (the mounted volume)"), ("model", "must name a hub id or a local folder"),
                      ("dataset", "must name a hub id, a folder or files")):
        if parsed(name) and not values[name].strip():
            problems[f"FT_{name.upper()}"] = why
    if parsed("node_rank", "num_nodes") and values["node_rank"] >= values["num_nodes"]:
        problems["FT_NODE_RANK"] = f"must be below FT_NUM_NODES={values['num_nodes']} (nodes are numbered from 0)"
    if parsed("num_nodes", "master_addr") and values["num_nodes"] > 1 and not values["master_addr"].strip():
        problems["FT_MASTER_ADDR"] = "must name node 0 (its host name or address) when FT_NUM_NODES > 1"
    if values["metrics_port"] and values["metrics_port"] == values["master_port"]:
        problems["FT_METRICS_PORT"] = f"must differ from FT_MASTER_PORT={values['master_port']}, where node 0 holds the processes' rendezvous"
    problems.update(_object_store_urls(values))
    problems.update(_eval_tasks(values))
    name = values["registered_model"]
    if parsed("registered_model", "model") and name and not re.fullmatch(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+){0,2}", name):
        problems["FT_REGISTERED_MODEL"] = "must be `model` or `catalog.schema.model` (letters, digits, _ and -)"
    return problems


def _eval_tasks(values: dict[str, Any]) -> dict[str, str]:
    """FT_EVAL_TASKS' folders exist and hold task YAMLs (its task names are checked against lm-eval's index by the
    training process, trainer/evaluation/tasks.py); the gate has benchmarks to gate on."""
    from trainer.core import locations

    problems = {}
    _, folders = locations.eval_task_entries(values["eval_tasks"])
    demo = os.path.realpath(Volume(values["output_dir"]).demo) if values["preset"] == "demo" else None
    for folder in folders:
        if demo and folder.startswith(demo + os.sep):
            continue  # the demo's own task, written with the demo when the job starts (trainer/data/demo.py)
        if not os.path.isdir(folder):
            problems["FT_EVAL_TASKS"] = f"{folder} is not a folder (a folder of lm-eval task YAMLs, or task names such as arc_easy)"
        elif not any(name.endswith((".yaml", ".yml")) for _, _, files in os.walk(folder) for name in files):
            problems["FT_EVAL_TASKS"] = f"{folder} holds no task YAML (*.yaml): lm-eval's task format, see docs/tracking-and-serving.md#a-task-of-ones-own"
    if values["eval_max_regression"] and not values["eval_tasks"].strip():
        problems["FT_EVAL_MAX_REGRESSION"] = "gates on benchmarks: set FT_EVAL_TASKS too (or FT_EVAL_MAX_REGRESSION=0)"
    return problems


def _object_store_urls(values: dict[str, Any]) -> dict[str, str]:
    """FT_MIRROR_URL is an object-store folder; no URL setting carries a credential (it would reach the logs and the
    MLflow params); FT_PUSH_TO_HUB is `org/name`."""
    from trainer.core import objectstore

    problems = {}
    mirror = values["mirror_url"].strip()
    if mirror and objectstore.protocol(mirror) not in objectstore.STORES:
        problems["FT_MIRROR_URL"] = "must be an object-store folder: s3://bucket/path, gs://bucket/path or az://container/path"
    for name in ("mirror_url", "dataset", "eval_dataset"):
        if why := objectstore.url_refusal(values[name]):
            problems[f"FT_{name.upper()}"] = why
    if values["push_to_hub"] and not re.fullmatch(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", values["push_to_hub"]):
        problems["FT_PUSH_TO_HUB"] = "must be a hub repository id, `org/name` (letters, digits, -, _ and .)"
    return problems


def not_a_setting(name: str, known: Collection[str]) -> str:
    """The refusal of an unknown FT_* name, with the setting (of `known`) it most likely meant (difflib, as argparse suggests choices)."""
    import difflib

    if name.upper() in known:
        return f"is not a fulltune setting: variable names are case-sensitive; did you mean {name.upper()}?"
    close = difflib.get_close_matches(name.upper(), list(known), n=1, cutoff=0.8)
    return "is not a fulltune setting" + (f"; did you mean {close[0]}?" if close else " (docs/settings.md lists them)")


def shown(name: str, value: str | None) -> str:
    if value is None:
        return "<unset>"
    if SECRET_NAME.search(name):
        return "****"
    from trainer.core.objectstore import scrub

    return repr(scrub(value))  # a URL's user:password@ or query string
