"""MLflow, and nothing else imports it: one run per job (kept across restarts), its parameters, metrics and
artifacts, the saved model, and the model registry.

    configure(settings)                 # the server, or the embedded store on the volume
    with job_run(config) as run:        # FINISHED, KILLED (stopped: a restart continues it) or FAILED
        log_metrics({...}, step)        # also what MetricsCallback sends at each Trainer log
        log(tags=..., metrics=..., artifacts={"data/report.json": report})
        save_model(net, tokenizer, volume.final, metadata)
        register(settings, volume.final, metadata)

With no MLFLOW_TRACKING_URI, tracking and the registry live in a SQLite file on the output volume,
so a job needs no server and a restart finds its run again.  The run id is stored on the volume:
the transformers MLflowCallback would start a new run on every restart (transformers #30563), and it
logs every TrainingArguments field as a param; `MetricsCallback` replaces it (the job sets
`report_to="none"`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from transformers import TrainerCallback

from trainer import ranks
from trainer import settings as settings_table
from trainer.config import Config
from trainer.errors import ConfigError, Preempted, RegistrationFailed
from trainer.volume import Volume, read_json, write_json

_open_runs: list[str] = []  # the job's run while `job_run` holds it open


def embedded() -> bool:
    """True when no tracking server is configured: the store is a SQLite file on the volume.

    Read once at import: mlflow.set_tracking_uri() exports MLFLOW_TRACKING_URI itself.
    """
    return not _CONFIGURED_URI


_CONFIGURED_URI = os.environ.get("MLFLOW_TRACKING_URI", "")


def configure(settings: settings_table.Settings) -> str | None:
    """Point MLflow at the configured server, or at the embedded store on the volume; return the URI.
    Rank 0 alone tracks (one run per job, not one per rank: mlflow #11782)."""
    if not ranks.is_main():
        return None
    # MLflow tags the run with the git commit of the code when it can; in the image there is no git executable, and
    # GitPython would print a screenful about it at the first run (the tag is simply left out either way).
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per artifact (log_table reads its table back to append)
    import mlflow

    store = os.path.abspath(Volume(settings.output_dir).mlflow_store)
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
def job_run(config: Config) -> Iterator[Any]:
    """The job's one MLflow run: FINISHED on success, KILLED when stopped (a restart continues it), else FAILED."""
    if not ranks.is_main():
        yield None
        return
    import mlflow

    run = _start_run(config)
    _open_runs.append(run.info.run_id)
    try:
        yield run
    except BaseException as error:
        _end_run_after_error("KILLED" if isinstance(error, Preempted) else "FAILED")  # KILLED: flushes the queued metrics before exit 75
        raise
    else:
        mlflow.end_run("FINISHED")
    finally:
        _open_runs.pop()


def _end_run_after_error(status: str) -> None:
    """Close the run as `status` while the job ends with an error; a run that cannot be closed (the embedded store on a
    full volume) is said in one line, and the job's own error stays the one reported."""
    import mlflow

    try:
        with _without_warnings("mlflow.store.db.utils", "SQLAlchemy database error"):  # it logs the whole chain, the job's error included, as a traceback
            mlflow.end_run(status)
    except Exception as closing:  # noqa: BLE001 - any failure here would hide the job's own error
        print(f"fulltune: the MLflow run could not be marked {status} ({type(closing).__name__}: {' '.join(str(closing).split())[:300]})", file=sys.stderr, flush=True)


def _start_run(config: Config) -> Any:
    """Continue the job's run if the volume names one, else start it and log the effective configuration."""
    import mlflow

    path = Volume(config.settings.output_dir).run_file
    run_id = (read_json(path) or {}).get("run_id")
    if run_id:
        try:
            mlflow.get_run(run_id)
        except mlflow.exceptions.MlflowException:
            print(f"fulltune: MLflow run {run_id} named on the volume is not on this server: starting a new run", flush=True)
            run_id = None
    run = mlflow.start_run(run_id=run_id, run_name=None if run_id else config.run_name, log_system_metrics=config.settings.system_metrics)
    if run_id is None:
        mlflow.log_params(settings_table.as_params(config.settings) | {"precision": config.precision.name})
        write_json(path, {"run_id": run.info.run_id, "tracking_uri": redact(mlflow.get_tracking_uri())})
    return run


def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
    """Into the job's run; nothing when there is none (a benchmark or test that runs the Trainer alone)."""
    if not _open_runs:  # mlflow may not even be installed there (the GPU benchmark)
        return
    import mlflow

    mlflow.log_metrics(metrics, step=step)


def log(tags: dict[str, str] | None = None, metrics: dict[str, float] | None = None, artifacts: dict[str, Any] | None = None) -> None:
    """Tags, step-less metrics, and artifacts (a dict is stored as JSON, a string as text) into the job's run."""
    if not _open_runs:
        return
    import mlflow

    mlflow.set_tags(tags or {})
    mlflow.log_metrics(metrics or {})
    for path, value in (artifacts or {}).items():
        if isinstance(value, str):
            mlflow.log_text(value, path)
        else:
            mlflow.log_dict(value, path)


def log_table(rows: list[dict[str, Any]], artifact_file: str) -> None:
    """Rows (one dict each, same keys) appended to a table artifact of the job's run (MLflow's evaluation view)."""
    if not _open_runs or not rows:
        return
    import mlflow

    mlflow.log_table({key: [row[key] for row in rows] for key in rows[0]}, artifact_file)


class MetricsCallback(TrainerCallback):
    """What the Trainer logs (loss, eval_loss, learning_rate, grad_norm, ...) as metrics of the job's run, at the
    optimizer step.  Numbers only, names sanitised as transformers' MLflowCallback does."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        metrics = {re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", k): float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)}
        if metrics:
            log_metrics(metrics, step=state.global_step)


def save_model(net: Any, tokenizer: Any, path: str, metadata: dict[str, str]) -> None:
    """Write the model once, as an MLflow transformers model whose `model/` folder is also a plain transformers
    folder (weights + tokenizer), so serving and the registry share one copy; the metadata goes to the run too."""
    import mlflow

    local_base = os.path.isdir(net.name_or_path)  # MLflow looks the name up on the hub for a model card and a license
    with _without_warnings("mlflow.transformers", "The model card could not be retrieved", "Unable to find license information") if local_base else contextlib.nullcontext():
        mlflow.transformers.save_model(
            transformers_model={"model": net, "tokenizer": tokenizer},
            path=path,
            task="llm/v1/chat",
            metadata=metadata,
            pip_requirements=_serving_requirements(),
        )
    tokenizer.save_pretrained(os.path.join(path, "model"))
    if _open_runs:
        mlflow.log_dict(metadata, "model_metadata.json")


@contextlib.contextmanager
def _without_warnings(logger: str, *prefixes: str) -> Iterator[None]:
    """Drop the named logger's messages that start with one of `prefixes` (expected, and misleading, here)."""
    import logging

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(prefixes)

    drop, target = Drop(), logging.getLogger(logger)
    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)


def _serving_requirements() -> list[str]:
    """Pin what serving needs; without this, MLflow infers extras such as torchvision."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("mlflow", "torch", "transformers", "accelerate", "safetensors", "tokenizers")]


def register(settings: settings_table.Settings, model_dir: str, metadata: dict[str, str]) -> str:
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
