"""The data cache: the checked, tokenized datasets kept on the volume (FT_OUTPUT_DIR/.fulltune/data-cache/<key>),
keyed by everything that shapes them, so a restart skips checking and tokenizing (FT_DATA_CACHE).

The key covers the sources, the tokenizer's vocabulary, its chat template and end-of-turn token, and the settings
that change the data (`changes="data"`); an entry is complete once its report.json exists (`save` renames the
whole entry into place).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

from trainer.core import settings as settings_table
from trainer.core.files import read_json, staged, write_json
from trainer.core.settings import Settings
from trainer.data import sources

CACHE_VERSION = 2  # bump when the tokenized form changes (2: assistant turns with weight 0 carry no loss)


def complete(cache: str) -> bool:
    return os.path.exists(os.path.join(cache, "report.json"))


def fingerprint(settings: Settings, tokenizer: Any, train: sources.Source, evaluation: sources.Source | None) -> str:
    """Everything that shapes the tokenized data: sources, tokenizer and template, and the data settings."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template, sort_keys=True)
    key = {
        "version": CACHE_VERSION,
        "train": train.fingerprint,
        "eval": evaluation.fingerprint if evaluation else None,
        "tokenizer": hashlib.sha256(vocabulary.encode()).hexdigest(),
        "template": template,
        "eos": tokenizer.eos_token,
        "settings": settings_table.changing(settings, ("data",)),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save(cache: str, train: Any, evaluation: Any | None, report: dict) -> None:
    """Build the entry aside and rename it into place: a cache folder with report.json is complete.  Older entries go."""
    import datasets

    datasets.disable_progress_bars()
    with staged(cache) as partial:
        train.save_to_disk(os.path.join(partial, "train"))
        if evaluation is not None:
            evaluation.save_to_disk(os.path.join(partial, "eval"))
        write_json(os.path.join(partial, "report.json"), report)
    root = os.path.dirname(cache)
    for other in os.listdir(root):
        if other != os.path.basename(cache):
            shutil.rmtree(os.path.join(root, other), ignore_errors=True)


def load(cache: str) -> tuple[Any, Any | None, dict]:
    """The cached train and validation datasets and the report they were checked with."""
    import datasets

    report = read_json(os.path.join(cache, "report.json"))
    train = datasets.load_from_disk(os.path.join(cache, "train"))
    evaluation = datasets.load_from_disk(os.path.join(cache, "eval")) if os.path.isdir(os.path.join(cache, "eval")) else None
    print(f"fulltune: data: reusing the checked, tokenized data in {cache} ({len(train)} train rows): no re-tokenization", flush=True)
    return train, evaluation, report
