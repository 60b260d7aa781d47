"""The run report's page: plain facts in, one self-contained HTML page out (charts as PNG images inside it).

    render(facts) -> str      # facts: what RunReport.facts() gathers (trainer/report/report.py)
"""

from __future__ import annotations

import base64
import datetime
import html
import json
import math
import re
import time
from typing import Any

from trainer.core.secrets import SECRET_NAME
from trainer.data.chatml import IM_END, IM_START
from trainer.evaluation import scoring
from trainer.report.chart import chart_png
from trainer.tracking.server import scrub

GB = 1e9
CHARTS = {  # chart id: (title, the run's metrics it plots)
    "loss": ("Loss (training, validation)", ("loss", "eval_loss")),
    "learning_rate": ("Learning rate", ("learning_rate",)),
    "grad_norm": ("Gradient norm (before clipping)", ("grad_norm",)),
    "tokens_per_s": ("Tokens per second (in optimizer steps)", ("tokens_per_s",)),
    "memory": ("Peak memory (GB)", ("mem_gb",)),
}
PROMPT_SHOWN = 1200  # characters of a sample prompt shown (its end: the question the answer follows)


def chart_series(history: dict[str, list]) -> dict[str, dict[str, list]]:
    """Each chart's points, as the page embeds them and the charts draw them."""
    return {chart: {key: [[step, value] for step, value in history.get(key, [])] for key in keys} for chart, (_, keys) in CHARTS.items()}


def render(facts: dict[str, Any]) -> str:
    """The whole page, charts inside."""
    series = chart_series(facts["history"])
    plan = facts["plan"]
    measured = max((v for _, v in series["memory"]["mem_gb"] if math.isfinite(v)), default=None)
    plan_gb = plan["peak"] / GB if plan["cuda"] else None  # on CPU the GPU plan against the process's RSS would read as an overrun
    images = "\n".join(_image(chart, points, plan_gb if chart == "memory" else None) for chart, points in series.items())
    chart_data = json.dumps(series).replace("</", "<\\/")  # NaN stays NaN (Python's json reads it; the page never parses it)
    job = facts["job"]
    attempts = facts.get("attempts") or []
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(facts["title"])}: run report</title>
<style>{STYLE}</style></head>
<body>
<h1>{_e(facts["title"])}</h1>
{status_line(facts["status"])}
<p>{_e(job["model"])} on {_e(job["data"])}, {_e(job["precision"])}, {job["max_steps"]} steps.{_e(_wall(attempts))} Written {_e(facts["written"])}.</p>
<h2>Training</h2>
<div class="charts">
{images}
</div>
<script id="chart-data" type="application/json">{chart_data}</script>
<h2>Memory: plan and measured peak</h2>
{_memory(plan, measured)}
<h2>Did the fine-tune help? Base against fine-tuned</h2>
{evaluation_section(facts.get("evaluation"))}
<h2>Sample answers</h2>
{_samples(facts["samples"])}
<h2>{"Final metrics" if facts["final"] else "Latest metrics"}</h2>
{_metrics(facts["run"])}
<h2>Attempts</h2>
{_attempts(attempts)}
<h2>Where things are</h2>
{_where(facts["where"], facts["run"])}
<h2>Hyperparameters</h2>
{_hyperparameters(facts.get("hyperparameters") or {})}
<h2>Data</h2>
<pre>{_e(facts["data"])}</pre>
</body></html>
"""


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
.status { font-size: 1.15em; font-weight: 600; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 1em; }
figure { margin: 0; } figure img { width: 100%; border: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0 1em; } td, th { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
td.empty { color: #888; font-style: italic; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; }
body > pre { background: #f6f6f6; padding: 1em; }
.turn { margin: 0 0 0.4em; } .role { font-size: 0.8em; font-weight: 600; text-transform: uppercase; color: #666; display: block; }
h3 { font-size: 1em; margin: 1em 0 0.2em; } .note { color: #555; }
"""


