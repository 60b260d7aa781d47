"""What reaches the MLflow server, call by call: one queued item into the run (from the outbox's thread), and the
run's final status, each with MlflowClient and the run id."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from trainer.tracking.outbox import PROBE_TIMEOUT_SECONDS
from trainer.tracking.server import gist


def size(item: dict[str, Any]) -> int:
    """The values an item counts for in the outbox (a metric value, a tag, an artifact each count as one)."""
    return len(item.get("metrics") or item.get("tags") or [None])


def send(run_id: str, item: dict[str, Any]) -> None:
    """One queued item into the run, from the outbox's thread."""
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


def end_run(run_id: str, status: str, quick: bool) -> bool:
    """Mark the run `status`; False (and one line) when the server did not take it.  `quick`: one try that fails at
    once, for a server that already did not answer (MLflow's own retries last minutes)."""
    from mlflow import MlflowClient

    with _one_quick_try() if quick else contextlib.nullcontext(), _without_warnings("mlflow.store.db.utils", "SQLAlchemy database error"):
        try:
            MlflowClient().set_terminated(run_id, status)
            return True
        except Exception as error:  # noqa: BLE001 - the job's own outcome matters more than the run's status
            print(f"fulltune: the MLflow run stays RUNNING: marking it {status} failed ({gist(str(error))}); the job's next attempt finishes it", flush=True)
            return False


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
