"""The output volume (`FT_OUTPUT_DIR`): every path fulltune writes there, the job's status, and the room left.

    volume = Volume(settings.output_dir)
    volume.checkpoints                      # checkpoints/checkpoint-N/ (what counts as committed: checkpointing/manifest.py)
    volume.status().done(registering=True)  # what earlier attempts of this job finished
    free_bytes(volume.checkpoints)          # room left on the volume, asked of the nearest folder that exists

The README's "What lands on the volume" table lists the same paths.  Nothing else in the package joins
paths under `FT_OUTPUT_DIR`.  How files are written there is trainer/core/files.py's; who may write and read
them, trainer/core/permissions.py's.
"""

from __future__ import annotations

import os
import shutil

from trainer.core.files import read_json, write_json


class Volume:
    """The layout of one job's output folder."""

    def __init__(self, root: str):
        self.root = root

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def checkpoints(self) -> str:
        """Committed checkpoints, `checkpoint-N/` each (TrainingArguments.output_dir)."""
        return self._path("checkpoints")

    @property
    def incomplete(self) -> str:
        """Checkpoints whose save was cut short, set aside at the next start."""
        return self._path("incomplete")

    @property
    def final(self) -> str:
        """The final model as an MLflow transformers model."""
        return self._path("final")

    @property
    def final_model(self) -> str:
        """The same weights and tokenizer as a plain transformers folder (inside `final`)."""
        return self._path("final", "model")

    @property
    def gathered(self) -> str:
        """Several processes under FSDP: the whole model gathered from its shards, before it becomes `final`."""
        return self._path("final.gathered")

    @property
    def mlflow_store(self) -> str:
        """The embedded MLflow store (SQLite + artifacts) when no tracking server is set."""
        return self._path("mlflow")

    @property
    def data_report(self) -> str:
        return self._path("data-report.txt")

    @property
    def eval_samples(self) -> str:
        """The sample answers: one JSON line per prompt, at step 0 and at every evaluation (trainer/evaluation/samples.py)."""
        return self._path("eval-samples.jsonl")

    @property
    def report(self) -> str:
        """The run report: one HTML page with its charts inside, refreshed at every evaluation (trainer/report/report.py)."""
        return self._path("report.html")

    @property
    def evaluation(self) -> str:
        """The evaluation stage's results, a file per model and unit, and its summary (trainer/evaluation/stage.py)."""
        return self._path("evaluation")

    def evaluation_unit(self, model: str, unit: str) -> str:
        """One unit's result: `base-own_task.json`, `tuned-arc_easy.json`, ..."""
        return self._path("evaluation", f"{model}-{unit}.json")

    @property
    def evaluation_rows(self) -> str:
        """The FT_EVAL_ROWS validation rows the stage scores, chosen before training."""
        return self._path("evaluation", "rows.json")

    @property
    def evaluation_summary(self) -> str:
        """Base against fine-tuned, once the stage is done: the table the log, MLflow, the registry and the report show."""
        return self._path("evaluation", "summary.json")

    @property
    def base_scores(self) -> str:
        """The base model's benchmark scores when FT_EVAL_CACHE_DIR is empty (trainer/evaluation/base_scores.py)."""
        return self._path(".fulltune", "base-scores")

    @property
    def demo(self) -> str:
        """FT_PRESET=demo: the tiny model, tokenizer and data."""
        return self._path("demo")

    @property
    def state(self) -> str:
        """Job state: status, fingerprint, MLflow run id, the running job's lease, tokenized-data cache."""
        return self._path(".fulltune")

    @property
    def status_file(self) -> str:
        return self._path(".fulltune", "status.json")

    @property
    def fingerprint_file(self) -> str:
        return self._path(".fulltune", "fingerprint.json")

    @property
    def run_file(self) -> str:
        return self._path(".fulltune", "mlflow_run.json")

    @property
    def lease_file(self) -> str:
        """Which job is writing this volume now (trainer/launch/lease.py); absent when none is."""
        return self._path(".fulltune", "lease.json")

    @property
    def lease_lock(self) -> str:
        """Held for the few milliseconds in which a job takes, refreshes or releases the lease."""
        return self._path(".fulltune", "lease.lock")

    @property
    def unsent_tracking(self) -> str:
        """What the tracking server did not answer for before an attempt ended: the next attempt sends it first."""
        return self._path(".fulltune", "unsent-tracking.json")

    @property
    def memory_plan_file(self) -> str:
        """The plan an out-of-memory step-down settled on, with the peaks measured (trainer/model/stepdown.py): a restart starts there."""
        return self._path(".fulltune", "memory-plan.json")

    @property
    def logs(self) -> str:
        """What outlives the pod for a person to read: NCCL's flight-recorder dumps after a collective timed out
        (`nccl_trace_rank_<rank>`, several processes only: trainer/launch/launcher.py)."""
        return self._path("logs")

    @property
    def data_cache(self) -> str:
        return self._path(".fulltune", "data-cache")

    # -- The job's status: trained and saved, then registered ---------------------------------------

    def status(self) -> Status:
        return Status(**read_json(self.status_file, {}), unsent_tracking=os.path.exists(self.unsent_tracking))

    def mark_saved(self, metadata: dict[str, str]) -> None:
        """The final model is complete on the volume: a restart skips training (exit 3 retries register only)."""
        write_json(self.status_file, {"final_model": self.final, "metadata": metadata})

    def mark_registered(self, version: str) -> None:
        write_json(self.status_file, read_json(self.status_file, {}) | {"registered": version})

    def mark_mirrored(self, url: str) -> None:
        """The final model and the committed checkpoints are in FT_MIRROR_URL (`url`)."""
        write_json(self.status_file, read_json(self.status_file, {}) | {"mirrored": url})

    def mark_pushed(self, repository: str) -> None:
        """The final model and its card are on the Hugging Face hub (FT_PUSH_TO_HUB)."""
        write_json(self.status_file, read_json(self.status_file, {}) | {"pushed": repository})


class Status:
    """What earlier attempts of this job finished: nothing, the final model, or the registration too."""

    def __init__(self, final_model: str | None = None, metadata: dict[str, str] | None = None, registered: str | None = None, unsent_tracking: bool = False,
                 mirrored: str | None = None, pushed: str | None = None):
        self.final_model, self.metadata, self.registered = final_model, metadata or {}, registered
        self.unsent_tracking = unsent_tracking  # metrics the tracking server never got: the job is not done until it has them
        self.mirrored, self.pushed = mirrored, pushed  # where FT_MIRROR_URL and FT_PUSH_TO_HUB took the final model

    def done(self, registering: bool, mirror: str = "", hub: str = "") -> str | None:
        """What the finished job left (a registered version or the model folder), or None if work remains: also the
        copies `mirror` (FT_MIRROR_URL) and `hub` (FT_PUSH_TO_HUB) are to hold, when set."""
        if self.unsent_tracking or (mirror and self.mirrored != mirror) or (hub and self.pushed != hub):
            return None
        if self.registered:
            return self.registered
        return self.final_model if self.final_model and not registering else None


def free_bytes(path: str) -> int:
    """Bytes this process may still write on the volume holding `path` (its nearest existing parent: the folder
    itself may not exist yet)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free
