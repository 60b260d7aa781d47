"""One lm-evaluation-harness task on one loaded model, through its Python API (`simple_evaluate`).

The `hf` backend wraps the model already in memory (HFLM takes a PreTrainedModel), so the weights are loaded
once per model for all its tasks; with vLLM importable (and a GPU) lm-eval's `vllm` backend loads the saved
folder instead, which is faster for generative tasks.  The chat template is applied: the fine-tuned model is a
chat model, and both models are asked the same way so that the difference is the fine-tune's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
from collections.abc import Iterator
from typing import Any

SKIPPED = ("alias", "name", "sample_len", "samples")  # what a task's results hold besides its metrics


def score(net: Any, tokenizer: Any, folder: str, task: str, manager: Any, limit: int, cuda: bool, quiet: bool = True) -> dict[str, Any]:
    """lm-eval's results for `task` (its own JSON, less the per-sample records), on `net` or, with vLLM, on `folder`."""
    import lm_eval
    import lm_eval.evaluator

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its warnings on a model passed in memory, at every task, would fill the job's log
    _replace_helpers(lm_eval.evaluator)
    model = _vllm(folder) if cuda and importlib.util.find_spec("vllm") else _hf(net, tokenizer, cuda)
    with _no_progress_bars(quiet):
        results = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, limit=limit or None, apply_chat_template=True,
                                          log_samples=False, bootstrap_iters=0, verbosity="ERROR")
    results.pop("samples", None)
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(results, default=handle_non_serializable))  # its configs hold functions: kept as their text


def _replace_helpers(evaluator: Any) -> None:
    """Two helpers `simple_evaluate` calls at every task, replaced in lm-eval's evaluator module (docs/architecture.md,
    library internals).  It records the git commit of the folder it runs in by running `git describe`, which prints
    "fatal: not a git repository" into the job's log at every task (the job runs in no repository): the results record
    fulltune's own instead.  And it adds torch's environment report (`add_env_info`: `pip list` and a dozen other
    subprocesses, ~1 s per task on CPU), the same for every task of the process: gathered once."""
    evaluator.get_git_commit_hash = lambda: "fulltune"
    evaluator.add_env_info = lambda results: results.update(_environment())


@functools.cache
def _environment() -> dict[str, Any]:
    """What lm-eval's own `add_env_info` adds to a task's results (the library's versions, torch's environment report)."""
    from lm_eval.loggers.utils import add_env_info

    info: dict[str, Any] = {}
    add_env_info(info)
    return info


@contextlib.contextmanager
def _no_progress_bars(quiet: bool) -> Iterator[None]:
    """lm-eval draws a tqdm bar per phase of every task (building requests, tokenizing, running them) with no way to turn
    them off from its API; in a batch job's log they are noise between fulltune's own lines, which say each unit's time
    and the stage's ETA.  tqdm reads its TQDM_DISABLE variable only when first imported, long before this stage, so every
    bar is switched off for the stage's duration instead (FT_LOG_LEVEL=debug keeps the bars)."""
    if not quiet:
        yield
        return
    from tqdm import std

    kept, original = vars(std.tqdm)["__init__"], std.tqdm.__init__  # kept: as the class holds it (tqdm wraps it to read TQDM_*)

    def silent(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **(kwargs | {"disable": True}))  # lm-eval passes disable=False itself

    std.tqdm.__init__ = silent
    try:
        yield
    finally:
        std.tqdm.__init__ = kept


def metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results: `acc,none` becomes `acc`, `exact_match,strict-match`
    `exact_match/strict-match`; standard errors are left out (bootstrap_iters=0 makes most of them N/A)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if key in SKIPPED or metric.endswith("_stderr") or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            out.setdefault(task, {})[metric if kind in ("", "none") else f"{metric}/{kind}"] = float(value)
    return out


def higher_is_better(results: dict[str, Any]) -> dict[str, dict[str, bool]]:
    return {task: {metric: bool(better) for metric, better in values.items()} for task, values in results.get("higher_is_better", {}).items()}


def _hf(net: Any, tokenizer: Any, cuda: bool) -> Any:
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=net, tokenizer=tokenizer, batch_size="auto" if cuda else 8, max_batch_size=64)


def _vllm(folder: str) -> Any:  # pragma: no cover - needs vLLM and a GPU
    from lm_eval.models.vllm_causallms import VLLM

    return VLLM(pretrained=folder, batch_size="auto", gpu_memory_utilization=0.8)
