"""Training data, checked before the GPU spins: read, check every row, mask, apply the length policy, cache.

    prepared = data.prepare(settings, tokenizer)   # before MLflow: a bad dataset exits 2, leaving only the report
    tracking.log(**data.tracked(prepared.report))  # inside the MLflow run

`prepared.train` / `prepared.eval` hold `input_ids` and `labels` (-100 where no loss), which
SFTTrainer uses as they are (`skip_prepare_dataset`).  The report (FT_OUTPUT_DIR/data-report.txt,
also printed and logged to MLflow) lists the bad rows, the length summary, the trained-token
fraction and one example with its trained spans marked.  The tokenized datasets are cached on the
volume under a fingerprint of everything that shapes them, so a restart skips this work.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import shutil
from typing import Any

from trainer.core import ranks
from trainer.core import settings as settings_table
from trainer.core.errors import DataError
from trainer.core.files import read_json, staged, write_json, write_text
from trainer.core.settings import Settings
from trainer.core.volume import Volume
from trainer.data import formats, masking, sources

CACHE_VERSION = 2  # bump when the tokenized form changes (2: assistant turns with weight 0 carry no loss)
SHOWN = 20  # bad rows listed in messages and the report; all are counted
CHUNK = 512  # rows tokenized per batch


@dataclasses.dataclass
class Prepared:
    train: Any
    eval: Any | None
    report: dict


@dataclasses.dataclass
class _Part:
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
    key = _fingerprint(settings, tokenizer, train_source, eval_source)
    cache = os.path.join(Volume(settings.output_dir).data_cache, key)
    if settings.data_cache and os.path.exists(os.path.join(cache, "report.json")):
        return _from_cache(cache)
    print(f"fulltune: data: checking and tokenizing {train_source.name}" + (f" and {eval_source.name}" if eval_source else ""), flush=True)
    train_format = _format(train_source, settings)
    masker = masking.Masker(tokenizer, settings.loss_on, train_format)
    train = _read(train_source, train_format, masker, settings)
    evaluation = _read(eval_source, _format(eval_source, settings), masker, settings) if eval_source else None
    report = _report(settings, train_source, train_format, masker, train, eval_source, evaluation, key)
    bad = sum(sum(part.bad_counts.values()) for part in (train, evaluation) if part)
    if bad and settings.bad_rows == "fail":
        _fail(settings, report, f"{bad} bad row(s); fix them or set FT_BAD_ROWS=skip to leave them out")
    train_set = _dataset(train)
    eval_set = _dataset(evaluation) if evaluation else None
    if len(train_set) == 0:
        _fail(
            settings,
            report,
            "no training rows left" + (" after skipping bad rows" if train.bad_counts else "") + (" and dropping long rows" if train.dropped_too_long else ""),
        )
    if eval_source is None and settings.eval_fraction > 0:
        held_out = math.ceil(len(train_set) * settings.eval_fraction)
        if len(train_set) - held_out < 1:
            _fail(
                settings,
                report,
                f"only {len(train_set)} usable row(s): too few to hold out "
                f"FT_EVAL_FRACTION={settings.eval_fraction}; set FT_EVAL_FRACTION=0 or FT_EVAL_DATASET",
            )
        parts = train_set.train_test_split(test_size=held_out, seed=settings.seed)  # the reference recipe's split
        train_set, eval_set = parts["train"], parts["test"]
    if eval_set is not None and len(eval_set) == 0:
        _fail(settings, report, f"{eval_source.name}: no validation rows left")
    report["rows"] = {"train": len(train_set), "eval": len(eval_set) if eval_set is not None else 0}
    report["eval_repeats_train"] = _repeated(train_set, eval_set)
    if report["eval_repeats_train"]:
        print(
            f"fulltune: warning: {report['eval_repeats_train']} of {len(eval_set)} validation row(s) repeat a training row token for token:"
            " the eval loss on them measures memory, not generalisation; remove them from the validation data",
            flush=True,
        )
    report["example"] = masking.show(tokenizer, train_set[0]["input_ids"], train_set[0]["labels"])
    _write_report(settings, report)
    if settings.data_cache and ranks.is_main():
        _save_cache(cache, train_set, eval_set, report)
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
        path = Volume(settings.output_dir).data_report
        if ranks.is_main():
            os.makedirs(settings.output_dir, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"fulltune data report\n{source.name}: rejected before its rows were checked: {error}\n")
        raise DataError(f"{error}\n  full report: {path}") from error


def _read(source: sources.Source, fmt: str, masker: masking.Masker, settings: Settings) -> _Part:
    part, pending = _Part(), []

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


def _bad(part: _Part, locator: str, problem: formats.Problem) -> None:
    part.bad_counts[problem.reason] += 1
    if len(part.bad) < SHOWN:
        part.bad.append((locator, problem.detail))


def _dataset(part: _Part) -> Any:
    import datasets

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")), "labels": datasets.List(datasets.Value("int32"))})
    return datasets.Dataset.from_dict({"input_ids": part.ids, "labels": part.labels}, features=features)


def _report(settings: Settings, train_source, fmt, masker, train: _Part, eval_source, evaluation: _Part | None, key: str) -> dict:
    lengths = sorted(len(ids) for ids in train.ids) or [0]
    tokens = sum(lengths)
    trained = sum(sum(label != -100 for label in labels) for labels in train.labels)
    parts = {"train": (train_source, train), **({"eval": (eval_source, evaluation)} if evaluation else {})}
    return {
        "sources": {
            name: {
                "source": source.name,
                "rows_read": part.rows_read,
                "bad_rows": sum(part.bad_counts.values()),
                "bad_by_reason": dict(part.bad_counts.most_common()),
                "bad_shown": [f"{loc}: {detail}" for loc, detail in part.bad],
                "truncated": part.truncated,
                "dropped_too_long": part.dropped_too_long,
                "longest_tokens": part.longest,
            }
            for name, (source, part) in parts.items()
        },
        "format": fmt,
        "bad_rows_policy": settings.bad_rows,
        "loss_on": settings.loss_on,
        "mask": masker.method,
        "max_length": settings.max_length,
        "truncation": settings.truncation,
        "train_tokens": tokens,
        "trained_token_fraction": round(trained / tokens, 4) if tokens else 0.0,
        "token_lengths": {
            "min": lengths[0],
            "median": lengths[len(lengths) // 2],
            "p95": lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))],
            "max": lengths[-1],
        },
        "fingerprint": key,
    }


def report_text(report: dict) -> str:
    lines = [f"fulltune data report (fingerprint {report['fingerprint']})"]
    for name, part in report["sources"].items():
        lines.append(
            f"{name}: {part['source']}, format {report['format']}: {part['rows_read']} rows read, {part['bad_rows']} bad"
            f" (FT_BAD_ROWS={report['bad_rows_policy']}), {part['truncated']} truncated, {part['dropped_too_long']} dropped as too long"
            f" (FT_TRUNCATION={report['truncation']}, FT_MAX_LENGTH={report['max_length']}"
            + (f", longest {part['longest_tokens']} tokens)" if part["longest_tokens"] else ")")
        )
        lines += [f"  {count} x {reason}" for reason, count in part["bad_by_reason"].items()]
        lines += [f"  {shown}" for shown in part["bad_shown"]]
        if part["bad_rows"] > len(part["bad_shown"]):
            lines.append(f"  ... {part['bad_rows'] - len(part['bad_shown'])} more")
    if "rows" in report:
        t = report["token_lengths"]
        lines.append(
            f"kept {report['rows']['train']} train / {report['rows']['eval']} validation rows; tokens per train row min {t['min']},"
            f" median {t['median']}, p95 {t['p95']}, max {t['max']}; {report['train_tokens']} tokens"
        )
        lines.append(f"loss on {report['mask']}: {report['trained_token_fraction']:.1%} of the train tokens")
        if report.get("eval_repeats_train"):
            lines.append(f"warning: {report['eval_repeats_train']} validation row(s) repeat a training row")
        lines.append("example (trained spans in ⟦ ⟧):\n" + report["example"][:4000])
    return "\n".join(lines) + "\n"


def _write_report(settings: Settings, report: dict, show: bool = True) -> str:
    """`show`: print it too; a failure does not, since its error lists the bad rows (they would show twice)."""
    path = Volume(settings.output_dir).data_report
    if not ranks.is_main():  # the others only read what rank 0 wrote
        return path
    write_text(path, report_text(report))
    if show:
        heading, *lines = report_text(report).rstrip().split("\n")
        print("\n".join([f"fulltune: {heading.removeprefix('fulltune ')}: {os.path.abspath(path)}",
                         *(f"fulltune: data: {line}" for line in lines)]), flush=True)
    return path


def _fail(settings: Settings, report: dict, why: str) -> None:
    path = _write_report(settings, report, show=False)
    shown = [f"  {'' if name == 'train' else 'FT_EVAL_DATASET '}{line}" for name, part in report["sources"].items() for line in part["bad_shown"]]
    counts = ", ".join(f"{count} x {reason}" for part in report["sources"].values() for reason, count in part["bad_by_reason"].items())
    raise DataError("\n".join([f"{why}" + (f" ({counts})" if counts else ""), *shown, f"  full report: {path}"]))


def tracked(report: dict) -> dict[str, Any]:
    """The data report as the job's MLflow run shows it (tracking.log): tags, metrics, and the report and example."""
    train = report["sources"]["train"]
    metrics = {
        "data_train_rows": report["rows"]["train"],
        "data_eval_rows": report["rows"]["eval"],
        "data_train_tokens": report["train_tokens"],
        "data_trained_token_fraction": report["trained_token_fraction"],
        "data_bad_rows": train["bad_rows"],
        "data_truncated_rows": train["truncated"],
        "data_dropped_too_long_rows": train["dropped_too_long"],
    }
    metrics |= {f"data_tokens_{k}": v for k, v in report["token_lengths"].items()}
    metrics |= {f"data_skipped_{reason.replace(' ', '_')}": n for reason, n in train["bad_by_reason"].items()}
    return {
        "tags": {"data_format": report["format"], "data_mask": report["mask"], "data_fingerprint": report["fingerprint"]},
        "metrics": metrics,
        "artifacts": {"data/report.json": report, "data/report.txt": report_text(report), "data/example.txt": report["example"]},
    }


def _fingerprint(settings: Settings, tokenizer: Any, train: sources.Source, evaluation: sources.Source | None) -> str:
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


def _save_cache(cache: str, train: Any, evaluation: Any | None, report: dict) -> None:
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


def _from_cache(cache: str) -> Prepared:
    import datasets

    report = read_json(os.path.join(cache, "report.json"))
    train = datasets.load_from_disk(os.path.join(cache, "train"))
    evaluation = datasets.load_from_disk(os.path.join(cache, "eval")) if os.path.isdir(os.path.join(cache, "eval")) else None
    print(f"fulltune: data: reusing the checked, tokenized data in {cache} ({len(train)} train rows): no re-tokenization", flush=True)
    return Prepared(train, evaluation, report)
