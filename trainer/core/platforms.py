"""Batch platforms (SageMaker, Vertex AI, AWS Batch, Azure ML) and the FT_* values their variables imply.

Each managed service tells the container where its durable storage is through variables of its own
(`SM_*`, `AIP_*`) or fixed paths (`/opt/ml/...`), so an image that read only `FT_*` would need the same
wiring repeated in every job spec.  `detect()` turns them into `FT_*` values and `settings.load()` layers
them below explicit `FT_*` variables: whatever the user sets still wins.

`FT_OUTPUT_DIR` is one folder for checkpoints, the final model and the local MLflow store.  Where a
platform offers two places, a checkpoint folder that it restores when the job restarts and a model folder
that it uploads once at the end, we pick the checkpoint folder: only there does a retried or
spot-interrupted job find its checkpoints again.  The final model is written next to them, so it reaches
the same bucket (SageMaker: the CheckpointConfig S3 URI; Vertex AI: `<baseOutputDirectory>/checkpoints`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

SAGEMAKER_ROOT = "/opt/ml"  # fixed by SageMaker; a module constant so that tests can point it elsewhere


class Implied(dict):
    """The FT_* values a platform implies, remembering where each came from (for the startup log line)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker  # what identified the platform: a variable, a file, or FT_PLATFORM
        self.sources: dict[str, str] = {}  # FT_* name -> the platform variable or path it came from
        self.explicit: list[str] = []  # FT_* names the platform would set but the user already did

    def offer(self, environ: Mapping[str, str], name: str, value: str | None, source: str) -> None:
        """Imply `name=value` unless the value is missing or `name` is set explicitly (explicit always wins)."""
        if not value or name in self or name in self.explicit:
            return
        if name in environ:
            self.explicit.append(name)
            return
        self[name] = value
        self.sources[name] = source


def _sagemaker_marker(environ: Mapping[str, str]) -> str | None:
    # SM_* variables come from the sagemaker-training toolkit, which this image does not install; the
    # platform itself sets TRAINING_JOB_ARN and always writes resourceconfig.json.
    for name in ("SM_MODEL_DIR", "SM_TRAINING_ENV", "TRAINING_JOB_ARN"):
        if environ.get(name):
            return name
    config = os.path.join(SAGEMAKER_ROOT, "input", "config", "resourceconfig.json")
    return config if os.path.isfile(config) else None


def _sagemaker(environ: Mapping[str, str], implied: Implied) -> None:
    checkpoints = os.path.join(SAGEMAKER_ROOT, "checkpoints")  # CheckpointConfig.LocalPath's default
    if os.path.isdir(checkpoints):  # synced to S3 while training and restored when the job restarts
        implied.offer(environ, "FT_OUTPUT_DIR", checkpoints, checkpoints)
    elif environ.get("SM_MODEL_DIR"):  # no CheckpointConfig: uploaded at the end, never restored
        implied.offer(environ, "FT_OUTPUT_DIR", environ["SM_MODEL_DIR"], "SM_MODEL_DIR")
    else:
        model = os.path.join(SAGEMAKER_ROOT, "model")
        implied.offer(environ, "FT_OUTPUT_DIR", model, model)
    # SageMaker sends SIGKILL 120 s after SIGTERM (StopTrainingJob, Spot interruptions), whatever the image.
    implied.offer(environ, "FT_STOP_DEADLINE_SECONDS", "100", "SageMaker's 120 s stop limit")
    # SageMaker shows the first line of this file as the job's FailureReason.
    failure = os.path.join(SAGEMAKER_ROOT, "output", "failure")
    implied.offer(environ, "FT_TERMINATION_MESSAGE_PATH", failure, failure)
    for channel, name in (("train", "FT_DATASET"), ("validation", "FT_EVAL_DATASET"), ("model", "FT_MODEL")):
        variable = "SM_CHANNEL_" + channel.upper()
        folder = os.path.join(SAGEMAKER_ROOT, "input", "data", channel)
        if environ.get(variable):
            implied.offer(environ, name, environ[variable], variable)
        elif os.path.isdir(folder):  # where SageMaker puts a channel's files (File or FastFile mode)
            implied.offer(environ, name, folder, folder)


