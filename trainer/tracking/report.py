"""The run report: one HTML page that says how the run went, for a person who opens one file.

    FT_OUTPUT_DIR/report.html, and the same file as the MLflow run's `report.html` artifact, written
    at every evaluation, when a stop signal ends the job (exit 75, after the checkpoint is committed) and at the end:
      charts against step: loss and eval_loss, learning_rate, grad_norm, tokens_per_s, mem_gb
      the memory plan (trainer/model/memory.py) next to the measured peak
      the sample answers at step 0 (the base model) and at the latest evaluation (trainer/tracking/samples.py)
      the latest value of every metric, where the model and the checkpoints are, the data report

The charts plot the run's metric history as MLflow holds it, read back from the run, so the page shows
what MLflow shows; the same points are in the page as JSON (`<script id="chart-data" type="application/json">`,
{chart: {metric: [[step, value], ...]}}).  They are PNG images inside the page (base64), drawn with
matplotlib (installed with MLflow): the page needs no network and no other file, so it can be mailed,
attached or opened from an object store as it is.  Only rank 0 writes it; a failure to write it is
printed and training goes on.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import math
import os
import time
from typing import Any

from transformers import TrainerCallback

from trainer.checkpointing import commits as checkpoints
from trainer.core import ranks
from trainer.core.config import Config
from trainer.core.files import write_text
from trainer.core.volume import Volume
from trainer.data import prepare as data
from trainer.model.memory import Plan
from trainer.tracking import run as tracking

GB = 1e9
CHARTS = {  # chart id: (title, the run's metrics it plots)
    "loss": ("Loss (training, validation)", ("loss", "eval_loss")),
    "learning_rate": ("Learning rate", ("learning_rate",)),
    "grad_norm": ("Gradient norm (before clipping)", ("grad_norm",)),
    "tokens_per_s": ("Tokens per second (in optimizer steps)", ("tokens_per_s",)),
    "memory": ("Peak memory (GB)", ("mem_gb",)),
}
PROMPT_SHOWN = 1200  # characters of a sample prompt shown (its end: the question the answer follows)


class RunReport(TrainerCallback):
    """Writes the report at every evaluation (after the evaluation's metrics and sample answers are recorded:
    add it after those callbacks), and when the job calls `stopped` or `finished`."""

    def __init__(self, config: Config, plan: Plan, data_report: dict):
        self.config, self.plan, self.data_report = config, plan, data_report
        self.volume = Volume(config.settings.output_dir)

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.write(f"training: step {state.global_step} of {state.max_steps} (this page is refreshed at every evaluation and at the end)", f"step {state.global_step}")

    def stopped(self, step: int) -> None:
        self.write(f"stopped by a signal at step {step} (exit 75): that step's checkpoint is committed and running the job again resumes from it", "stopped")

    def finished(self) -> None:
        status = self.volume.status()
        if status.registered:
            outcome = f"registered as {status.registered}"
        elif not self.config.settings.registered_model:
            outcome = "not registered (FT_REGISTERED_MODEL is empty)"
        else:
            outcome = "not registered: registration failed (exit 3); running the job again registers it without training"
        self.write(f"finished: the final model is saved, {outcome}", "final", final=True)

    def write(self, status: str, when: str, final: bool = False) -> None:
        if not ranks.is_main():
            return
        started = time.perf_counter()
        try:
            write_text(self.volume.report, render(self.facts(status, final)))
            tracking.log_file(self.volume.report)
        except Exception as error:  # noqa: BLE001 - the report is for people to read; it never ends a training run
            print(f"fulltune: the run report {self.volume.report} could not be written ({type(error).__name__}: {error}); training goes on", flush=True)
            return
        print(f"fulltune: run report ({when}): {self.volume.report} in {time.perf_counter() - started:.1f} s", flush=True)

    def facts(self, status: str, final: bool) -> dict[str, Any]:
        """Everything the page shows, as plain data (render() turns it into HTML)."""
        settings, volume = self.config.settings, self.volume
        where = {"checkpoints": volume.checkpoints, "committed": [os.path.basename(path) for _, path in checkpoints.committed(volume.checkpoints)]}
        if final:
            where |= {"model": volume.final_model, "mlflow_model": volume.final, "registered": volume.status().registered}
        return {
            "title": self.config.run_name,
            "status": status,
            "final": final,
            "written": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "job": {"model": settings.model, "data": settings.dataset, "precision": self.config.precision.name, "max_steps": settings.max_steps},
            "history": tracking.metric_history(tuple(key for _, keys in CHARTS.values() for key in keys)),
            "run": tracking.run_summary(),
            "plan": {"peak": self.plan.peak, "breakdown": self.plan.breakdown, "described": self.plan.describe(), "cuda": self.config.cuda},
            "samples": read_samples(volume.eval_samples),
            "data": data.report_text(self.data_report),
            "where": where,
        }


def read_samples(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- The page ------------------------------------------------------------------------------------


def chart_series(history: dict[str, list]) -> dict[str, dict[str, list]]:
    """Each chart's points, as the page embeds them and the charts draw them."""
    return {chart: {key: [[step, value] for step, value in history.get(key, [])] for key in keys} for chart, (_, keys) in CHARTS.items()}


def render(facts: dict[str, Any]) -> str:
    """The whole page, charts inside."""
    series = chart_series(facts["history"])
    planned = facts["plan"]["peak"]
    measured = max((v for _, v in series["memory"]["mem_gb"] if math.isfinite(v)), default=None)
    images = "\n".join(_image(chart, points, planned / GB if chart == "memory" else None) for chart, points in series.items())
    chart_data = json.dumps(series).replace("</", "<\\/")  # NaN stays NaN (Python's json reads it; the page never parses it)
    job = facts["job"]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(facts["title"])}: run report</title>
