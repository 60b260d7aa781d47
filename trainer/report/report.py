"""The run report: one HTML page that says how the run went, for a person who opens one file.

    FT_OUTPUT_DIR/report.html, and the same file as the MLflow run's `report.html` artifact, written
    at every evaluation, when a stop signal ends the job (exit 75, after the checkpoint is committed) and at the end:
      charts against step: loss and eval_loss, learning_rate, grad_norm, tokens_per_s, mem_gb
      the memory plan next to the measured peak (on CPU the plan's GPU estimate is not drawn against the RSS)
      the sample answers at step 0 (the base model) and at the latest evaluation, prompts shown as conversations
      the latest value of every metric, grouped, with units; the effective FT_* values (secrets masked)
      the job's attempts (started, resumed, stopped) with their wall time; absolute locations; the data report

The report knows nothing of the job's other parts: job.py passes it the facts (`ReportFacts`), the tracker
(the run's metric history) and a function that lists the committed checkpoints.

The charts plot the run's metric history as MLflow holds it, read back from the run, so the page shows
what MLflow shows; the same points are in the page as JSON (`<script id="chart-data" type="application/json">`,
{chart: {metric: [[step, value], ...]}}).  They are PNG images inside the page (base64), drawn with
Pillow (trainer/report/chart.py): the page needs no network and no other file, so it can be mailed,
attached or opened from an object store as it is.  Only rank 0 writes it; a failure to write it is
printed and training goes on.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from trainer.core import ranks
from trainer.core.files import read_json, write_text
from trainer.core.volume import Volume
from trainer.evaluation.scoring import read_samples
from trainer.report.page import CHARTS, chart_png, refreshed, render, utc
from trainer.tracking.run import Tracker

__all__ = ["CHARTS", "ReportFacts", "RunReport", "chart_png", "read_samples", "render"]

@dataclasses.dataclass(frozen=True)
class ReportFacts:
    """What the job knows before training, as the page shows it."""

    title: str  # the run's name
    model: str
    data: str
    precision: str
    max_steps: int
    output_dir: str
    plan: dict[str, Any]  # {"peak": bytes, "breakdown": {part: bytes}, "described": str, "cuda": bool}
    data_report: str  # the data report's text (data-report.txt)
    hyperparameters: dict[str, str]  # the effective FT_* values


class RunReport(TrainerCallback):
    """Writes the report at every evaluation (after the evaluation's metrics and sample answers are recorded:
    add it after those callbacks), and when the job calls `stopped` or `finished`."""

    def __init__(self, facts: ReportFacts, tracker: Tracker, committed: Callable[[], list[str]]):
        """`committed`: the names of the committed checkpoints, oldest first, when the page is written."""
        self.job, self.tracker, self.committed = facts, tracker, committed
        self.volume = Volume(facts.output_dir)

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.write(f"training: step {state.global_step} of {state.max_steps} (this page is "
                       "refreshed at every evaluation and at the end)", f"step {state.global_step}")

    def stopped(self, step: int) -> None:
        self.write(f"stopped by a signal at step {step} (exit 75): that step's checkpoint is committed and running the job again resumes from it", "stopped")

    def finished(self, refused: str | None = None) -> None:
        """`refused`: the evaluation gate's words when it kept the model from the registry (exit 9)."""
        status = self.volume.status()
        if refused:
            outcome = f"not registered (exit 9): {refused}"
        elif status.registered:
            outcome = f"registered as {status.registered}"
        elif not self.job.hyperparameters.get("FT_REGISTERED_MODEL"):
            outcome = "not registered (FT_REGISTERED_MODEL is empty)"
        else:
            outcome = "not registered: registration failed (exit 3); running the job again registers it without training"
        self.write(f"finished: the final model is saved, {outcome}", "final", final=True)

    @staticmethod
    def refresh_after_evaluation(volume: Volume, tracker: Tracker, refused: str | None = None) -> None:
        """A restart that trained nothing (it evaluated what an earlier attempt left, then registered): the page that
        attempt wrote gets the evaluation's table and the ending, the rest as it was."""
        if not ranks.is_main() or not os.path.exists(volume.report):
            return
        status = volume.status()
        outcome = f"not registered (exit 9): {refused}" if refused else f"registered as {status.registered}" if status.registered else "not registered"
        try:
            with open(volume.report, encoding="utf-8") as f:
                page = f.read()
            write_text(volume.report, refreshed(page, read_json(volume.evaluation_summary, None), f"finished: the final model is saved, {outcome}"))
            tracker.log_file(volume.report)
        except Exception as error:  # noqa: BLE001 - the report is for people to read; it never ends a job
            print(f"fulltune: the run report {volume.report} could not be refreshed ({type(error).__name__}: {error})", flush=True)

    def write(self, status: str, when: str, final: bool = False) -> None:
        if not ranks.is_main():
            return
        started = time.perf_counter()
        try:
            write_text(self.volume.report, render(self.facts(status, final)))
            self.tracker.log_file(self.volume.report)
        except Exception as error:  # noqa: BLE001 - the report is for people to read; it never ends a training run
            print(f"fulltune: the run report {self.volume.report} could not be written ({type(error).__name__}: {error}); training goes on", flush=True)
            return
        print(f"fulltune: run report ({when}): {self.volume.report} in {time.perf_counter() - started:.1f} s", flush=True)

    def facts(self, status: str, final: bool) -> dict[str, Any]:
        """Everything the page shows, as plain data (render() turns it into HTML)."""
        job, volume = self.job, self.volume
        where = {"checkpoints": os.path.abspath(volume.checkpoints), "committed": self.committed()}
        if final:
            where |= {"model": os.path.abspath(volume.final_model), "mlflow_model": os.path.abspath(volume.final), "registered": volume.status().registered}
        where |= {"report": os.path.abspath(volume.report), "samples": os.path.abspath(volume.eval_samples), "data_report": os.path.abspath(volume.data_report)}
        return {
            "title": job.title,
            "status": status,
            "final": final,
            "written": utc(time.time()),
            "job": {"model": job.model, "data": job.data, "precision": job.precision, "max_steps": job.max_steps},
            "history": self.tracker.history(tuple(key for _, keys in CHARTS.values() for key in keys)),
            "run": self.tracker.facts(),
            "plan": job.plan,
            "samples": read_samples(volume.eval_samples),
            "evaluation": read_json(volume.evaluation_summary, None),
            "data": job.data_report,
            "where": where,
            "hyperparameters": job.hyperparameters,
            "attempts": self.tracker.attempts(),
        }
