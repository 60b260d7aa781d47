"""MLflow, and nothing else imports it: one run per job (kept across restarts), its parameters, metrics and
artifacts, the saved model, and the model registry.

    configure(settings)                 # the server, or the embedded store on the volume
    with job_run(config) as run:        # FINISHED, KILLED (stopped: a restart continues it) or FAILED
        log_metrics({...}, step)        # also what MetricsCallback sends at each Trainer log
        log(tags=..., metrics=..., artifacts={"data/report.json": report})
        log_file(volume.report)             # a file on the volume, as it is
        save_model(net, tokenizer, volume.final, metadata, served_name)
        register(settings, volume.final, metadata)

Metrics, tags and artifacts reach the server from a thread of its own (trainer/tracking/outbox.py), so a server
that stops answering mid-run stalls nothing: they wait in memory, one line says so, and they are sent
when it answers again.  At the end of the job, the rest of them, the registration and the run's status
wait for it up to FT_REGISTRATION_RETRY_SECONDS; past that the job exits 3, the model kept and what was
not sent written to the volume for the next attempt.  A server that does not answer at start ends the
job within seconds (exit 1, trainer/tracking/server.py), before anything is downloaded.

With no MLFLOW_TRACKING_URI, tracking and the registry live in a SQLite file on the output volume,
so a job needs no server and a restart finds its run again.  The run id is stored on the volume:
the transformers MLflowCallback would start a new run on every restart (transformers #30563), and it
logs every TrainingArguments field as a param; `MetricsCallback` replaces it (the job sets
`report_to="none"`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

from transformers import TrainerCallback

from trainer.core import ranks
from trainer.core import settings as settings_table
from trainer.core.config import Config
from trainer.core.errors import ConfigError, Preempted, RegistrationFailed, TrackingUnreachable
from trainer.core.files import read_json, write_json
from trainer.core.volume import Volume
from trainer.tracking.outbox import PROBE_TIMEOUT_SECONDS, Outbox
from trainer.tracking.server import CONFIGURED_URI, MlflowLogFilter, gist, redact, server_uris, servers_answer

_open_runs: list[str] = []  # the job's run while `job_run` holds it open
_outbox: Outbox | None = None  # what goes to that run, sent in the background
_history: dict[str, list[tuple[int, float]]] = {}  # every metric of the run, as sent or queued: the run report's data
_run_facts: dict[str, str] = {}  # the run's id, experiment and redacted tracking URI
_end_by: float | None = None  # time.monotonic() past which the end of the job stops waiting for the server
STOPPING_SECONDS = 10.0  # a stopped or failed job waits this long for the server before keeping the rest on the volume
FIRST_PAUSE_SECONDS, LONGEST_PAUSE_SECONDS = 5.0, 60.0  # between registration attempts


def embedded() -> bool:
    """True when no tracking server is configured: the store is a SQLite file on the volume."""
    return not CONFIGURED_URI


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
    uri = CONFIGURED_URI or f"sqlite:///{os.path.join(store, 'mlflow.db')}"
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
    mlflow.set_tracking_uri(uri)
    if any(redact(u) != u for u in (uri, os.environ.get("MLFLOW_REGISTRY_URI", ""))):  # MLflow prints links built from them, password included
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        os.environ["MLFLOW_PRINT_MODEL_URLS_ON_CREATION"] = "false"
    if os.environ.get("MLFLOW_REGISTRY_URI"):
        mlflow.set_registry_uri(os.environ["MLFLOW_REGISTRY_URI"])
    for handler in logging.getLogger("mlflow").handlers:
        handler.addFilter(MlflowLogFilter())
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
    run = _start_run(config)
    _open_runs.append(run.info.run_id)
    status = "FAILED"
    try:
        yield run
        status = "FINISHED"
    except Preempted:
        status = "KILLED"
        raise
    finally:
        _open_runs.pop()
        _finish(config, status)


def _start_run(config: Config) -> Any:
    """Continue the job's run if the volume names one, else start it and log the effective configuration; start
    sending to it, first what an earlier attempt could not send."""
    global _outbox
    import mlflow

    volume = Volume(config.settings.output_dir)
    run_id = (read_json(volume.run_file) or {}).get("run_id")
    if run_id:
        try:
            mlflow.get_run(run_id)
        except mlflow.exceptions.MlflowException:
            print(f"fulltune: MLflow run {run_id} named on the volume is not on this server: starting a new run", flush=True)
            run_id = None
    run = mlflow.start_run(run_id=run_id, run_name=None if run_id else config.run_name, log_system_metrics=config.settings.system_metrics)
    if run_id is None:
        mlflow.log_params(settings_table.as_params(config.settings) | {"precision": config.precision.name})
        write_json(volume.run_file, {"run_id": run.info.run_id, "tracking_uri": redact(mlflow.get_tracking_uri())})
    _outbox = Outbox(lambda item: _send(run.info.run_id, item), servers_answer, redact(mlflow.get_tracking_uri()), gist)
    unsent = read_json(volume.unsent_tracking, []) if run_id else []
    _recall(run, unsent)
    for item in reversed(unsent):
        _outbox.put(item, size=_size(item), first=True)
    if unsent:
        print(f"fulltune: sending {sum(map(_size, unsent))} values an earlier attempt could not send to the tracking server", flush=True)
    return run


def _finish(config: Config, status: str) -> None:
    """Send what is queued and end the run with `status`, waiting for the server no longer than the end of the job
    may (a stopped or failed job: STOPPING_SECONDS); what is still unsent is kept on the volume for the next attempt.
    Raises RegistrationFailed (exit 3) when a job that succeeded could not finish its run."""
    global _outbox
    import mlflow

    volume = Volume(config.settings.output_dir)
    end_by = _end_deadline(config.settings) if status == "FINISHED" else time.monotonic() + STOPPING_SECONDS
    sent = _outbox.drain(end_by)
    unsent, _outbox = _outbox.close(), None
    try:
        if unsent:
            write_json(volume.unsent_tracking, unsent)
        elif os.path.exists(volume.unsent_tracking):
            os.remove(volume.unsent_tracking)
    except OSError as error:  # a full volume: the job's own error (exit 6) is the one to report
        print(f"fulltune: {sum(map(_size, unsent))} values not sent to the tracking server could not be kept on the volume ({error.strerror})", file=sys.stderr, flush=True)
    answering = sent and servers_answer()
    with contextlib.nullcontext() if answering else _one_quick_try(), _without_warnings("mlflow.store.db.utils", "SQLAlchemy database error"):
        try:
            mlflow.end_run(status)  # an unanswered call still leaves no active run behind (MLflow's exit hook would retry it for minutes)
        except Exception as error:  # noqa: BLE001 - the job's own outcome matters more than the run's status
            answering = False
            print(f"fulltune: the MLflow run stays RUNNING: marking it {status} failed ({gist(str(error))}); the job's next attempt finishes it", flush=True)
    if status == "FINISHED" and not (sent and answering):
        kept = f"; {sum(map(_size, unsent))} values not sent are kept in {volume.unsent_tracking}" if unsent else ""
        failed = RegistrationFailed(
            f"the MLflow tracking server {redact(mlflow.get_tracking_uri())} did not answer within FT_REGISTRATION_RETRY_SECONDS="
            f"{config.settings.registration_retry_seconds}; the trained model is saved at {os.path.abspath(volume.final)}{kept}. "
            "Re-run the job once the server answers: it sends them and finishes the run, without training."
        )
        failed.show_traceback = False
        raise failed


@contextlib.contextmanager
def _without_warnings(logger: str, *prefixes: str) -> Iterator[None]:
    """Drop the named logger's messages that start with one of `prefixes` (expected, and misleading, here)."""

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(prefixes)

    drop, target = Drop(), logging.getLogger(logger)
    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)


