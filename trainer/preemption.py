"""SIGTERM/SIGINT: finish the optimizer step, commit a checkpoint, exit 75.

transformers' `enable_jit_checkpoint` is not enough here (tests/test_preemption.py shows it):
it handles SIGTERM only, waits 3 s before acting, saves through `_save_checkpoint` without calling
`on_save` (so nothing commits the checkpoint), and then lets `train()` return as if training had
finished, so the caller cannot tell a stop from success.  It also has no deadline.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from transformers import TrainerCallback

from trainer import ranks
from trainer.errors import StopAbandoned, record_exit, write_termination_message


class StopOnSignal(TrainerCallback):
    """The first signal requests a save at the next step boundary; a second one, or the deadline, exits 76."""

    def __init__(self, deadline_seconds: int):
        self.deadline_seconds = deadline_seconds
        self.requested_at: float | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            self._give_up(f"second {name} before the checkpoint was committed")
        self._on_stop(f"{name} received")

    def _on_stop(self, why: str) -> None:
        self.requested_at = time.monotonic()
        print(f"fulltune: {why}: saving a checkpoint at the end of this step (deadline {self.deadline_seconds} s)", flush=True)
        timer = threading.Timer(self.deadline_seconds, self._give_up, args=(f"stop deadline of {self.deadline_seconds} s passed",))
        timer.daemon = True
        timer.start()

    def _give_up(self, why: str) -> None:
        code = StopAbandoned.exit_code
        message = f"exit {code}: {why}; a retry resumes from the last committed checkpoint"
        print(f"fulltune: {message}", flush=True)
        write_termination_message(message)
        record_exit(code)
        os._exit(code)  # from a signal handler or timer thread: no clean-up can be trusted to finish in time

    def on_step_end(self, args, state, control, **kwargs):
        if ranks.any_rank(self.requested) and not self.requested:  # another node was told to stop: stop here too
            self._on_stop(f"a stop signal on another rank at step {state.global_step}")
        if self.requested:
            control.should_save = True
            control.should_evaluate = False
            control.should_training_stop = True
        return control
