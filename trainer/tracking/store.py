"""Where the job's run is kept: the configured MLflow server, or the embedded SQLite store on the volume.

    uri = store.check_scheme()            # seconds (MLflow's import): exit 2 for a URI this MLflow cannot use
    experiment_id = store.connect(settings)   # a fresh volume: its store copied from a template made once (_from_template)

With no MLFLOW_TRACKING_URI, tracking and the registry live in a SQLite file on the output volume, so a job
needs no server and a restart finds its run again.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3

from trainer.core import settings as settings_table
from trainer.core.errors import ConfigError
from trainer.core.files import made_whole
from trainer.core.volume import Volume
from trainer.tracking.server import CONFIGURED_URI, MlflowLogFilter, redact


def embedded() -> bool:
    """True when no tracking server is configured: the store is a SQLite file on the volume."""
    return not CONFIGURED_URI


def tracking_uri(settings: settings_table.Settings) -> str:
    """The configured server, else the SQLite file on the volume (no MLflow import: a plain string)."""
    return CONFIGURED_URI or f"sqlite:///{os.path.join(os.path.abspath(Volume(settings.output_dir).mlflow_store), 'mlflow.db')}"


def check_scheme(settings: settings_table.Settings) -> str:
    """Point MLflow at the job's store and raise ConfigError (exit 2) when this MLflow has no store for its scheme
    (a plugin missing from the image, or a typo); returns the URI.  Creates nothing, asks no server."""
    # MLflow tags the run with the git commit of the code when it can; in the image there is no git executable, and
    # GitPython would print a screenful about it at the first run (the tag is simply left out either way).
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per artifact (log_table reads its table back to append)
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_stores

    uri = tracking_uri(settings)
    mlflow.set_tracking_uri(uri)
    if any(redact(u) != u for u in (uri, os.environ.get("MLFLOW_REGISTRY_URI", ""))):  # MLflow prints links built from them, password included
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        os.environ["MLFLOW_PRINT_MODEL_URLS_ON_CREATION"] = "false"
    if os.environ.get("MLFLOW_REGISTRY_URI"):
        mlflow.set_registry_uri(os.environ["MLFLOW_REGISTRY_URI"])
    for handler in logging.getLogger("mlflow").handlers:
        handler.addFilter(MlflowLogFilter())
    # MLflow 3.17 has no public "is this URI usable" call: MlflowClient(uri) answers it by building the store, which on
    # a fresh volume creates its tables (seconds).  The registry lookup alone answers it at once; remove this when
    # MLflow offers a public check (the same exception comes from get_experiment_by_name in connect() otherwise).
    try:
        tracking_stores._tracking_store_registry.get_store_builder(uri)
    except mlflow.tracking.registry.UnsupportedModelRegistryStoreURIException as error:
        raise _unsupported_store() from error
    return uri


def connect(settings: settings_table.Settings) -> str:
    """The job's experiment, created on a fresh store (with the store's tables); returns its id."""
    import mlflow

    uri = tracking_uri(settings)
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite:///") :]) or ".", exist_ok=True)
        if embedded():
            _from_template(uri[len("sqlite:///") :], mlflow.__version__)
    client = mlflow.MlflowClient(uri)
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "fulltune")
    try:
        experiment = client.get_experiment_by_name(name)
    except mlflow.tracking.registry.UnsupportedModelRegistryStoreURIException as error:
        raise _unsupported_store() from error
    if experiment is not None:
        return experiment.experiment_id
    local = f"file://{os.path.join(os.path.abspath(Volume(settings.output_dir).mlflow_store), 'artifacts')}" if embedded() else None
    return client.create_experiment(name, artifact_location=local)


def _from_template(db: str, version: str) -> None:
    """A fresh volume's store starts as a copy of an empty store that this MLflow version made once on this machine.

    MLflow makes a new SQLite store by running each of its schema migrations, ~1.5 CPU-s and ~150 fsyncs (5 s on
    a busy disk) at every fresh volume, which the demo and every test's job would pay; the copy takes milliseconds.
    The template lives in $XDG_CACHE_HOME/fulltune (the image: /tmp/.cache), is written whole or not at all, and
    is named by the MLflow version, whose migrations it holds.  Where any of this fails, MLflow makes the store."""
    if os.path.exists(db):
        return
    template = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fulltune", f"mlflow-{version}.db")
    try:
        if not os.path.exists(template):
            os.makedirs(os.path.dirname(template), exist_ok=True)
            with made_whole(template) as partial:
                _migrated(f"sqlite:///{partial}")
        with made_whole(db) as partial:
            shutil.copyfile(template, partial)
    except (OSError, sqlite3.Error) as why:
        logging.getLogger(__name__).debug("no store template (%s): MLflow creates the store", why)


def _migrated(uri: str) -> None:
    import mlflow

    mlflow.MlflowClient(uri).search_experiments()  # builds the store: its tables, each migration, the Default experiment


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
