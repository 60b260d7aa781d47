"""What the cluster sees of the job, fed in one place and read by three: the TrainJob status (kubeflow.py), the
`/metrics` endpoint (metrics.py) and the stuck watch (stuck.py) all read the same snapshot.

    telemetry = Telemetry.start(config)                        # the training process, before the first step
    telemetry.stage("training", step=20, max_steps=40)         # the progress callback, as training begins (resumed at 20)
    telemetry.step(21)                                         # ... at each optimizer step
    telemetry.metrics(loss=2.31, tokens_per_s=15234, eta_s=8)  # ... at each logging step: the progress line's numbers
    telemetry.stage("saving"); telemetry.stage("registering")  # the job
    telemetry.close(code)                                      # the job's end: 100 % for exit 0 only

Rank 0 only: on every other rank (and where nothing is switched on) each call does nothing.  A call from the
training loop takes a lock and sets a few fields; the reporters run on threads of their own, so a status server
or a scraper that hangs never holds a step.  No torch here: the numbers come in already computed.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

# Each stage's share of the job's 100 %, in the order they run: the final save and the registration are minutes of an
# hour-long job (an 8 GB model written, then uploaded), and a stage added after training takes its share from here.
SHARES = {"training": 90, "saving": 3, "evaluating": 4, "registering": 3}  # evaluating: two model loads and their scores (trainer/evaluation/)
REPORTED = (*SHARES, "done")  # the stages the TrainJob hears about: before training the job cannot say how far it is


@dataclasses.dataclass
class Snapshot:
    """Where the job is, at `observed` (wall time), as the cluster is told."""

    stage: str = "starting"
    step: int = 0
    max_steps: int = 0
    values: dict[str, float] = dataclasses.field(default_factory=dict)  # the progress line's latest numbers (loss, lr, tokens_per_s, ...)
    eta_s: float | None = None  # the progress line's estimate of training's remaining seconds ...
    eta_at: float = 0.0  # ... made at this time.monotonic()
    last_step_at: float | None = None  # time.monotonic() of the last optimizer step (or the start of training)
    steps_expected: bool = False  # training, and another optimizer step is due (not after the last one or a stop)
    stuck: bool = False
    checkpoint_blocked_total_s: float = 0.0  # seconds training waited on checkpoint saves, this process
    checkpoints: int = 0  # saves that blocked training for their snapshot
    checkpoint_blocked_share: float = 0.0  # of the wall time since training began
    observed: float = 0.0

    def percentage(self) -> int:
        """The whole job's progress: the stages before this one, plus this stage's share as far as it went (training by
        steps, the others when they end).  100 only once the job has ended with exit 0."""
        if self.stage == "done":
            return 100
        before = 0
        for stage, share in SHARES.items():
            if stage == self.stage:
                within = min(1.0, self.step / self.max_steps) if stage == "training" and self.max_steps else 0.0
                return min(99, int(before + share * within))
            before += share
        return 0

    def remaining_seconds(self, now: float) -> int | None:
        """Training's remaining time, counted down since the progress line estimated it; unknown after training."""
        if self.stage == "done":
            return 0
        if self.stage != "training" or self.eta_s is None:
            return None
        return max(0, int(self.eta_s - (now - self.eta_at)))

    def seconds_since_last_step(self, now: float) -> float | None:
        """While an optimizer step is due: since the last one, or since training began before the first."""
        if self.stage != "training" or not self.steps_expected or self.last_step_at is None:
            return None
        return now - self.last_step_at


class Telemetry:
    """The one object the job and the progress callback feed; `Telemetry()` alone reports nothing (other ranks, bench/)."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self._lock = threading.Lock()
        self._now = Snapshot()
        self.status: Any = None  # kubeflow.Reporter
        self.endpoint: Any = None  # metrics.Endpoint
        self.watch: Any = None  # stuck.Watch
        self.stuck_after_seconds = 0

    @classmethod
    def start(cls, config: Any) -> Telemetry:
        """What this process reports, as the settings and the environment say: nothing off rank 0."""
        from trainer.core import ranks

        telemetry = cls(config.cuda)
        if not ranks.is_main():
            return telemetry
        from trainer.telemetry import kubeflow, metrics, stuck

        settings = config.settings
        telemetry.stuck_after_seconds = settings.stuck_after_seconds
        if settings.metrics_port:
            telemetry.endpoint = metrics.Endpoint.serve(settings.metrics_port, telemetry)
        telemetry.status = kubeflow.Reporter.from_environment(os.environ, telemetry.snapshot)
        if settings.stuck_after_seconds:
            telemetry.watch = stuck.Watch(telemetry, settings.stuck_after_seconds, settings.stuck_exit)
        return telemetry

    def snapshot(self) -> Snapshot:
        """A copy, for another thread to read at leisure."""
        with self._lock:
            return dataclasses.replace(self._now, values=dict(self._now.values), observed=time.time())

    def stage(self, name: str, *, step: int | None = None, max_steps: int | None = None) -> None:
        with self._lock:
            self._now.stage = name
            if step is not None:
                self._now.step = step
            if max_steps is not None:
                self._now.max_steps = max_steps
            self._now.steps_expected = name == "training" and self._now.step < self._now.max_steps
            self._now.last_step_at = time.monotonic() if name == "training" else None
            self._now.eta_s = None if name == "training" else self._now.eta_s  # this attempt's own estimate, once it has one
        self._transition()

    def step(self, step: int, *, last: bool = False) -> None:
        """An optimizer step ended; `last`: no other one follows in this attempt (the last step, or a stop)."""
        with self._lock:
            self._now.step, self._now.last_step_at = step, time.monotonic()
            self._now.steps_expected = not last

    def metrics(self, *, eta_s: float | None = None, **values: float | None) -> None:
        with self._lock:
            self._now.values.update({name: float(value) for name, value in values.items() if value is not None})
            if eta_s is not None:
                self._now.eta_s, self._now.eta_at = float(eta_s), time.monotonic()

    def checkpoint(self, blocked_s: float, share: float) -> None:
        """A save blocked training for `blocked_s` (its snapshot); `share`: of the wall time since training began."""
        with self._lock:
            self._now.checkpoint_blocked_total_s += blocked_s
            self._now.checkpoints += 1
            self._now.checkpoint_blocked_share = share

    def flag_stuck(self, stuck: bool) -> None:
        with self._lock:
            self._now.stuck = stuck

    def close(self, code: int) -> None:
        """The job's end: the last status (100 % for exit 0, else where it stopped), then every reporter stops."""
        if code == 0:
            with self._lock:
                self._now.stage = "done"
                self._now.steps_expected = False
        if self.watch is not None:
            self.watch.close()
        if self.status is not None:
            self.status.close(self.snapshot())
        if self.endpoint is not None:
            self.endpoint.close()

    def _transition(self) -> None:
        if self.status is not None:
            self.status.transition(self.snapshot())