def gcs_path(uri: str) -> str:
    """`gs://bucket/path/` -> `/gcs/bucket/path`: Vertex AI mounts every bucket there with Cloud Storage FUSE."""
    if uri.startswith("gs://"):
        uri = "/gcs/" + uri[len("gs://") :]
    return uri.rstrip("/") or uri


def _vertex_marker(environ: Mapping[str, str]) -> str | None:
    for name in ("AIP_CHECKPOINT_DIR", "AIP_MODEL_DIR", "CLOUD_ML_JOB_ID"):
        if environ.get(name):
            return name
    return None


def _vertex(environ: Mapping[str, str], implied: Implied) -> None:
    # Both are set from the job's baseOutputDirectory; the checkpoint folder is the one a restart reads.
    for variable in ("AIP_CHECKPOINT_DIR", "AIP_MODEL_DIR"):
        if environ.get(variable):
            implied.offer(environ, "FT_OUTPUT_DIR", gcs_path(environ[variable]), variable)
            break
    # Set when the job trains on a Vertex AI managed dataset: gs:// file patterns, readable as /gcs globs.
    implied.offer(environ, "FT_DATASET", gcs_path(environ.get("AIP_TRAINING_DATA_URI", "")), "AIP_TRAINING_DATA_URI")
    implied.offer(environ, "FT_EVAL_DATASET", gcs_path(environ.get("AIP_VALIDATION_DATA_URI", "")), "AIP_VALIDATION_DATA_URI")


def _batch_marker(environ: Mapping[str, str]) -> str | None:
    if environ.get("AWS_BATCH_JOB_ATTEMPT"):  # 1 on the first try; logged so a resumed attempt is visible
        return f"AWS_BATCH_JOB_ATTEMPT={environ['AWS_BATCH_JOB_ATTEMPT']}"
    return "AWS_BATCH_JOB_ID" if environ.get("AWS_BATCH_JOB_ID") else None


def _azureml_marker(environ: Mapping[str, str]) -> str | None:
    return "AZUREML_RUN_ID" if environ.get("AZUREML_RUN_ID") else None


def _nothing(environ: Mapping[str, str], implied: Implied) -> None:
    """AWS Batch and Azure ML mount the output folder where the job spec says: the spec sets FT_OUTPUT_DIR."""


Rules = tuple[Callable[[Mapping[str, str]], str | None], Callable[[Mapping[str, str], Implied], None]]
PLATFORMS: dict[str, Rules] = {  # auto-detection tries them in this order
    "sagemaker": (_sagemaker_marker, _sagemaker),
    "vertex": (_vertex_marker, _vertex),
    "azureml": (_azureml_marker, _nothing),
    "aws-batch": (_batch_marker, _nothing),
}


def detect(environ: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """Return the platform's name and the FT_* values it implies ("none", {} when none).

    `FT_PLATFORM` decides: `auto` (default) looks for each platform's own variables, `none` turns
    detection off, and a platform's name forces it (its variables are still read where present).
    Values for `FT_*` names already in `environ` are left out, so the result never overrides the user.
    """
    choice = environ.get("FT_PLATFORM", "auto")
    if choice == "auto":
        found = [(name, marker) for name, (find, _) in PLATFORMS.items() if (marker := find(environ))]
        if not found:
            return "none", {}
        name, marker = found[0]
    elif choice in PLATFORMS:
        name, marker = choice, "FT_PLATFORM"
    else:  # "none", or a value settings.load() rejects with exit 2
        return "none", {}
    implied = Implied(marker)
    PLATFORMS[name][1](environ, implied)
    return name, implied


def describe(platform: str, implied: Mapping[str, str]) -> str:
    """The startup log line: which platform was found, and which settings it filled in from where."""
    if platform == "none":
        return "fulltune: no batch platform detected: settings come from FT_* variables and defaults"
    marker = getattr(implied, "marker", "")
    sources = getattr(implied, "sources", {})
    how = "forced by FT_PLATFORM" if marker == "FT_PLATFORM" else f"detected by {marker}" if marker else "detected"
    parts = [f"{name}={value} from {sources.get(name, platform)}" for name, value in implied.items()]
    parts += [f"{name} set explicitly (kept)" for name in getattr(implied, "explicit", [])]
    return f"fulltune: platform {platform} {how}: " + (", ".join(parts) or "no FT_* values implied")