<style>{STYLE}</style></head>
<body>
<h1>{_e(facts["title"])}</h1>
<p class="status">{_e(facts["status"])}</p>
<p>{_e(job["model"])} on {_e(job["data"])}, {_e(job["precision"])}, {job["max_steps"]} steps. Written {_e(facts["written"])}.</p>
<h2>Training</h2>
<div class="charts">
{images}
</div>
<script id="chart-data" type="application/json">{chart_data}</script>
<h2>Memory: plan and measured peak</h2>
{_memory(facts["plan"], measured)}
<h2>Sample answers</h2>
{_samples(facts["samples"])}
<h2>{"Final metrics" if facts["final"] else "Latest metrics"}</h2>
{_metrics(facts["run"])}
<h2>Where things are</h2>
{_where(facts["where"], facts["run"])}
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
"""


def chart_png(title: str, points: dict[str, list], plan_gb: float | None = None) -> bytes:
    """One chart as PNG bytes: each metric's points in step order, joined by a line."""
    from matplotlib.figure import Figure  # not pyplot: no global figure state, no GUI backend (Agg draws the PNG)

    figure = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    for key, pairs in points.items():
        ordered = sorted(pairs, key=lambda pair: pair[0])  # stable: a step redone after a resume keeps its order
        axes.plot([s for s, _ in ordered], [v for _, v in ordered], marker="o" if len(ordered) < 30 else None, markersize=3, label=key)
    if plan_gb is not None:
        axes.axhline(plan_gb, linestyle="--", color="grey", label=f"plan: {plan_gb:.3g} GB")
    if not any(points.values()):
        axes.text(0.5, 0.5, "no values logged yet", ha="center", va="center", transform=axes.transAxes, color="grey")
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    if any(points.values()) or plan_gb is not None:
        axes.legend(loc="best", fontsize="small")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _image(chart: str, points: dict[str, list], plan_gb: float | None) -> str:
    title = CHARTS[chart][0]
    plan = f' data-plan-gb="{plan_gb!r}"' if plan_gb is not None else ""
    return f'<figure><img data-chart="{chart}"{plan} alt="{_e(title)}" src="data:image/png;base64,{base64.b64encode(chart_png(title, points, plan_gb)).decode()}"></figure>'


def _memory(plan: dict, measured: float | None) -> str:
    rows = "".join(f"<tr><td>{_e(name)}</td><td class=n>{value / GB:.3g}</td></tr>" for name, value in plan["breakdown"].items())
    what = (
        "torch.cuda.max_memory_allocated: the tensors the allocator handed out (not the CUDA context or its cache)"
        if plan["cuda"]
        else "the peak resident memory of the training process: everything it holds (Python, libraries, data), where the plan counts training tensors only"
    )
    shown = f"{measured:.3g} GB" if measured is not None else "not measured yet"
    return (
        f"<p>{_e(plan['described'])}</p>"
        f"<table><tr><th>Planned (GB)</th><th></th></tr>{rows}<tr><th>planned peak</th><th class=n>{plan['peak'] / GB:.3g}</th></tr>"
        f"<tr><th>measured peak</th><th class=n>{_e(shown)}</th></tr></table><p>Measured: {_e(what)}.</p>"
    )


def _samples(rows: list[dict]) -> str:
    if not rows:
        return "<p>None (FT_EVAL_SAMPLES=0, no validation rows, or several processes sharing the model with FSDP).</p>"
    steps = sorted({row["step"] for row in rows})
    first, last = steps[0], steps[-1]
    before = {row["row"]: row for row in rows if row["step"] == first}
    after = {row["row"]: row for row in rows if row["step"] == last}
    head = f"<tr><th>Prompt</th><th>Reference</th><th>Step {first}{' (base model)' if first == 0 else ''}</th>" + (f"<th>Step {last}</th>" if last != first else "") + "</tr>"
    body = ""
    for index, sample in before.items():
        prompt = sample["prompt"] if len(sample["prompt"]) <= PROMPT_SHOWN else "…" + sample["prompt"][-PROMPT_SHOWN:]
        later = _answer(after[index]["answer"]) if last != first and index in after else ""
        body += f"<tr><td><pre>{_e(prompt)}</pre></td><td><pre>{_e(sample['reference'])}</pre></td>{_answer(sample['answer'])}{later}</tr>"
    note = f"Greedy answers to the same validation prompts; answers at steps {', '.join(map(str, steps))} are in eval-samples.jsonl."
    return f"<p>{_e(note)}</p><table>{head}{body}</table>"


def _answer(text: str) -> str:
    return f"<td><pre>{_e(text)}</pre></td>" if text else '<td class="empty">(empty: only special tokens or none)</td>'


def _metrics(run: dict) -> str:
    shown = {k: v for k, v in sorted(run.get("metrics", {}).items()) if not k.startswith(("system/", "data_"))}
    if not shown:
        return "<p>No metrics yet.</p>"
    return "<table>" + "".join(f"<tr><td>{_e(k)}</td><td class=n>{v:.6g}</td></tr>" for k, v in shown.items()) + "</table>"


def _where(where: dict, run: dict) -> str:
    rows = []
    if "model" in where:
        rows += [("Final model (transformers folder)", where["model"]), ("Final model (MLflow model)", where["mlflow_model"]), ("Registered", where["registered"] or "no")]
    rows.append(("Checkpoints", f"{where['checkpoints']} (committed: {', '.join(where['committed']) or 'none yet'})"))
    if run:
        rows.append(("MLflow run", f"{run['run_id']} (experiment {run['experiment_id']}) at {run['tracking_uri']}"))
    return "<table>" + "".join(f"<tr><th>{_e(name)}</th><td>{_e(str(value))}</td></tr>" for name, value in rows) + "</table>"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