def _image(chart: str, points: dict[str, list], plan_gb: float | None) -> str:
    title = CHARTS[chart][0]
    plan = f' data-plan-gb="{plan_gb!r}"' if plan_gb is not None else ""
    return (f'<figure><img data-chart="{chart}"{plan} alt="{_e(title)}" '
            f'src="data:image/png;base64,{base64.b64encode(chart_png(title, points, plan_gb)).decode()}"></figure>')


def _memory(plan: dict, measured: float | None) -> str:
    rows = "".join(f"<tr><td>{_e(name)}</td><td class=n>{value / GB:.3g}</td></tr>" for name, value in plan["breakdown"].items())
    if plan["cuda"]:
        what = "torch.cuda.max_memory_allocated: the tensors the allocator handed out (not the CUDA context or its cache), the same quantity the plan estimates"
    else:
        what = (
            "on CPU the measured peak is the training process's resident memory (Python, libraries, data and tensors), while the plan "
            "estimates the training tensors a GPU would hold: the two are not the same quantity, so the chart leaves the plan out"
        )
    shown = f"{measured:.3g} GB" if measured is not None else "not measured yet"
    return (
        f"<p>{_e(plan['described'])}</p>"
        f"<table><tr><th>Planned (GB)</th><th></th></tr>{rows}<tr><th>planned peak</th><th class=n>{plan['peak'] / GB:.3g}</th></tr>"
        f"<tr><th>measured peak</th><th class=n>{_e(shown)}</th></tr></table><p class=note>Measured: {_e(what)}.</p>"
    )


EVALUATION = re.compile(r"<!-- evaluation -->.*?<!-- /evaluation -->", re.S)
STATUS = re.compile(r'<p class="status">.*?</p>', re.S)


def status_line(status: str) -> str:
    return f'<p class="status">{_e(status)}</p>'


def evaluation_section(summary: dict | None) -> str:
    """The evaluation's part of the page, between markers: a restart that only evaluates (its charts' history is
    another attempt's) replaces this part and the status line of the page the training attempt wrote (`refreshed`)."""
    return f"<!-- evaluation -->{_evaluation(summary)}<!-- /evaluation -->"


def refreshed(page: str, summary: dict | None, status: str) -> str:
    return STATUS.sub(lambda _: status_line(status), EVALUATION.sub(lambda _: evaluation_section(summary), page, count=1), count=1)


def _evaluation(summary: dict | None) -> str:
    """The evaluation stage's table (trainer/evaluation/): each benchmark and the own-task scores, then its best and worst answers."""
    if not summary:
        return "<p>Not evaluated yet (the stage runs after the final model is saved), or nothing to evaluate (FT_EVAL_ROWS=0, FT_EVAL_TASKS empty).</p>"
    limit = summary.get("limit")
    note = (f"<p class=note>FT_EVAL_LIMIT={limit}: each task was scored on its first {limit} samples only; the numbers are a cheap "
            "check, not the benchmark's score.</p>" if limit and summary["benchmarks"] else "")
    rows = [(f"{r['task']}", r["metric"], r["base"], r["tuned"], r["change"]) for r in summary["benchmarks"]]
    own = summary.get("own_task") or {}
    rows += [(f"own task ({own['rows']} validation rows)", m, own["base"][m], v, v - own["base"][m]) for m, v in (own.get("tuned") or {}).items()]
    body = "".join(f"<tr><td>{_e(t)}</td><td>{_e(m)}</td><td class=n>{b:.4f}</td><td class=n>{a:.4f}</td><td class=n>{c:+.4f}</td></tr>"
                   for t, m, b, a, c in rows)
    table = f"<table id=evaluation><tr><th>Task</th><th>Metric</th><th>Base</th><th>Fine-tuned</th><th>Change</th></tr>{body}</table>"
    examples = ""
    for kind, shown in (("best", "Best"), ("worst", "Worst")):
        picked = (own.get("examples") or {}).get(kind) or []
        if picked:
            examples += (f"<h3>{shown} own-task answers of the fine-tuned model (chrF)</h3><table><tr><th>Prompt</th><th>Reference</th>"
                         "<th>Base model</th><th>Fine-tuned</th><th>chrF</th></tr>"
                         + "".join(f"<tr><td>{_conversation(x['prompt'])}</td><td><pre>{_e(x['reference'])}</pre></td><td><pre>{_e(x['base_answer'])}</pre>"
                                   f"</td><td><pre>{_e(x['answer'])}</pre></td><td class=n>{x['chrf']:.1f}</td></tr>" for x in picked) + "</table>")
    return note + table + examples


