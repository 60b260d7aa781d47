"""Training data, checked before the GPU spins: read, check every row, mask, apply the length policy, cache.

    prepared = data.prepare(settings, tokenizer)          # before MLflow: a bad dataset exits 2, leaving only the report
    tracking.log(**data_report.tracked(prepared.report))  # inside the MLflow run

`prepared.train` / `prepared.eval` hold `input_ids` and `labels` (-100 where no loss), which
SFTTrainer uses as they are (`skip_prepare_dataset`).  The report (FT_OUTPUT_DIR/data-report.txt,
also printed and logged to MLflow) lists the bad rows, the length summary, the trained-token
fraction and one example with its trained spans marked (data_report.py).  The tokenized datasets are
cached on the volume under a fingerprint of everything that shapes them, so a restart skips this work
(cache.py).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import os
from typing import Any

from trainer.core import ranks
from trainer.core.errors import DataError
from trainer.core.settings import Settings
from trainer.core.volume import Volume
from trainer.data import cache as data_cache
from trainer.data import data_report, formats, masking, sources

SHOWN = 20  # bad rows listed in messages and the report; all are counted
CHUNK = 512  # rows tokenized per batch


@dataclasses.dataclass
class Prepared:
    train: Any
    eval: Any | None
    report: dict


@dataclasses.dataclass
class Part:
    """One source after checking and tokenizing: its rows and what happened to the others."""

    ids: list = dataclasses.field(default_factory=list)
    labels: list = dataclasses.field(default_factory=list)
    rows_read: int = 0
    bad: list = dataclasses.field(default_factory=list)  # (locator, detail) of the first SHOWN
    bad_counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    truncated: int = 0
    dropped_too_long: int = 0
    longest: int = 0


def prepare(settings: Settings, tokenizer: Any) -> Prepared:
    """Train and validation datasets ready for SFTTrainer, and the data report; DataError (exit 2) when unusable."""
    train_source = sources.open_source(settings.dataset, settings, "FT_DATASET")
    if settings.eval_dataset:
        eval_source = sources.open_source(settings.eval_dataset, settings, "FT_EVAL_DATASET")
    elif split := sources.own_test_split(settings.dataset, settings):
        eval_source = sources.open_source(settings.dataset, settings, "FT_DATASET", split=split)
    else:
        eval_source = None
    key = data_cache.fingerprint(settings, tokenizer, train_source, eval_source)
    cache = os.path.join(Volume(settings.output_dir).data_cache, key)
    if settings.data_cache and data_cache.complete(cache):
        return Prepared(*data_cache.load(cache))
    print(f"fulltune: data: checking and tokenizing {train_source.name}" + (f" and {eval_source.name}" if eval_source else ""), flush=True)
    train_format = _format(train_source, settings)
    masker = masking.Masker(tokenizer, settings.loss_on, train_format)
    train = _read(train_source, train_format, masker, settings)
    evaluation = _read(eval_source, _format(eval_source, settings), masker, settings) if eval_source else None
    report = data_report.build(settings, train_source, train_format, masker, train, eval_source, evaluation, key)
    bad = sum(sum(part.bad_counts.values()) for part in (train, evaluation) if part)
    if bad and settings.bad_rows == "fail":
        data_report.fail(settings, report, f"{bad} bad row(s); fix them or set FT_BAD_ROWS=skip to leave them out")
    train_set = _dataset(train)
    eval_set = _dataset(evaluation) if evaluation else None
    if len(train_set) == 0:
        data_report.fail(
            settings,
            report,
            "no training rows left" + (" after skipping bad rows" if train.bad_counts else "") + (" and dropping long rows" if train.dropped_too_long else ""),
        )
    if eval_source is None and settings.eval_fraction > 0:
        held_out = math.ceil(len(train_set) * settings.eval_fraction)
        if len(train_set) - held_out < 1:
            data_report.fail(
                settings,
                report,
                f"only {len(train_set)} usable row(s): too few to hold out "
                f"FT_EVAL_FRACTION={settings.eval_fraction}; set FT_EVAL_FRACTION=0 or FT_EVAL_DATASET",
            )
        parts = train_set.train_test_split(test_size=held_out, seed=settings.seed)  # the reference recipe's split
        train_set, eval_set = parts["train"], parts["test"]
    if eval_set is not None and len(eval_set) == 0:
        data_report.fail(settings, report, f"{eval_source.name}: no validation rows left")
    report["rows"] = {"train": len(train_set), "eval": len(eval_set) if eval_set is not None else 0}
    report["eval_source"] = eval_source.name if eval_source else (f"FT_EVAL_FRACTION={settings.eval_fraction:g} of {train_source.name}, seed "
                                                                  f"{settings.seed}" if eval_set is not None else "none")
    report["eval_repeats_train"] = _repeated(train_set, eval_set)
    if report["eval_repeats_train"]:
        print(
            f"fulltune: warning: {report['eval_repeats_train']} of {len(eval_set)} validation row(s) repeat a training row token for token:"
            " the eval loss on them measures memory, not generalisation; remove them from the validation data",
            flush=True,
        )
    report["example"] = masking.show(tokenizer, train_set[0]["input_ids"], train_set[0]["labels"])
    data_report.write(settings, report)
    if settings.data_cache and ranks.is_main():
        data_cache.save(cache, train_set, eval_set, report)
    return Prepared(train_set, eval_set, report)


def _format(source: sources.Source, settings: Settings) -> str:
    """The source's row format; a source rejected as a whole (empty, unknown format) still leaves data-report.txt saying why."""
    try:
        columns = source.columns()
        if not columns:
            if next(source.rows(), None) is None:
                raise DataError(f"{source.name}: no rows (the file is empty)")
            return "messages" if settings.data_format == "auto" else settings.data_format  # every row is bad: each says why
        return formats.detect(columns, settings.data_format, source.name)
    except DataError as error:
        raise data_report.rejected(settings, source.name, error) from error


