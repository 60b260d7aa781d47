"""The base model's benchmark scores, computed once per (model, revision, task, limit) and kept in a folder.

FT_EVAL_CACHE_DIR (default FT_OUTPUT_DIR/.fulltune/base-scores): a retry of this job, or the next job on the same
base with a folder they share, reads them instead of evaluating the base again (on Qwen3-4B that is most of the
stage's time).  One JSON file per task; the key also holds lm-eval's version and the tokenizer's chat template,
which change the prompts the base is asked.  A file is written whole or not at all (trainer/core/files.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from trainer.core.files import read_json, write_json


def key(model: str, revision: str, identity: str, limit: int, chat_template: str) -> str:
    import lm_eval

    parts = {"model": model, "revision": revision, "task": identity, "limit": limit, "lm_eval": lm_eval.__version__,
             "chat_template": hashlib.sha256((chat_template or "").encode()).hexdigest()[:16]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def path(folder: str, task: str, cache_key: str) -> str:
    return os.path.join(folder, f"{task}-{cache_key}.json")


def read(folder: str, task: str, cache_key: str) -> dict[str, Any] | None:
    return read_json(path(folder, task, cache_key), None)


def keep(folder: str, task: str, cache_key: str, results: dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    write_json(path(folder, task, cache_key), results)
