"""MLflow: one run per job (kept across restarts), its parameters, and the model registry.

With no MLFLOW_TRACKING_URI, tracking and the registry live in a SQLite file on the output volume,
so a job needs no server and a restart finds its run again.  The run id is stored on the volume:
the transformers MLflowCallback would start a new run on every restart (transformers #30563).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from trainer import settings as settings_table
from trainer.errors import ConfigError, Preempted, RegistrationFailed

RUN_FILE = os.path.join(".fulltune", "mlflow_run.json")


def embedded() -> bool:
    """True when no tracking server is configured: the store is a SQLite file on the volume.

    Read once at import: mlflow.set_tracking_uri() exports MLFLOW_TRACKING_URI itself.
    """
    return not _CONFIGURED_URI


_CONFIGURED_URI = os.environ.get("MLFLOW_TRACKING_URI", "")


def configure(settings: Any) -> str:
    """Point MLflow at the configured server, or at the embedded store on the volume; return the URI."""
    import mlflow

    store = os.path.join(os.path.abspath(settings.output_dir), "mlflow")
    uri = _CONFIGURED_URI or f"sqlite:///{os.path.join(store, 'mlflow.db')}"
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
    mlflow.set_tracking_uri(uri)
    if any(redact(u) != u for u in (uri, os.environ.get("MLFLOW_REGISTRY_URI", ""))):  # MLflow prints links built from them, password included
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        os.environ["MLFLOW_PRINT_MODEL_URLS_ON_CREATION"] = "false"
    if os.environ.get("MLFLOW_REGISTRY_URI"):
        mlflow.set_registry_uri(os.environ["MLFLOW_REGISTRY_URI"])
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "fulltune")
    try:
        experiment = mlflow.get_experiment_by_name(name)
    except mlflow.tracking.registry.UnsupportedModelRegistryStoreURIException as error:
        raise _unsupported_store() from error
    if experiment is None:
        local = f"file://{os.path.join(store, 'artifacts')}" if embedded() else None
        mlflow.create_experiment(name, artifact_location=local)
    mlflow.set_experiment(name)
    # The transformers callback logs metrics into our run; its ~300 params (every TrainingArguments
    # field) are skipped: our own FT_* params are the effective configuration.
    os.environ["MLFLOW_MAX_LOG_PARAMS"] = "0"
    return uri


def redact(uri: str) -> str:
    """The URI without user name or password, for logs and the volume."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if not (parts.username or parts.password):
        return uri
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=f"****@{host}"))


def _unsupported_store() -> ConfigError:
    """MLflow has no store for the URI's scheme: a plugin missing from the image, or a typo."""
    named = {n: os.environ[n] for n in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI") if os.environ.get(n)}
    shown = ", ".join(f"{n}={redact(v)!r}" for n, v in named.items())
    hint = (
        " `azureml://` needs the azureml-mlflow plugin, which pins an MLflow older than the image's; deploy/azureml/command-job.yml unsets the variable."
        if any(v.startswith("azureml:") for v in named.values())
        else ""
    )
    return ConfigError(
        f"{shown}: this image's MLflow cannot track or register there (supported: http(s):// servers, databricks, "
        f"databricks-uc, SQL databases, sqlite, file); unset MLFLOW_TRACKING_URI for the store on the volume.{hint}"
    )


@contextlib.contextmanager
def job_run(settings: Any, run_name: str) -> Iterator[Any]:
    """The job's one MLflow run: FINISHED on success, KILLED when stopped (a restart continues it), else FAILED."""
    import mlflow

    run = start_run(settings, run_name)
    try:
        yield run
    except Preempted:
        mlflow.end_run("KILLED")  # flushes the queued metrics before the process exits 75
        raise
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    mlflow.end_run("FINISHED")


def start_run(settings: Any, run_name: str) -> Any:
    """Continue the job's run if the volume names one, else start it."""
    import mlflow

    path = os.path.join(settings.output_dir, RUN_FILE)
    run_id = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            run_id = json.load(f)["run_id"]
        try:
            mlflow.get_run(run_id)
        except mlflow.exceptions.MlflowException:
            print(f"fulltune: MLflow run {run_id} named on the volume is not on this server: starting a new run", flush=True)
            run_id = None
    run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name, log_system_metrics=settings.system_metrics)
    if run_id is None:
        mlflow.log_params(settings_table.as_params(settings))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"run_id": run.info.run_id, "tracking_uri": redact(mlflow.get_tracking_uri())}, f)
        os.replace(path + ".tmp", path)
    return run


def register(settings: Any, model_dir: str, metadata: dict[str, str]) -> str:
    """Register the saved MLflow model under FT_REGISTERED_MODEL; return 'name/version'.

    On the embedded store the version points at `model_dir` on the volume (no second copy of the
    weights).  With a tracking server the folder is uploaded to the run's artifact store first,
    because a path on this machine's volume means nothing to the server's other clients.
    """
    import mlflow
    from mlflow import MlflowClient

    name = settings.registered_model
    run = mlflow.active_run()
    try:
        client = MlflowClient()
        if not embedded():
            mlflow.log_artifacts(model_dir, artifact_path="model")
            version = mlflow.register_model(f"runs:/{run.info.run_id}/model", name, tags=metadata)
        else:
            try:
                client.create_registered_model(name)
            except mlflow.exceptions.MlflowException as error:
                if "RESOURCE_ALREADY_EXISTS" not in str(error.error_code):
                    raise
            version = client.create_model_version(name, source=os.path.abspath(model_dir), run_id=run.info.run_id, tags=metadata)
        client.set_model_version_tag(name, version.version, "task", "llm/v1/chat")
    except Exception as error:
        raise RegistrationFailed(
            f"registering {name!r} failed ({type(error).__name__}: {error}); the trained model is saved at "
            f"{os.path.abspath(model_dir)}. Re-run the job to retry registration only."
        ) from error
    return f"{name}/{version.version}"
