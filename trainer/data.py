"""Training data: load from the hub or local files, split off validation rows."""

from __future__ import annotations

import glob
import os
from typing import Any

from trainer.errors import DataError

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _local_files(source: str) -> tuple[str, list[str]] | None:
    """(builder, files) when `source` is a local file, a glob, or a folder of data files."""
    if os.path.isdir(source):
        files = sorted(f for f in glob.glob(os.path.join(source, "**", "*"), recursive=True) if os.path.isfile(f))
    elif glob.has_magic(source) or os.path.isfile(source):
        files = sorted(glob.glob(source))
    else:
        return None
    kinds = {LOCAL_SUFFIXES.get(os.path.splitext(f)[1].lower()) for f in files} - {None}
    if len(kinds) != 1:
        raise DataError(f"FT_DATASET={source!r}: expected .jsonl, .json, .parquet or .csv files of one kind, found {len(files)} file(s) of kinds {sorted(map(str, kinds))}")
    kind = kinds.pop()
    return kind, [f for f in files if LOCAL_SUFFIXES.get(os.path.splitext(f)[1].lower()) == kind]


def load_source(source: str, settings: Any, split: str) -> Any:
    """One split of a dataset named by `source` (save_to_disk folder, local files, or hub id)."""
    import datasets

    if os.path.isdir(source) and (os.path.exists(os.path.join(source, "dataset_dict.json")) or os.path.exists(os.path.join(source, "dataset_info.json"))):
        loaded = datasets.load_from_disk(source)
        if isinstance(loaded, datasets.DatasetDict):
            return loaded  # the caller picks the splits
        return datasets.DatasetDict({split: loaded})
    local = _local_files(source)
    if local:
        builder, files = local
        return datasets.load_dataset(builder, data_files={split: files})
    kwargs: dict[str, Any] = {}
    if settings.dataset_revision:
        kwargs["revision"] = settings.dataset_revision
    return datasets.load_dataset(source, settings.dataset_config or None, **kwargs)


def load_splits(settings: Any) -> tuple[Any, Any]:
    """(train, validation): the test split when the dataset has one, else a seeded hold-out."""
    loaded = load_source(settings.dataset, settings, settings.dataset_split)
    if settings.dataset_split not in loaded:
        raise DataError(f"FT_DATASET_SPLIT={settings.dataset_split!r}: the dataset has splits {sorted(loaded)}")
    train = loaded[settings.dataset_split]
    if settings.eval_dataset:
        evaluation = load_source(settings.eval_dataset, settings, "validation")
        evaluation = evaluation["validation"] if "validation" in evaluation else evaluation[next(iter(evaluation))]
    elif "test" in loaded and settings.dataset_split != "test":
        evaluation = loaded["test"]
    else:
        if settings.eval_fraction <= 0:
            return train, None
        parts = train.train_test_split(test_size=settings.eval_fraction, seed=settings.seed)
        train, evaluation = parts["train"], parts["test"]
    if len(train) == 0:
        raise DataError(f"FT_DATASET={settings.dataset!r}: no training rows")
    return train, evaluation
