"""The model registry: the saved MLflow model (trainer/tracking/packaging.py) registered under FT_REGISTERED_MODEL,
retried while the server is away."""

from __future__ import annotations

import os
import time

from trainer.core import settings as settings_table
from trainer.core.errors import RegistrationFailed, TrackingUnreachable
from trainer.tracking import store
from trainer.tracking.server import gist, redact, server_uris, servers_answer

FIRST_PAUSE_SECONDS, LONGEST_PAUSE_SECONDS = 5.0, 60.0  # between registration attempts


def register(settings: settings_table.Settings, model_dir: str, metadata: dict[str, str], run_id: str, end_by: float, description: str = "") -> str:
    """Register the saved MLflow model under FT_REGISTERED_MODEL, linked to the run; return 'name/version'.

    Tried until it succeeds, fails for a reason a retry cannot change, or `end_by` (time.monotonic(): the end of
    FT_REGISTRATION_RETRY_SECONDS) has passed: pauses of 5 s, doubling to 60 s; while a server does not answer, no
    attempt is made, so none waits out MLflow's own retries.
    """
    pause, attempt = FIRST_PAUSE_SECONDS, 0
    while True:
        attempt += 1
        try:
            if not servers_answer():
                raise TrackingUnreachable(f"no answer from {', '.join(redact(u) for u in server_uris())}")
            return _register_once(settings, model_dir, metadata, run_id, description)
        except Exception as error:  # noqa: BLE001 - sorted below: what a retry may fix, and what it cannot
            why, passing = f"{type(error).__name__}: {gist(str(error))}", _may_pass(error)
            if time.monotonic() + pause > end_by or not passing:
                failed = RegistrationFailed(
                    f"registering {settings.registered_model!r} failed ({why}"
                    + (f"; no success in {attempt} attempt(s) within FT_REGISTRATION_RETRY_SECONDS={settings.registration_retry_seconds}" if passing else "")
                    + f"); the trained model is saved at {os.path.abspath(model_dir)}"
                    + (", and what the MLflow run has not received yet is kept on the volume" if passing and not store.embedded() else "")
                    + ". Re-run the job to retry registration only (without training)."
                )
                failed.show_traceback = not passing  # an outage needs no traceback (and MLflow's would quote the URI's password)
                raise failed from error
        print(f"fulltune: registration attempt {attempt} failed ({' '.join(why.split())[:300]}); next try in {pause:.0f} s", flush=True)
        time.sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE_SECONDS)


def _may_pass(error: Exception) -> bool:
    """Whether a later attempt may succeed: the server was away or overloaded (no answer, 5xx), rather than refusing
    the request itself (4xx) or something else going wrong."""
    import mlflow
    import requests

    if isinstance(error, mlflow.exceptions.MlflowException):
        return error.get_http_status_code() >= 500
    return isinstance(error, TrackingUnreachable | requests.ConnectionError | requests.Timeout)


def _register_once(settings: settings_table.Settings, model_dir: str, metadata: dict[str, str], run_id: str, description: str = "") -> str:
    """On the embedded store the version points at `model_dir` on the volume (no second copy of the weights).
    With a tracking server the folder is uploaded to the run's artifact store first, because a path on this
    machine's volume means nothing to the server's other clients."""
    import mlflow
    from mlflow import MlflowClient

    name = settings.registered_model
    client = MlflowClient()
    if not store.embedded():
        client.log_artifacts(run_id, model_dir, artifact_path="model")
        version = mlflow.register_model(f"runs:/{run_id}/model", name, tags=metadata)
    else:
        try:
            client.create_registered_model(name)
        except mlflow.exceptions.MlflowException as error:
            if "RESOURCE_ALREADY_EXISTS" not in str(error.error_code):
                raise
        version = client.create_model_version(name, source=os.path.abspath(model_dir), run_id=run_id, tags=metadata)
    client.set_model_version_tag(name, version.version, "task", "llm/v1/chat")
    if description:  # the evaluation's before/after table (trainer/evaluation/compare.py)
        client.update_model_version(name, version.version, description=description)
    return f"{name}/{version.version}"