@contextlib.contextmanager
def _one_quick_try() -> Iterator[None]:
    """MLflow calls that fail at once, without MLflow's retries (minutes): for a server that already did not answer."""
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(PROBE_TIMEOUT_SECONDS))}
    saved = {name: os.environ.get(name) for name in quick}
    os.environ.update(quick)  # MLflow reads them at each request
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _end_deadline(settings: settings_table.Settings) -> float:
    """When the end of the job (unsent metrics, registration, the run's status) stops waiting for the server:
    FT_REGISTRATION_RETRY_SECONDS after it first waits."""
    global _end_by
    if _end_by is None:
        _end_by = time.monotonic() + settings.registration_retry_seconds
    return _end_by


def _size(item: dict[str, Any]) -> int:
    return len(item.get("metrics") or item.get("tags") or [None])


def _send(run_id: str, item: dict[str, Any]) -> None:
    """One queued item into the run, from the outbox's thread: MlflowClient with the run id, since MLflow's active run
    belongs to the thread that started it."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    client, kind = MlflowClient(), item["kind"]
    if kind == "metrics":
        metrics = [Metric(key, value, timestamp, step) for key, value, timestamp, step in item["metrics"]]
        for start in range(0, len(metrics), 1000):  # MLflow's limit per request
            client.log_batch(run_id, metrics=metrics[start : start + 1000], synchronous=True)
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(key, value) for key, value in item["tags"].items()], synchronous=True)
    elif kind == "text":
        client.log_text(run_id, item["value"], item["path"])
    elif kind == "dict":
        client.log_dict(run_id, item["value"], item["path"])
    elif kind == "table":
        client.log_table(run_id, item["value"], item["path"])
    elif kind == "file" and os.path.exists(item["path"]):
        client.log_artifact(run_id, item["path"])


def _recall(run: Any, unsent: list[dict[str, Any]]) -> None:
    """Start the record of the run's metrics: what a continued run already holds (read once, at start, when the
    server has just answered), then what an earlier attempt could not send."""
    from mlflow import MlflowClient

    client = MlflowClient()
    _history.clear()
    _run_facts.update(run_id=run.info.run_id, experiment_id=run.info.experiment_id, tracking_uri=redact(client.tracking_uri))
    for key in sorted(run.data.metrics):
        _history[key] = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
    for item in unsent:
        _remember(item.get("metrics") or [])


def _remember(metrics: list[list[Any]]) -> None:
    for key, value, _timestamp, step in metrics:
        _history.setdefault(key, []).append((step, value))


def _queue(item: dict[str, Any], step: int | None = None) -> None:
    if _outbox is not None:
        _outbox.put(item, size=_size(item), step=step)


def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
    """Into the job's run, sent in the background; nothing when there is none (a benchmark or test that runs the
    Trainer alone: mlflow may not even be installed there)."""
    if not _open_runs or not metrics:
        return
    now = int(time.time() * 1000)
    _remember([[key, float(value), now, step or 0] for key, value in metrics.items()])
    _queue({"kind": "metrics", "metrics": [[key, float(value), now, step or 0] for key, value in metrics.items()]}, step=step)


def log(tags: dict[str, str] | None = None, metrics: dict[str, float] | None = None, artifacts: dict[str, Any] | None = None) -> None:
    """Tags, step-less metrics, and artifacts (a dict is stored as JSON, a string as text) into the job's run."""
    if not _open_runs:
        return
    if tags:
        _queue({"kind": "tags", "tags": {key: str(value) for key, value in tags.items()}})
    log_metrics(metrics or {})
    for path, value in (artifacts or {}).items():
        _queue({"kind": "text" if isinstance(value, str) else "dict", "path": path, "value": value})


