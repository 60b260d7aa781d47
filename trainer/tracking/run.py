"""The job's MLflow run as one object, `Tracker`: one run per job (kept across restarts), what goes into it, and
how it ends.  docs/tracking-and-serving.md#the-tracker describes the interface.

    tracker = Tracker(config)
    tracker.warm_up()                    # MLflow imported and the URI checked in the background; nothing written
    tracker.start()                      # exit 2 now for a URI MLflow cannot use; the run opens in the background
    with tracker:                        # FINISHED, KILLED (stopped: a restart continues it) or FAILED
        tracker.log_metrics({...}, step)  # also MetricsCallback, at each Trainer log
        tracker.log(tags=..., metrics=..., artifacts={"data/report.json": report})
        tracker.register(volume.final, metadata)

The run opens off the path to the first step: a fresh embedded store creates its tables (about 10 s on two busy
cores), so that, the run's parameters and the system-metrics monitor are done by a thread while the model loads
and trains; what is logged meanwhile waits in memory and goes first.  Everything then reaches the server from
the outbox's thread (trainer/tracking/outbox.py), so an outage stalls nothing; at the end the rest, the
registration and the run's status wait for it up to FT_REGISTRATION_RETRY_SECONDS, past which the job exits 3
with what was not sent kept on the volume.  Rank 0 alone tracks (mlflow #11782); elsewhere every call is a no-op.

The run is opened, or continued from the id kept on the volume, by trainer/tracking/opening.py; the Trainer's own
metrics come in through `MetricsCallback` (trainer/tracking/metrics.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from trainer.core import ranks
from trainer.core.config import Config
from trainer.core.errors import Preempted, RegistrationFailed
from trainer.core.files import write_json
from trainer.core.volume import Volume
from trainer.tracking import delivery, opening, registry, runfile, store
from trainer.tracking.outbox import Outbox
from trainer.tracking.server import redact, servers_answer

STOPPING_SECONDS = 10.0  # a stopped or failed job waits this long for the server before keeping the rest on the volume
OPENING_SECONDS = 120.0  # a run still opening when the job ends (a fresh store on a busy machine): waited for at least this long


class Tracker:
    """One job's MLflow run: `start`, `log`/`log_metrics`/`log_table`/`log_file`, `finish`, `register`; the run's
    record (`history`, `facts`) for the run report and the summary line, read from memory, never from the server."""

    def __init__(self, config: Config, enabled: bool | None = None):
        """`enabled`: False for a Trainer run without a job run (a benchmark, a test); default: rank 0 only."""
        self.config, self.settings = config, config.settings
        self.enabled = ranks.is_main() if enabled is None else enabled
        self.volume = Volume(self.settings.output_dir)
        self.run_id: str | None = None
        self._lock = threading.Lock()
        self._outbox: Outbox | None = None
        self._early: list[dict[str, Any]] = []  # queued before the run exists; sent first, in order
        self._history: dict[str, list[tuple[int, float]]] = {}  # every metric of the run, as sent or queued
        self._facts: dict[str, str] = {}  # the run's id, experiment and redacted tracking URI
        self._end_by: float | None = None  # time.monotonic() past which the end of the job stops waiting for the server
        self._warming: threading.Thread | None = None
        self._opening: threading.Thread | None = None
        self._failure: BaseException | None = None  # of a background stage: raised in the job's thread at its next call
        self._monitor: Any = None
        self._open = False
        self._attempt: dict[str, Any] | None = None  # this attempt's row of the job's attempts (the run file keeps them all)
        self.last_step = 0
        self.planned_steps: int | None = None  # the steps the job trains (trainer/core/schedule.py), once the rows are known

    # -- The run's lifecycle ------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Import MLflow and check the tracking URI in the background, while the job checks its plan and data."""
        if self.enabled and self._warming is None:
            self._warming = _thread("fulltune-tracking-import", self._background(lambda: store.check_scheme(self.settings)))

    def start(self) -> None:
        """Open the job's run in the background; raise at once what the URI check found (ConfigError: exit 2)."""
        if not self.enabled or self._opening is not None:
            return
        self.warm_up()
        self._warming.join()
        self._raise_failure()
        self._open = True
        self._opening = _thread("fulltune-tracking-start", self._background(self._open_run))

    def __enter__(self) -> Tracker:
        self.start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        status = "FINISHED" if error is None else "KILLED" if isinstance(error, Preempted) else "FAILED"
        outcome = {"FINISHED": "finished", "KILLED": "stopped (exit 75)", "FAILED": f"failed ({type(error).__name__})"}[status]
        try:
            self.ended_training(f"{outcome} at step {self.last_step}")
        except OSError as why:  # a full volume: the job's own error (exit 6 naming the checkpoint) must not be replaced
            if error is None:
                raise
            print(f"fulltune: warning: this attempt's ending could not be recorded in {self.volume.run_file} ({why.strerror})", file=sys.stderr, flush=True)
        self.finish(status, raising=error is None)

    def began_training(self, from_step: int, started: float) -> None:
        """This attempt (its process started at `started`, time.time()) trains from step 0 or a checkpoint: a row of
        the report's attempts, kept on the volume with the earlier ones."""
        self.last_step = from_step
        if self.enabled:
            self._attempt = {"started": started, "from_step": from_step}
            runfile.put_attempt(self.volume.run_file, self._lock, self._attempt)

    def ended_training(self, outcome: str) -> None:
        """How this attempt's training ended ("finished at step 40", "stopped by a signal at step 12 (exit 75)")."""
        if self._attempt is not None and "ended" not in self._attempt:
            self._attempt |= {"ended": time.time(), "outcome": outcome}
            runfile.put_attempt(self.volume.run_file, self._lock, self._attempt)

    def attempts(self) -> list[dict[str, Any]]:
        """Every attempt that trained on this volume, oldest first, this one last (while it runs: no `ended`)."""
        return runfile.attempts(self.volume.run_file) if self.enabled else []

    def _open_run(self) -> None:
        """Open the run (trainer/tracking/opening.py); then send to it what an earlier attempt could not send, then
        what was logged while it opened."""
        began = time.perf_counter()
        opened = opening.open_run(self.config, self.volume, self._lock)
        self._monitor, recalled, unsent, outbox = opened.monitor, opened.recalled, opened.unsent, opened.outbox
        with self._lock:
            self.run_id = opened.run_id
            self._facts = opened.facts
            for item in unsent:
                _remember(recalled, item.get("metrics") or [])
            for key, points in self._history.items():  # what this attempt logged while the run opened comes after
                recalled.setdefault(key, []).extend(points)
            self._history = recalled
            for item in [*unsent, *self._early]:
                outbox.put(item, size=delivery.size(item))
            self._early, self._outbox = [], outbox
        if unsent:
            print(f"fulltune: sending {sum(map(delivery.size, unsent))} values an earlier attempt could not send to the tracking server", flush=True)
        if self.settings.log_level == "debug":
            print("fulltune: debug: start-up: tracking started (store, run, system metrics) "
                  f"in the background, {time.perf_counter() - began:.2f} s", flush=True)

    def finish(self, status: str, raising: bool = True) -> None:
        """Send what is queued and end the run with `status`, waiting for the server no longer than the end of the
        job may (a stopped or failed job: STOPPING_SECONDS); what is still unsent is kept on the volume for the next
        attempt.  Raises RegistrationFailed (exit 3) when a job that succeeded could not finish its run, and, with
        `raising`, what went wrong while the run opened."""
        if not self._open:
            return
        self._open = False
        end_by = self.end_deadline() if status == "FINISHED" else time.monotonic() + STOPPING_SECONDS
        self._wait_until_open(OPENING_SECONDS if status == "FINISHED" else STOPPING_SECONDS)
        if self._monitor is not None:
            self._monitor.finish()
        with self._lock:
            outbox, self._outbox = self._outbox, None
            early, self._early = self._early, []
        sent = outbox.drain(end_by) if outbox is not None and not self._opening.is_alive() else False
        unsent = (outbox.close() if outbox is not None else []) + early
        self._keep_unsent(unsent)
        if self._failure is not None and raising:
            raise self._failure
        answering = sent and servers_answer() and self.run_id is not None
        if self.run_id is not None and not delivery.end_run(self.run_id, status, quick=not answering):
            answering = False
        if status == "FINISHED" and not (sent and answering):
            kept = f"; {sum(map(delivery.size, unsent))} values not sent are kept in {self.volume.unsent_tracking}" if unsent else ""
            failed = RegistrationFailed(
                f"the MLflow tracking server {redact(store.tracking_uri(self.settings))} did not answer within FT_REGISTRATION_RETRY_SECONDS="
                f"{self.settings.registration_retry_seconds}; the trained model is saved at {os.path.abspath(self.volume.final)}{kept}. "
                "Re-run the job once the server answers: it sends them and finishes the run, without training."
            )
            failed.show_traceback = False
            raise failed

    def _keep_unsent(self, unsent: list[dict[str, Any]]) -> None:
        try:
            if unsent:
                write_json(self.volume.unsent_tracking, unsent)
            elif os.path.exists(self.volume.unsent_tracking):
                os.remove(self.volume.unsent_tracking)
        except OSError as error:  # a full volume: the job's own error (exit 6) is the one to report
            print(f"fulltune: {sum(map(delivery.size, unsent))} values not sent to the tracking server "
                  f"could not be kept on the volume ({error.strerror})", file=sys.stderr, flush=True)

    def end_deadline(self) -> float:
        """When the end of the job (unsent metrics, registration, the run's status) stops waiting for the server:
        FT_REGISTRATION_RETRY_SECONDS after it first waits."""
        if self._end_by is None:
            self._end_by = time.monotonic() + self.settings.registration_retry_seconds
        return self._end_by

    def register(self, model_dir: str, metadata: dict[str, str], description: str = "") -> str:
        """Register the saved MLflow model under FT_REGISTERED_MODEL once the run has what is queued for it; return
        'name/version' (trainer/tracking/registry.py retries it)."""
        end_by = self.end_deadline()
        self._wait_until_open(OPENING_SECONDS)
        self._raise_failure()
        if self.run_id is None:
            raise RegistrationFailed(f"the MLflow run did not open within {OPENING_SECONDS:.0f} s; the trained model is saved "
                                     f"at {os.path.abspath(model_dir)}. Re-run the job to register it (without training).")
        with self._lock:
            outbox = self._outbox
        if outbox is not None:
            outbox.drain(end_by)
        return registry.register(self.settings, model_dir, metadata, self.run_id, end_by, description)

    # -- What goes into the run ---------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Into the job's run, sent in the background; nothing when the tracker is off or the run is over."""
        if not self._open or not metrics:
            return
        self._raise_failure()
        self.last_step = max(self.last_step, step or 0)
        now = int(time.time() * 1000)
        values = [[key, float(value), now, step or 0] for key, value in metrics.items()]
        with self._lock:
            _remember(self._history, values)
        self._queue({"kind": "metrics", "metrics": values}, step=step)

    def log(self, tags: dict[str, str] | None = None, metrics: dict[str, float] | None = None, artifacts: dict[str, Any] | None = None) -> None:
        """Tags, step-less metrics, and artifacts (a dict is stored as JSON, a string as text) into the job's run."""
        if not self._open:
            return
        if tags:
            self._queue({"kind": "tags", "tags": {key: str(value) for key, value in tags.items()}})
        self.log_metrics(metrics or {})
        for path, value in (artifacts or {}).items():
            self._queue({"kind": "text" if isinstance(value, str) else "dict", "path": path, "value": value})

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows (one dict each, same keys) appended to a table artifact of the job's run (MLflow's evaluation view)."""
        if self._open and rows:
            self._queue({"kind": "table", "path": artifact_file, "value": {key: [row[key] for row in rows] for key in rows[0]}})

    def log_file(self, path: str) -> None:
        """A file on the volume as an artifact of the job's run, at the top of its artifacts (sent as it is then)."""
        if self._open:
            self._queue({"kind": "file", "path": path})

    def _queue(self, item: dict[str, Any], step: int | None = None) -> None:
        with self._lock:
            if self._outbox is None:
                self._early.append(item)
                return
            outbox = self._outbox
        outbox.put(item, size=delivery.size(item), step=step)

    # -- The run's record ---------------------------------------------------------------------------

    def history(self, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
        """Each metric's (step, value) points as the job's run holds them once the queue is sent (what its charts
        show), from this process's record: a report during an outage is drawn all the same."""
        with self._lock:
            return {key: list(self._history.get(key, [])) for key in keys} if self.enabled else {}

    def facts(self) -> dict[str, Any]:
        """The job's run: its id, where it is (no password), and the latest value of each metric."""
        with self._lock:
            if not self._facts:
                return {}
            return self._facts | {"metrics": {key: points[-1][1] for key, points in self._history.items() if points}}

    def _wait_until_open(self, at_least: float) -> None:
        """The opening thread, waited for until the end of FT_REGISTRATION_RETRY_SECONDS but never less than `at_least`:
        the deadline is for a server that does not answer, not for a store that is still being created."""
        self._opening.join(max(at_least, (self._end_by or 0.0) - time.monotonic()))

    def _background(self, stage):
        def run() -> None:
            try:
                stage()
            except BaseException as error:  # noqa: BLE001 - raised in the job's thread, at its next call
                self._failure = error

        return run

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            self._open = False
            raise failure


def _thread(name: str, target) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _remember(history: dict[str, list[tuple[int, float]]], metrics: list[list[Any]]) -> None:
    for key, value, _timestamp, step in metrics:
        history.setdefault(key, []).append((step, value))
