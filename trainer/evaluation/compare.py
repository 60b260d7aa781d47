"""Base against fine-tuned: one table, told the same way in the log, MLflow, the registry and the report.

    rows(base, tuned, better)  -> [{"task", "metric", "base", "tuned", "change", "higher_is_better"}, ...]
    drops(rows, limit)         -> the gate's words for each benchmark that fell by more than `limit`

`change` is tuned - base; a drop is a change against the metric's direction (lm-eval says which way is better).
A `limit` run scored each task's first N samples only: every place that shows the numbers says so.
"""

from __future__ import annotations

from typing import Any


def rows(base: dict[str, dict[str, float]], tuned: dict[str, dict[str, float]], better: dict[str, dict[str, bool]]) -> list[dict[str, Any]]:
    table = []
    for task, metrics in tuned.items():
        for metric, value in metrics.items():
            if metric in base.get(task, {}):
                table.append({"task": task, "metric": metric, "base": base[task][metric], "tuned": value, "change": value - base[task][metric],
                              "higher_is_better": better.get(task, {}).get(metric.split("/")[0], True)})
    return table


def drop(row: dict[str, Any]) -> float:
    return -row["change"] if row["higher_is_better"] else row["change"]


def drops(table: list[dict[str, Any]], limit: float) -> list[str]:
    return [f"{row['task']} {row['metric']} fell from {row['base']:.4f} to {row['tuned']:.4f} ({drop(row):.4f} worse, more than "
            f"FT_EVAL_MAX_REGRESSION={limit:g})" for row in table if limit and drop(row) > limit]


def limit_words(limit: int) -> str:
    return f"FT_EVAL_LIMIT={limit}: each task's first {limit} samples" if limit else ""


def line(summary: dict[str, Any]) -> str:
    """The log's one line: every benchmark and the own-task scores, base -> fine-tuned."""
    parts = [f"{r['task']} {r['metric']} {r['base']:.3f} -> {r['tuned']:.3f} ({r['change']:+.3f})" for r in summary["benchmarks"]]
    own = summary.get("own_task") or {}
    if own.get("tuned"):
        b, t = own["base"], own["tuned"]
        parts.append(f"own task ({own['rows']} validation rows) exact match {b['exact_match']:.0%} -> {t['exact_match']:.0%}, "
                     f"chrF {b['chrf']:.1f} -> {t['chrf']:.1f}")
    limited = f" [{limit_words(summary['limit'])}]" if summary["limit"] and summary["benchmarks"] else ""
    return "fulltune: evaluation, base -> fine-tuned: " + ("; ".join(parts) or "nothing to evaluate") + limited


def metrics(summary: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics: eval/<task>/<metric>/{base,tuned,change}, and eval/own_task/{exact_match,chrf}/{base,tuned,change}."""
    out = {}
    for r in summary["benchmarks"]:
        out |= {f"eval/{r['task']}/{r['metric']}/{k}": r[k] for k in ("base", "tuned", "change")}
    own = summary.get("own_task") or {}
    for metric in own.get("tuned", {}):
        b, t = own["base"][metric], own["tuned"][metric]
        out |= {f"eval/own_task/{metric}/base": b, f"eval/own_task/{metric}/tuned": t, f"eval/own_task/{metric}/change": t - b}
    return out


def tags(summary: dict[str, Any]) -> dict[str, str]:
    """The registered version's tags (and the run's): `eval.<task>.<metric>` = "base -> tuned (change)", `eval.limit`."""
    out = {f"eval.{r['task']}.{r['metric']}": f"{r['base']:.4f} -> {r['tuned']:.4f} ({r['change']:+.4f})" for r in summary["benchmarks"]}
    own = summary.get("own_task") or {}
    for metric, value in own.get("tuned", {}).items():
        out[f"eval.own_task.{metric}"] = f"{own['base'][metric]:.4f} -> {value:.4f} ({value - own['base'][metric]:+.4f})"
    if summary["benchmarks"]:
        out["eval.limit"] = str(summary["limit"]) if summary["limit"] else "none"
    return out


def description(summary: dict[str, Any]) -> str:
    """The registered version's description: the before/after table in Markdown (MLflow's UI renders it)."""
    lines = ["Evaluation after fine-tuning (base -> fine-tuned)" + (f", {limit_words(summary['limit'])}" if summary["limit"] else "") + ":", "",
             "| task | metric | base | fine-tuned | change |", "|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['metric']} | {r['base']:.4f} | {r['tuned']:.4f} | {r['change']:+.4f} |" for r in summary["benchmarks"]]
    own = summary.get("own_task") or {}
    for metric, value in own.get("tuned", {}).items():
        lines.append(f"| own task ({own['rows']} rows) | {metric} | {own['base'][metric]:.4f} | {value:.4f} | {value - own['base'][metric]:+.4f} |")
    return "\n".join(lines)
