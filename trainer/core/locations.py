"""Local path or hub id: the one rule for `FT_MODEL`, `FT_DATASET` and `FT_EVAL_DATASET` (docs/preemption-and-failures.md#local-path-or-hub-id).

transformers and datasets each guess for themselves, and a mistyped local path then reaches the hub as a
"repo id" (a traceback, exit 1, retried by the scheduler).  So the job decides first, with no I/O beyond
looking at the local disk, in this order:

1. a URL (`s3://...`, data only) or anything that exists on disk is local;
2. a path's shape is local: it starts with `/`, `./`, `../` or `~`, has two `/` or more, or has a character
   a hub id cannot have; for data also a data file's extension (`.jsonl`, `.json`, `.parquet`, `.csv`) or a glob;
3. `owner/name` where `owner` is a local folder is local: `mydata/train` beside a `mydata/` folder is a
   missing subfolder, not a hub repository;
4. anything else (`name` or `owner/name`) is a hub id.

A local value that does not exist exits 2 naming the folder it looked in (`missing`); a hub id the hub
does not have, or cannot be asked about, says that no local folder of that name exists either (`not_local`).
"""

from __future__ import annotations

import glob
import os
import re
from typing import TYPE_CHECKING

from trainer.core import precedence
from trainer.core.errors import ConfigError

if TYPE_CHECKING:
    from trainer.core.settings import Settings

DATA_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")  # huggingface_hub's validate_repo_id, less its rarer refusals
PATH_PREFIXES = ("/", "./", "../", "~")
GENERIC_FOLDER = re.compile(r"model|final|snapshots|checkpoint-\d+|[0-9a-f]{40}")  # says nothing of which model it is
SEED_MODEL, SEED_REGISTERED = "Qwen/Qwen3-4B", "main.default.qwen3_4b_assistant"


def is_url(spec: str) -> bool:
    return "://" in spec


def is_hub_id(spec: str, *, data: bool = False) -> bool:
    """True when `spec` names a hub repository (rule 4), False when it names something local (rules 1-3)."""
    if is_url(spec) or os.path.exists(spec) or spec.startswith(PATH_PREFIXES) or spec in (".", ".."):
        return False
    if data and (os.path.splitext(spec)[1].lower() in DATA_EXTENSIONS or glob.has_magic(spec)):
        return False
    if not HUB_ID.fullmatch(spec) or "--" in spec or ".." in spec:
        return False
    owner = spec.split("/", 1)[0]
    return not ("/" in spec and os.path.isdir(owner))


def normalised(spec: str, *, data: bool = False) -> str:
    """One spelling per local path, so that `./out`, `out/` and `/work/out` are the same folder to everything that compares
    or stores it (the resume fingerprint, the data cache key, the params): the real path (absolute, `~` expanded, `.`, `..`
    and symlinks resolved).  A hub id, a URL or an empty value is returned as given."""
    if is_url(spec) or is_hub_id(spec, data=data):
        return spec
    return real_path(spec)


def real_path(path: str) -> str:
    """`path` as its real path (FT_OUTPUT_DIR, always local); empty stays empty (refused by the settings' own rule)."""
    return os.path.realpath(os.path.expanduser(path)) if path.strip() else path


def missing(variable: str, spec: str, *, data: bool = False) -> str | None:
    """Why a local `spec` cannot be used (it does not exist, or a model is a file), or None (it exists, is a hub id, a URL or a glob)."""
    if is_hub_id(spec, data=data) or is_url(spec) or (data and glob.has_magic(spec)):
        return None
    path = os.path.abspath(spec)
    if os.path.exists(path):
        if data or os.path.isdir(path):
            return None
        return f"{variable}={spec!r} is a file; expected a folder with config.json and *.safetensors (or a hub id)"
    return (f"{variable}={spec!r}: no such local {'file or folder' if data else 'folder'} "
            f"({path}{_nearest(path)}); fix the path or mount the volume that holds it")


def check(settings: Settings, *, before_the_preset: bool = False) -> None:
    """Exit 2 (ConfigError) naming every local FT_MODEL, FT_DATASET or FT_EVAL_DATASET that does not exist, before the hub is asked.

    `before_the_preset`: entrypoint.py asks before any training process starts (a second, not the imports of torch),
    when the preset's own files (FT_PRESET=demo builds them in the training process) may not exist yet."""
    specs = (("FT_MODEL", settings.model, False), ("FT_DATASET", settings.dataset, True), ("FT_EVAL_DATASET", settings.eval_dataset, True))
    built = {normalised(path) for path in precedence.preset_defaults(settings.preset, settings.output_dir).values()} if before_the_preset else set()
    problems = [why for variable, spec, data in specs if spec and spec not in built and (why := missing(variable, spec, data=data))]
    if settings.chat_template and not os.path.isfile(settings.chat_template):
        problems.append(f"FT_CHAT_TEMPLATE={settings.chat_template!r}: no such file{_nearest(settings.chat_template)}; "
                        "it names a file holding a Jinja chat template")
    if problems:
        raise ConfigError("; ".join(problems))


def not_local(spec: str) -> str:
    """The note a hub message adds: the value was taken as a hub id because nothing local has that name."""
    return f"no local file or folder {spec!r} exists in {os.getcwd()} either, so it was taken as a hub id"


def model_name(spec: str) -> str:
    """What a model is called, for the run and registered names: a hub id's name (`Qwen3-0.6B`), or the last folder
    of a local path that is not a generic one (`/models/llama-3/final/model` -> `llama-3`; a hub cache's `models--org--name` -> `name`)."""
    parts = [p for p in spec.replace("\\", "/").split("/") if p not in ("", ".", "..", "~")]
    while len(parts) > 1 and GENERIC_FOLDER.fullmatch(parts[-1]):
        parts.pop()
    name = parts[-1] if parts else "model"
    return name.split("--")[-1] if name.startswith("models--") else name


def registered_name(spec: str) -> str:
    """The default FT_REGISTERED_MODEL: the seed's name for the seed's model, else `main.default.<model name>_sft`."""
    if spec == SEED_MODEL:
        return SEED_REGISTERED
    slug = re.sub(r"[^a-z0-9]+", "_", model_name(spec).lower()).strip("_") or "model"
    return f"main.default.{slug}_sft"


def served_name(registered: str, base: str) -> str:
    """The name the served model answers with: the registered name, else the base model's hub id (a local base
    model's folder name: a path says nothing to a chat client)."""
    return registered or (os.path.basename(os.path.normpath(base)) if os.path.isdir(base) else base)


def _nearest(path: str) -> str:
    """Where the path stops existing, and what is there: `; /data holds a.jsonl, b.jsonl`."""
    parent = os.path.dirname(path)
    while not os.path.isdir(parent):  # ends at "/" at the latest
        parent = os.path.dirname(parent)
    if parent == "/":
        return ""
    names = sorted(n for n in os.listdir(parent) if not n.startswith("."))
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"; {parent} holds {shown or 'nothing'}"


def eval_task_entries(spec: str) -> tuple[list[str], list[str]]:
    """FT_EVAL_TASKS as (lm-eval task names, folders of task YAMLs): an entry shaped like a path, or a folder that exists,
    is a folder (rule 1 and 2 above); anything else is a task name (`arc_easy`, `mmlu_abstract_algebra`)."""
    names, folders = [], []
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        local = os.path.isdir(entry) or entry.startswith(PATH_PREFIXES) or "/" in entry or entry in (".", "..")
        (folders if local else names).append(real_path(entry) if local else entry)
    return names, folders