def log_table(rows: list[dict[str, Any]], artifact_file: str) -> None:
    """Rows (one dict each, same keys) appended to a table artifact of the job's run (MLflow's evaluation view)."""
    if not _open_runs or not rows:
        return
    _queue({"kind": "table", "path": artifact_file, "value": {key: [row[key] for row in rows] for key in rows[0]}})


def metric_history(keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) points as the job's run holds them once the queue is sent (what its charts show),
    read from this process's record, never from the server: a report during an outage is drawn all the same."""
    return {key: list(_history.get(key, [])) for key in keys} if _open_runs else {}


def run_summary() -> dict[str, Any]:
    """The job's run: its id, where it is (no password), and the latest value of each metric."""
    if not _open_runs:
        return {}
    return _run_facts | {"metrics": {key: points[-1][1] for key, points in _history.items() if points}}


def log_file(path: str) -> None:
    """A file on the volume as an artifact of the job's run, at the top of its artifacts (sent as it is then)."""
    if _open_runs:
        _queue({"kind": "file", "path": path})


class MetricsCallback(TrainerCallback):
    """What the Trainer logs (loss, eval_loss, learning_rate, grad_norm, ...) as metrics of the job's run, at the
    optimizer step.  Numbers only, names sanitised as transformers' MLflowCallback does."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        metrics = {re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", k): float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)}
        if metrics:
            log_metrics(metrics, step=state.global_step)


def save_model(net: Any, tokenizer: Any, path: str, metadata: dict[str, str], served_name: str) -> None:
    """Write the model once: an MLflow pyfunc model (trainer/serving/pyfunc.py, saved from code) that answers OpenAI-style
    chat requests as `served_name`, around a `model/` folder that is also a plain transformers folder (weights +
    tokenizer), so serving and the registry share one copy; the metadata goes to the run too.

    Not the transformers flavor: its llm/v1/chat endpoint fails `temperature: 0` and names the model by a path
    (trainer/serving/pyfunc.py says why)."""
    import mlflow

    from trainer.serving import pyfunc as serving

    mlflow.pyfunc.save_model(
        path=path,
        python_model=serving.__file__,
        model_config={serving.MODEL_NAME_KEY: served_name},
        signature=serving.SIGNATURE,
        input_example=serving.INPUT_EXAMPLE,  # saved as the model's example request; with a signature given, MLflow does not run it
        metadata=metadata,
        pip_requirements=_serving_requirements(),
    )
    net.save_pretrained(os.path.join(path, serving.WEIGHTS))  # after: MLflow saves only into an empty folder
    tokenizer.save_pretrained(os.path.join(path, serving.WEIGHTS))
    saved = mlflow.models.Model.load(path)
    saved.model_size_bytes = sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)  # with the weights
    saved.save(os.path.join(path, "MLmodel"))
    log(artifacts={"model_metadata.json": metadata})


def _serving_requirements() -> list[str]:
    """Pin what serving needs; without this, MLflow infers extras such as torchvision."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("mlflow", "torch", "transformers", "accelerate", "safetensors", "tokenizers")]


