"""The data report, FT_OUTPUT_DIR/data-report.txt: what checking the rows found, as a person reads it.

It lists the bad rows with their reasons, the length summary, the trained-token fraction and one example with
its trained spans marked; it is printed, written on the volume (rank 0), and logged to the MLflow run
(`tracked`).  A dataset that cannot be trained on leaves the report and exits 2 (`fail`, `rejected`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from trainer.core import ranks
from trainer.core.errors import DataError
from trainer.core.files import write_text
from trainer.core.settings import Settings
from trainer.core.volume import Volume

if TYPE_CHECKING:
    from trainer.data.prepare import Part


def build(settings: Settings, train_source, fmt, masker, train: Part, eval_source, evaluation: Part | None, key: str) -> dict:
    """What the check found, per source, and the kept data's shape; `prepare` adds the rows kept and the example."""
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


def write(settings: Settings, report: dict, show: bool = True) -> str:
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


def fail(settings: Settings, report: dict, why: str) -> None:
    """Write the report and raise DataError (exit 2) saying why, with the bad rows shown and where the report is."""
    path = write(settings, report, show=False)
    shown = [f"  {'' if name == 'train' else 'FT_EVAL_DATASET '}{line}" for name, part in report["sources"].items() for line in part["bad_shown"]]
    counts = ", ".join(f"{count} x {reason}" for part in report["sources"].values() for reason, count in part["bad_by_reason"].items())
    raise DataError("\n".join([f"{why}" + (f" ({counts})" if counts else ""), *shown, f"  full report: {path}"]))


def rejected(settings: Settings, source_name: str, error: DataError) -> DataError:
    """A source rejected as a whole (empty, unknown format): the report says why before any row was checked."""
    path = Volume(settings.output_dir).data_report
    if ranks.is_main():
        os.makedirs(settings.output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"fulltune data report\n{source_name}: rejected before its rows were checked: {error}\n")
    return DataError(f"{error}\n  full report: {path}")


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
