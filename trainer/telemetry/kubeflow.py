"""The TrainJob's progress in Kubeflow Trainer (KEP-2779; Trainer v2.2+ with its `TrainJobStatus` feature gate).

The controller gives every trainer container three variables: `KUBEFLOW_TRAINER_SERVER_URL` (its status endpoint,
HTTPS), `KUBEFLOW_TRAINER_SERVER_CA_CERT` (the CA file that signed it) and `KUBEFLOW_TRAINER_SERVER_TOKEN` (a projected
service-account token file, which the kubelet rotates).  Rank 0 POSTs, at most every 5 s,

    {"trainerStatus": {"progressPercentage": 45, "estimatedRemainingSeconds": 812, "lastUpdatedTime": "2026-01-23T10:30:45Z",
                       "metrics": [{"name": "stage", "value": "training"}, {"name": "step", "value": "20"}, ...]}}

(the Trainer's `UpdateTrainJobStatusRequest`: integers, metric values as strings of 1 to 64 characters) from a thread
of its own: a server that refuses, fails or never answers costs one log line per outage, never a step, and never the
job.  The token and the CA are read again for every post, so a rotated token is the one sent.

This replaces transformers' `KubeflowCallback`, which `TrainingArguments` adds whenever the URL is set (trainer/job.py
removes it): it says 100 % when `train()` returns, before the final save and the registration; a resumed job's first
post says 0 %; its ETA counts from the attempt's start over every step since step 0; it reads the token once per
5 minutes; and it posts from the training loop, where a server that does not answer holds a step for its 5 s timeout.
"""

from __future__ import annotations

import json
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from trainer.telemetry.feed import REPORTED, Snapshot

URL, CA_CERT, TOKEN = "KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_CA_CERT", "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0  # the most often the controller is asked to update the TrainJob (its rate limit is per pod's token)
TIMEOUT_S = 5.0  # one post, connection and answer
INT32_MAX = 2**31 - 1


def _value(value: float | int | str) -> str:
    text = value if isinstance(value, str) else str(value) if isinstance(value, int) else f"{value:.6g}"
    return text[:64]  # the CRD's maxLength


def payload(snapshot: Snapshot) -> dict[str, Any]:
    """The request body for `snapshot`; its metrics are the progress line's names."""
    metrics: dict[str, Any] = {"stage": snapshot.stage, "step": snapshot.step, "max_steps": snapshot.max_steps, **snapshot.values}
    if snapshot.checkpoints:
        metrics["checkpoint_blocked_share"] = snapshot.checkpoint_blocked_share
    if snapshot.stuck:
        metrics["stuck"] = "true"
    status: dict[str, Any] = {
        "progressPercentage": snapshot.percentage(),
        "metrics": [{"name": name, "value": _value(value)} for name, value in metrics.items()],
        "lastUpdatedTime": datetime.fromtimestamp(snapshot.observed, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    remaining = snapshot.remaining_seconds(time.monotonic() - (time.time() - snapshot.observed))
    if remaining is not None:
        status["estimatedRemainingSeconds"] = min(remaining, INT32_MAX)
    return {"trainerStatus": status}


class Reporter:
    """Posts the job's status from its own thread: each transition (training began, a stage ended, the end) as it was
    when it happened, and in between the live status every MIN_INTERVAL_S while it changes."""

    def __init__(self, url: str, ca_file: str | None, token_file: str | None, read: Callable[[], Snapshot]):
        self.url, self.ca_file, self.token_file, self._read = url, ca_file, token_file, read
        self._changed = threading.Condition()
        self._pending: Snapshot | None = None  # the newest transition not yet posted
        self._closing = False
        self._last_post = -MIN_INTERVAL_S  # time.monotonic() of the last attempt
        self._last_body: Any = None
        self._failing = False  # an outage is under way: its one log line is out
        self._thread = threading.Thread(target=self._run, name="fulltune-trainjob-status", daemon=True)
        self._thread.start()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], read: Callable[[], Snapshot]) -> Reporter | None:
        url = environ.get(URL)
        if not url:
            return None
        if not url.startswith("https://"):
            print(f"fulltune: TrainJob status: not sent: {URL} is not an https:// URL, and the token is sent only over TLS", flush=True)
            return None
        print(f"fulltune: TrainJob status: posting the job's progress to {url} (at most every {MIN_INTERVAL_S:.0f} s)", flush=True)
        return cls(url, environ.get(CA_CERT) or None, environ.get(TOKEN) or None, read)

    def transition(self, snapshot: Snapshot) -> None:
        with self._changed:
            self._pending = snapshot
            self._changed.notify()

    def close(self, last: Snapshot) -> None:
        """Post `last` (after the interval since the previous post) and stop; bounded by two posts' timeouts."""
        with self._changed:
            self._pending, self._closing = last, True
            self._changed.notify()
        self._thread.join(timeout=2 * (MIN_INTERVAL_S + TIMEOUT_S))

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None or self._closing, timeout=MIN_INTERVAL_S)
            time.sleep(max(0.0, self._last_post + MIN_INTERVAL_S - time.monotonic()))
            with self._changed:
                snapshot, transition = (self._pending, True) if self._pending is not None else (self._read(), False)
                self._pending = None
                last = self._closing and transition
            body = payload(snapshot) if snapshot.stage in REPORTED else None
            if body is not None and (transition or _unchanged(body) != _unchanged(self._last_body)):
                self._last_post, self._last_body = time.monotonic(), body
                self._send(body)
            if last:
                return

    def _send(self, body: dict[str, Any]) -> None:
        try:
            headers = {"Content-Type": "application/json"}
            if self.token_file:
                with open(self.token_file, encoding="utf-8") as f:
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            context = ssl.create_default_context(cafile=self.ca_file)
            request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as answer:
                answer.read()
            self._failing = False
        except Exception as error:  # noqa: BLE001 - the TrainJob's status is a courtesy: nothing here may end the job
            if not self._failing:
                reason = f"HTTP {error.code} {error.reason}" if isinstance(error, urllib.error.HTTPError) else _reason(error)
                print(f"fulltune: TrainJob status: not sent ({reason}); training goes on, and the status is sent again "
                      f"every {MIN_INTERVAL_S:.0f} s until the server takes it", file=sys.stderr, flush=True)
            self._failing = True


def _reason(error: BaseException) -> str:
    error = getattr(error, "reason", None) or error
    return f"{type(error).__name__}: {error}" if not isinstance(error, str) else error


def _unchanged(body: dict[str, Any] | None) -> Any:
    """What a post says, but for when it was said."""
    return None if body is None else {k: v for k, v in body["trainerStatus"].items() if k != "lastUpdatedTime"}