def register(settings: settings_table.Settings, model_dir: str, metadata: dict[str, str]) -> str:
    """Register the saved MLflow model under FT_REGISTERED_MODEL; return 'name/version'.

    First the run gets what is still queued for it, then registration is tried until it succeeds, fails for a
    reason a retry cannot change, or FT_REGISTRATION_RETRY_SECONDS have passed (pauses of 5 s, doubling to
    60 s; while a server does not answer, no attempt is made, so none waits out MLflow's own retries).
    """
    end_by = _end_deadline(settings)
    if _outbox is not None:
        _outbox.drain(end_by)
    pause, attempt = FIRST_PAUSE_SECONDS, 0
    while True:
        attempt += 1
        try:
            if not servers_answer():
                raise TrackingUnreachable(f"no answer from {', '.join(redact(u) for u in server_uris())}")
            return _register_once(settings, model_dir, metadata)
        except Exception as error:  # noqa: BLE001 - sorted below: what a retry may fix, and what it cannot
            why, passing = f"{type(error).__name__}: {gist(str(error))}", _may_pass(error)
            if time.monotonic() + pause > end_by or not passing:
                failed = RegistrationFailed(
                    f"registering {settings.registered_model!r} failed ({why}"
                    + (f"; no success in {attempt} attempt(s) within FT_REGISTRATION_RETRY_SECONDS={settings.registration_retry_seconds}" if passing else "")
                    + f"); the trained model is saved at {os.path.abspath(model_dir)}"
                    + (", and what the MLflow run has not received yet is kept on the volume" if passing and not embedded() else "")
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


def _register_once(settings: settings_table.Settings, model_dir: str, metadata: dict[str, str]) -> str:
    """On the embedded store the version points at `model_dir` on the volume (no second copy of the weights).
    With a tracking server the folder is uploaded to the run's artifact store first, because a path on this
    machine's volume means nothing to the server's other clients."""
    import mlflow
    from mlflow import MlflowClient

    name = settings.registered_model
    run = mlflow.active_run()
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
    return f"{name}/{version.version}"