def _samples(rows: list[dict]) -> str:
    if not rows:
        return "<p>None (FT_EVAL_SAMPLES=0, no validation rows, or several processes sharing the model with FSDP).</p>"
    steps = sorted({row["step"] for row in rows})
    first, last = steps[0], steps[-1]
    before = {row["row"]: row for row in rows if row["step"] == first}
    after = {row["row"]: row for row in rows if row["step"] == last}
    head = (f"<tr><th>Prompt</th><th>Reference</th><th>Step {first}{' (base model)' if first == 0 else ''}</th>"
            + (f"<th>Step {last}</th>" if last != first else "") + "</tr>")
    body = ""
    for index, sample in before.items():
        later = _answer(after[index]) if last != first and index in after else ""
        body += f"<tr><td>{_conversation(sample['prompt'])}</td><td><pre>{_e(sample['reference'])}</pre></td>{_answer(sample)}{later}</tr>"
    right, answered = scoring.tally(after.values())
    note = (f"Greedy answers to the same validation prompts: {right} of {answered} exactly right at step {last} (✓: the answer is the reference). "
            f"Answers at steps {', '.join(map(str, steps))} are in eval-samples.jsonl.")
    return f"<p class=score>{_e(note)}</p><table>{head}{body}</table>"


def _answer(sample: dict) -> str:
    if not sample["answer"]:
        return '<td class="empty">(empty: only special tokens or none)</td>'
    mark = "✓ " if scoring.exactly_right(sample["answer"], sample["reference"]) else ""
    return f"<td><pre>{mark}{_e(sample['answer'])}</pre></td>"


TURN = re.compile(rf"{re.escape(IM_START)}(\w+)\n(.*?)(?:{re.escape(IM_END)}\n?|$)", re.S)  # a ChatML turn (data/chatml.py), Qwen's template


def _conversation(prompt: str) -> str:
    """A prompt as its turns (role, then what was said), the generation prompt left out; a prompt in another
    template is shown as it is, its end first when long."""
    turns = [(role, text) for role, text in TURN.findall(prompt) if text.strip()]
    if not turns or TURN.sub("", prompt).strip():
        shown = prompt if len(prompt) <= PROMPT_SHOWN else "…" + prompt[-PROMPT_SHOWN:]
        return f"<pre>{_e(shown)}</pre>"
    return "".join(f'<div class="turn"><span class="role">{_e(role)}</span><pre>{_e(text.strip())}</pre></div>' for role, text in turns)


# Metric groups, in page order: (heading, how a metric's name is matched), then each metric's unit.
GROUPS = [
    ("Validation", lambda k: k.startswith("eval_")),
    ("Throughput and time", lambda k: k in ("tokens_per_s", "mfu", "eta_s", "epoch") or k.startswith("train_") or k.endswith(("_seconds", "_runtime"))),
    ("Memory", lambda k: k == "mem_gb"),
    ("Training", lambda k: True),
]
UNITS = {"loss": "nats per token", "tokens_per_s": "tokens/s", "mem_gb": "GB", "mfu": "fraction of peak", "eta_s": "s", "epoch": "epochs",
         "learning_rate": "", "grad_norm": "", "num_tokens": "tokens", "total_flos": "FLOPs", "mean_token_accuracy": "fraction", "entropy": "nats"}


