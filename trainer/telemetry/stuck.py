"""The stuck signal: training has gone FT_STUCK_AFTER_SECONDS without an optimizer step.

A hung GPU, a stalled volume, a peer that never joins a collective: the training thread waits and says nothing (the
collective timeout, FT_COLLECTIVE_TIMEOUT_SECONDS, covers only the last, and only with several processes).  This
thread looks once a second; the first time the gap passes the threshold it prints one line and `fulltune_stuck`
turns 1 (and the TrainJob's metrics say `stuck`); a step that comes after all turns it back and says so.  With
FT_STUCK_EXIT=true the job ends there with exit 77, from this thread, since the training thread is the one that hangs:
nothing is saved (the last committed checkpoint is where the retry resumes), as after a kill.

Only while an optimizer step is due: not before training, not after its last step or once a stop was requested,
not while the final model is saved or registered.  Evaluations and checkpoint pauses count: the threshold must
outlast them.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from trainer.core.ending import announce, record_exit
from trainer.core.errors import Stuck


class Watch:
    def __init__(self, telemetry: Any, after_seconds: int, exit_when_stuck: bool, every_seconds: float = 1.0):
        self.telemetry, self.after_seconds, self.exit_when_stuck, self.every_seconds = telemetry, after_seconds, exit_when_stuck, every_seconds
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fulltune-stuck-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stuck_since_step: int | None = None
        while not self._closed.wait(self.every_seconds):
            now = self.telemetry.snapshot()
            idle = now.seconds_since_last_step(time.monotonic())
            if idle is not None and idle >= self.after_seconds and stuck_since_step is None:
                stuck_since_step = now.step
                self.telemetry.flag_stuck(True)
                why = (f"stuck: no optimizer step for {self.after_seconds} s (FT_STUCK_AFTER_SECONDS) after step {now.step}/{now.max_steps}: "
                       "a hung GPU, node, volume or collective")
                if self.exit_when_stuck:
                    self._leave(why)
                print(f"fulltune: {why}; the job goes on waiting (FT_STUCK_EXIT=true would end it with exit 77)", flush=True)
            elif stuck_since_step is not None and (idle is None or idle < self.after_seconds):
                print(f"fulltune: no longer stuck: training went on after step {stuck_since_step} (now at step {now.step})", flush=True)
                stuck_since_step = None
                self.telemetry.flag_stuck(False)

    def _leave(self, why: str) -> None:
        code = announce(Stuck.exit_code, f"{why}; a retry resumes from the last committed checkpoint")
        record_exit(code)
        os._exit(code)  # the training thread is the one that hangs: nothing it would run on the way out can be waited for

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=self.every_seconds + 1)