def _read(source: sources.Source, fmt: str, masker: masking.Masker, settings: Settings) -> Part:
    part, pending = Part(), []

    def flush() -> None:
        if settings.bad_rows == "fail" and part.bad_counts:
            pending.clear()  # the job fails anyway: keep checking rows, skip tokenizing them
            return
        for (locator, _), result in zip(pending, masker.encode([row for _, row in pending]), strict=True):
            if isinstance(result, formats.Problem):
                _bad(part, locator, result)
                continue
            ids, trained = result
            part.longest = max(part.longest, len(ids))
            if len(ids) > settings.max_length:
                if settings.truncation == "drop":
                    part.dropped_too_long += 1
                    continue
                ids, trained = ids[: settings.max_length], trained[: settings.max_length]
                part.truncated += 1
            if not any(trained[1:]):  # the label of token 0 is never used: the model predicts token i from tokens < i
                limit = f" within FT_MAX_LENGTH={settings.max_length} tokens" if len(trained) == settings.max_length else ""
                _bad(part, locator, formats.Problem("no trained token", f"no assistant token{limit} carries loss"))
                continue
            part.ids.append(ids)
            part.labels.append([t if keep else -100 for t, keep in zip(ids, trained, strict=True)])
        pending.clear()

    for locator, row in source.rows():
        part.rows_read += 1
        try:
            pending.append((locator, formats.convert(row, fmt, masker.control_tokens)))
        except formats.Problem as problem:
            _bad(part, locator, problem)
        if len(pending) >= CHUNK:
            flush()
    flush()
    return part


def _repeated(train: Any, evaluation: Any | None) -> int:
    """Validation rows whose tokens equal a training row's (hashed: one pass over each, no pairwise comparison)."""
    if evaluation is None:
        return 0
    seen = {hashlib.blake2b(bytes(str(ids), "ascii"), digest_size=16).digest() for ids in train["input_ids"]}
    return sum(hashlib.blake2b(bytes(str(ids), "ascii"), digest_size=16).digest() in seen for ids in evaluation["input_ids"])


def _bad(part: Part, locator: str, problem: formats.Problem) -> None:
    part.bad_counts[problem.reason] += 1
    if len(part.bad) < SHOWN:
        part.bad.append((locator, problem.detail))


def _dataset(part: Part) -> Any:
    import datasets

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")), "labels": datasets.List(datasets.Value("int32"))})
    return datasets.Dataset.from_dict({"input_ids": part.ids, "labels": part.labels}, features=features)