def unit(key: str) -> str:
    base = key.removeprefix("eval_").removeprefix("train_")
    if key.endswith(("_runtime", "_seconds")):
        return "s"
    if key.endswith("_per_second"):
        return "per s"
    return UNITS.get(key, UNITS.get(base, ""))


def _metrics(run: dict) -> str:
    shown = {k: v for k, v in sorted(run.get("metrics", {}).items()) if not k.startswith(("system/", "data_"))}
    if not shown:
        return "<p>No metrics yet.</p>"
    grouped: dict[str, list[tuple[str, float]]] = {heading: [] for heading, _ in GROUPS}
    for key, value in shown.items():
        grouped[next(heading for heading, belongs in GROUPS if belongs(key))].append((key, value))
    order = ["Training", "Validation", "Throughput and time", "Memory"]
    return "".join(
        f"<h3>{heading}</h3><table><tr><th>Metric</th><th>Value</th><th>Unit</th></tr>"
        + "".join(f"<tr><td>{_e(k)}</td><td class=n>{v:.6g}</td><td>{_e(unit(k))}</td></tr>" for k, v in grouped[heading])
        + "</table>"
        for heading in order
        if grouped[heading]
    )


def _attempts(attempts: list[dict]) -> str:
    """Each start of the job on this volume: from which step, how it ended, how long it ran."""
    if not attempts:
        return "<p>No attempt recorded yet.</p>"
    rows = ""
    for n, attempt in enumerate(attempts, 1):
        began = attempt.get("started")
        ended = attempt.get("ended")
        seconds = f"{ended - began:.0f} s" if began and ended else "running"
        start = f"resumed from step {attempt['from_step']}" if attempt.get("from_step") else "from step 0"
        rows += (f"<tr><td class=n>{n}</td><td>{_e(utc(began) if began else '')}</td><td>{_e(start)}</td>"
                 f"<td>{_e(attempt.get('outcome', 'running'))}</td><td class=n>{_e(seconds)}</td></tr>")
    return f"<table><tr><th>#</th><th>Started</th><th>Training</th><th>Ended</th><th>Wall time</th></tr>{rows}</table>"


def _wall(attempts: list[dict]) -> str:
    seconds = sum((a.get("ended") or time.time()) - a["started"] for a in attempts if a.get("started"))
    return f" Wall time {seconds:.0f} s over {len(attempts)} attempt(s)." if attempts else ""


def _hyperparameters(values: dict[str, str]) -> str:
    if not values:
        return "<p>Not recorded.</p>"
    shown = {name: "****" if SECRET_NAME.search(name) else scrub(str(value)) for name, value in sorted(values.items())}
    cells = "".join(f"<tr><td>{_e(name)}</td><td>{_e(value) if value != '' else '<i>(empty)</i>'}</td></tr>" for name, value in shown.items())
    return f"<p class=note>The job's effective settings (defaults included); values of secret-named settings are masked.</p><table>{cells}</table>"


def utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _where(where: dict, run: dict) -> str:
    rows = []
    if "model" in where:
        rows += [("Final model (transformers folder)", where["model"]), ("Final model (MLflow model)", where["mlflow_model"]),
                 ("Registered", where["registered"] or "no")]
    rows.append(("Checkpoints", f"{where['checkpoints']} (committed: {', '.join(where['committed']) or 'none yet'})"))
    rows += [("Run report", where.get("report", "")), ("Sample answers", where.get("samples", "")), ("Data report", where.get("data_report", ""))]
    rows = [(name, value) for name, value in rows if value != ""]
    if run:
        rows.append(("MLflow run", f"{run['run_id']} (experiment {run['experiment_id']}) at {run['tracking_uri']}"))
    return "<table>" + "".join(f"<tr><th>{_e(name)}</th><td>{_e(str(value))}</td></tr>" for name, value in rows) + "</table>"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
