"""Where rows come from: a hub dataset, a `save_to_disk` folder, or data files on disk or an object store.

Every source yields `(locator, row)` pairs, where the locator is what a user needs to find a row
again (`train.jsonl line 17`, `part-0003.parquet row 12`, `row 812`), and has a fingerprint that
identifies its content without reading it (paths, sizes and modification times or ETags; hub id,
configuration, split and revision), which keys the tokenized-data cache.

Files are read through fsspec, so `s3://`, `gs://` and `az://` URLs work with the filesystem packages
the image has (s3fs, gcsfs, adlfs; trainer/core/objectstore.py opens them); each reads its platform's
standard credentials (AWS_* variables or the pod's role, GOOGLE_APPLICATION_CREDENTIALS or workload
identity, AZURE_STORAGE_* variables or a managed identity).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from trainer.core import locations, objectstore
from trainer.core.errors import ConfigError, DataError, HubUnreachable
from trainer.core.settings import Settings

READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
EVAL_SPLITS = ("validation", "test")  # what an FT_EVAL_DATASET with several splits contributes


@dataclasses.dataclass
class Source:
    variable: str  # FT_DATASET or FT_EVAL_DATASET: named in every message
    spec: str
    fingerprint: dict
    rows: Callable[[], Iterator[tuple[str, Any]]]
    columns: Callable[[], list[str]]

    @property
    def name(self) -> str:
        return f"{self.variable}={self.spec!r}"


def own_test_split(spec: str, settings: Settings) -> str | None:
    """`test` when FT_DATASET (a hub dataset or a saved DatasetDict) has a test split besides the one trained on.

    The reference recipe evaluates on it (Capybara: 200 rows) and holds out FT_EVAL_FRACTION only
    when there is none.
    """
    if settings.dataset_split == "test":
        return None
    if not locations.is_hub_id(spec, data=True):
        fs, path = _filesystem(spec, "FT_DATASET")
        if fs.isdir(path) and fs.exists(f"{path}/dataset_dict.json"):
            return "test" if "test" in json.loads(fs.cat(f"{path}/dataset_dict.json"))["splits"] else None
        return None
    import datasets

    try:
        names = datasets.get_dataset_split_names(spec, settings.dataset_config or None, revision=settings.dataset_revision or None)
    except Exception as error:  # noqa: BLE001 - datasets wraps every failure in SplitsNotFoundError: its cause says which it was
        if _not_found(error) or _offline_and_not_cached(error):
            return None  # no such dataset (or none in the offline cache): open_source() says so, with the folder it looked in
        raise HubUnreachable(
            f"FT_DATASET={spec!r}: could not ask the hub which splits it has ({_deepest(error)}). Without the answer the job cannot tell "
            "whether to validate on its `test` split or to hold out FT_EVAL_FRACTION of the training rows, and guessing would change the data "
            "it trains on. A retry asks again; with FT_EVAL_DATASET set (or FT_EVAL_FRACTION=0) the question is not asked."
        ) from error
    return "test" if "test" in names else None


def _causes(error: BaseException) -> Iterator[BaseException]:
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def _not_found(error: BaseException) -> bool:
    """The dataset (or its configuration) does not exist: the one failure that answers the question."""
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    return any(isinstance(cause, DatasetNotFoundError | RepositoryNotFoundError | RevisionNotFoundError) for cause in _causes(error))


def _offline_and_not_cached(error: BaseException) -> bool:
    """HF_HUB_OFFLINE=1 and the cache lacks the dataset: datasets says so with a FileNotFoundError ("is not cached")."""
    from datasets import config as datasets_config

    return datasets_config.HF_HUB_OFFLINE and any(isinstance(cause, FileNotFoundError) for cause in _causes(error))


def _deepest(error: BaseException) -> str:
    root = list(_causes(error))[-1]
    return f"{type(root).__name__}: {' '.join(str(root).split())[:200]}"


def open_source(spec: str, settings: Settings, variable: str, split: str | None = None) -> Source:
    """Resolve FT_DATASET / FT_EVAL_DATASET into a Source (no rows are read yet)."""
    if split is None and variable == "FT_DATASET":
        split = settings.dataset_split
    if locations.is_hub_id(spec, data=True):  # trainer/core/locations.py decides, for the model and the data alike
        return _hub(spec, settings, split, variable)
    if why := locations.missing(variable, spec, data=True):
        raise DataError(why)
    fs, path = _filesystem(spec, variable)
    if fs.isdir(path) and any(fs.exists(f"{path}/{marker}") for marker in ("dataset_dict.json", "state.json")):
        return _saved_folder(spec, fs, path, split, variable)
    return _files(spec, fs, path, variable)


def _filesystem(spec: str, variable: str) -> tuple[Any, str]:
    try:
        return objectstore.filesystem(spec, variable)  # exit 2 naming the package an object-store URL needs
    except ConfigError as error:
        raise DataError(f"{error}, or copy the data to the volume") from error


def _files(spec: str, fs: Any, path: str, variable: str) -> Source:
    if fs.isdir(path):
        found = [p for p in fs.find(path) if not os.path.basename(p).startswith((".", "_"))]
    elif glob.has_magic(path):
        found = fs.glob(path)
    else:
        found = [path] if fs.exists(path) else []
    found = sorted(found)
    kinds = {READERS.get(os.path.splitext(p)[1].lower()) for p in found}
    if not found or None in kinds or len(kinds) != 1:
        others = sorted({os.path.splitext(p)[1] or os.path.basename(p) for p in found if READERS.get(os.path.splitext(p)[1].lower()) is None})
        raise DataError(
            f"{variable}={spec!r}: expected .jsonl, .json, .parquet or .csv files of one kind; found {len(found)} file(s)"
            + (f" including {', '.join(others)}" if others else "")
            + (f" of kinds {', '.join(sorted({os.path.splitext(p)[1].lower() for p in found if READERS.get(os.path.splitext(p)[1].lower())}))}"
               if len(kinds) > 1 else "")
        )
    kind = kinds.pop()
    infos = [fs.info(p) for p in found]
    fingerprint = {
        "files": [
            [p, i.get("size"), str(i.get("ETag") or i.get("etag") or i.get("mtime") or i.get("LastModified") or "")] for p, i in zip(found, infos, strict=True)
        ]
    }
    read = {"json": _json_rows, "parquet": _parquet_rows, "csv": _csv_rows}[kind]

    def rows() -> Iterator[tuple[str, Any]]:
        for p in found:
            yield from read(fs, p, os.path.basename(p))

    def columns() -> list[str]:
        for _, row in rows():
            if isinstance(row, dict):
                return sorted(row)
        return []

    return Source(variable, spec, fingerprint, rows, columns)


def _json_rows(fs: Any, path: str, name: str) -> Iterator[tuple[str, Any]]:
    """JSON lines (one row per line), or a JSON array of rows; a bad line becomes a row that says why."""
    with fs.open(path, "rt", encoding="utf-8") as f:
        if f.read(4096).lstrip().startswith("["):
            f.seek(0)
            try:
                rows = json.load(f)
            except json.JSONDecodeError as error:
                yield f"{name} line {error.lineno}", BadJson(error.msg, error.colno)
                return
            for i, row in enumerate(rows):
                yield f"{name} row {i}", row
            return
        f.seek(0)
        yield from _json_lines(f, name)


def _json_lines(f: Any, name: str) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(f, start=1):
        if not line.strip():
            continue
        line = line.rstrip("\r\n")  # else a line cut short reads as "Invalid control character" at the newline, not where it broke
        try:
            yield f"{name} line {number}", json.loads(line)
        except json.JSONDecodeError as error:
            yield f"{name} line {number}", BadJson(error.msg, error.colno, len(line))


@dataclasses.dataclass
class BadJson:
    """A line that is not valid JSON, kept as a row so that validation reports it like any other."""

    message: str
    column: int  # Python's, counted from 1
    length: int | None = None  # the line's characters: an error at its end means the line was cut short


def _parquet_rows(fs: Any, path: str, name: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        index = 0
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield f"{name} row {index}", row
                index += 1


def _csv_rows(fs: Any, path: str, name: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.csv as pcsv

    with fs.open(path, "rb") as f:
        table = pcsv.read_csv(f, convert_options=pcsv.ConvertOptions(strings_can_be_null=False, column_types=None))
    for index, row in enumerate(table.to_pylist()):
        yield f"{name} line {index + 2}", row  # line 1 is the header


def _saved_folder(spec: str, fs: Any, path: str, split: str | None, variable: str) -> Source:
    import datasets

    loaded = datasets.load_from_disk(spec)
    if isinstance(loaded, datasets.DatasetDict):
        loaded = _pick_split(loaded, split, variable, spec)
    stamp = [[f, fs.info(f).get("size"), str(fs.info(f).get("mtime", ""))] for f in sorted(fs.find(path))]
    return Source(variable, spec, {"saved": stamp}, lambda: _dataset_rows(loaded), lambda: list(loaded.column_names))


def _hub(spec: str, settings: Settings, split: str | None, variable: str) -> Source:
    """A hub dataset, optionally with configuration (FT_DATASET_CONFIG) and revision (FT_DATASET_REVISION) pinned.

    An unpinned revision is the default branch at download time; the cache keys on the name only,
    so pin FT_DATASET_REVISION for runs that must be reproducible.
    """
    config, revision = settings.dataset_config or None, settings.dataset_revision or None
    loaded: dict[str, Any] = {}

    def dataset() -> Any:
        if "split" not in loaded:
            import datasets
            from huggingface_hub import constants

            try:
                got = datasets.load_dataset(spec, config, revision=revision, split=split)
            except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as error:
                raise DataError(f"{variable}={spec!r}: cannot load it from the hub ({type(error).__name__}: {error}); {locations.not_local(spec)}") from error
            except ConnectionError as error:
                if not constants.HF_HUB_OFFLINE:
                    raise  # the hub answered at start (trainer/model/hub.py): a retry may help
                raise DataError(  # nothing a retry changes: the cache lacks it
                    f"{variable}={spec!r}: HF_HUB_OFFLINE=1 and the hub cache (HF_HOME) does not hold it; {locations.not_local(spec)}."
                    " Point it at local files, or fill the cache on a connected machine"
                ) from error
            loaded["split"] = _pick_split(got, None, variable, spec) if isinstance(got, datasets.DatasetDict) else got
        return loaded["split"]

    fingerprint = {"hub": spec, "config": config, "split": split or "|".join(EVAL_SPLITS), "revision": revision}
    return Source(variable, spec, fingerprint, lambda: _dataset_rows(dataset()), lambda: list(dataset().column_names))


def _pick_split(splits: Any, split: str | None, variable: str, spec: str) -> Any:
    """FT_DATASET: the split FT_DATASET_SPLIT names.  FT_EVAL_DATASET: validation, else test, else the only split."""
    wanted = [split] if split else [s for s in EVAL_SPLITS if s in splits] or (list(splits) if len(splits) == 1 else [])
    if not wanted or wanted[0] not in splits:
        setting = "FT_DATASET_SPLIT" if split else variable
        raise DataError(
            f"{setting}: {spec!r} has splits {sorted(splits)}; " + (f"{split!r} is not one of them" if split else "expected one named validation or test")
        )
    return splits[wanted[0]]


def _dataset_rows(dataset: Any) -> Iterator[tuple[str, Any]]:
    for index, row in enumerate(dataset):
        yield f"row {index}", row
