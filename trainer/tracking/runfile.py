"""The job's run file on the volume (`.fulltune/mlflow_run.json`): which MLflow run is the job's, and every attempt
that trained on the volume, so that a restart continues the run and the report lists each stop and resume.

    {"run_id": "...", "tracking_uri": "http://****@mlflow:5000",
     "attempts": [{"started": 1796161608.9, "from_step": 0, "ended": 1796161716.2, "outcome": "finished at step 40"}]}

Written from two threads (the run opens in the background while training starts): every write holds the
tracker's lock and rewrites the file atomically with what is already in it.
"""

from __future__ import annotations

import threading
from typing import Any

from trainer.core.files import read_json, write_json


def run_id(path: str) -> str | None:
    return (read_json(path) or {}).get("run_id")


def update(path: str, lock: threading.Lock, **fields: Any) -> None:
    with lock:
        write_json(path, (read_json(path) or {}) | fields)


def put_attempt(path: str, lock: threading.Lock, attempt: dict[str, Any]) -> None:
    """Add `attempt`, or replace the one with its start time (the same attempt, now ended)."""
    with lock:
        kept = read_json(path) or {}
        attempts = [a for a in kept.get("attempts", []) if a.get("started") != attempt["started"]] + [dict(attempt)]
        write_json(path, kept | {"attempts": attempts})


def attempts(path: str) -> list[dict[str, Any]]:
    return list((read_json(path) or {}).get("attempts", []))
