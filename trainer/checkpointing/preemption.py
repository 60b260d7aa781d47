"""SIGTERM/SIGINT: finish the optimizer step, commit a checkpoint, exit 75.

transformers' `enable_jit_checkpoint` is not enough here (tests/test_preemption.py shows it):
it handles SIGTERM only, waits 3 s before acting, saves through `_save_checkpoint` without calling
`on_save` (so nothing commits the checkpoint), and then lets `train()` return as if training had
finished, so the caller cannot tell a stop from success.  It also has no deadline.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from transformers import TrainerCallback

from trainer.core import ranks
from trainer.core.ending import LAUNCHER_PID, announce, record_exit
from trainer.core.errors import Preempted, StopAbandoned


class StopOnSignal(TrainerCallback):
    """The first signal requests a save at the next step boundary; a second one, or the deadline, exits 76."""

    def __init__(self, deadline_seconds: int):
        self.deadline_seconds = deadline_seconds
        self.requested_at: float | None = None
        self.signal_name = ""  # the first stop signal's (SIGTERM, SIGINT)
        self.training = False  # until begin_training: a stop ends the job before its first step, with nothing to save
        self.deadline: threading.Timer | None = None
        self.stop_step: int | None = None  # the step whose save is the stop's checkpoint (seen at its step end)
        self.leave_at_once = ""  # why a signal needs no save (nothing_left_to_save)
        self.write_seconds: float | None = None  # one checkpoint's write on this volume, measured at start (know_the_save)
        self.checkpoints, self.saves = "", None
        self.committed = False  # the stop's checkpoint counts: what is left (the run report, MLflow) may be cut short
        self.any_rank = ranks.AnyRank()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def begin_training(self) -> None:
        """From here a stop saves at the end of a step.  One that came before (loading, data) ends the job here, 76 as
        one before this process listened (trainer/launch/launcher.py): nothing new to save, the committed checkpoints as they are."""
        if self.requested:
            raise StopAbandoned(f"stopped by {self.signal_name} while starting; a retry resumes from the last committed checkpoint")
        self.training = True

    def know_the_save(self, write_seconds: float | None, checkpoints: str) -> None:
        """One process: how long a checkpoint takes on this volume (measured at start) and where the committed ones are,
        so that a stop whose save cannot finish before the deadline says so at once instead of writing until it is cut
        off.  `saves` (the saver's, trainer/checkpointing/saving.py) is set once the trainer exists."""
        self.write_seconds, self.checkpoints = (write_seconds if ranks.world_size() == 1 else None), checkpoints

    def nothing_left_to_save(self, why: str) -> None:
        """From here on everything is on the volume as it is done (the evaluation stage): a signal ends the job at once, 75."""
        self.leave_at_once = why

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        self.signal_name = self.signal_name or name
        if self.leave_at_once:
            self._leave(Preempted.exit_code, f"{name} received {self.leave_at_once}")
        if self.committed:
            self._leave(Preempted.exit_code, f"second {name} after the checkpoint was committed; a retry resumes from it")
        if self.requested:
            self._give_up(f"second {name} before the checkpoint was committed")
        self._on_stop(f"{name} received")

    def _on_stop(self, why: str) -> None:
        self.requested_at = time.monotonic()
        then = "saving a checkpoint at the end of this step" if self.training else "ending before the first training step, nothing new to save"
        print(f"fulltune: {why}: {then} (deadline {self.deadline_seconds} s)", flush=True)
        self.deadline = threading.Timer(self.deadline_seconds, self._give_up, args=(f"stop deadline of {self.deadline_seconds} s passed",))
        self.deadline.daemon = True
        self.deadline.start()

    def _give_up(self, why: str) -> None:
        self._leave(StopAbandoned.exit_code, f"{why}; a retry resumes from the last committed checkpoint")

    def _leave(self, code: int, why: str) -> None:
        announce(code, why)
        record_exit(code)
        os._exit(code)  # from a signal handler or timer thread: no clean-up can be trusted to finish in time

    def on_save(self, args, state, control, **kwargs):
        """After CommitCheckpoints (an earlier callback): once the stop's checkpoint counts, the deadline no longer
        applies (writing the run report or closing the MLflow run never turns a committed stop into 76).  Only the
        stop's own save counts: a signal that arrives while a periodic save is under way leaves the deadline running."""
        if self.stop_step is not None and state.global_step >= self.stop_step:
            self.committed = True
            if self.deadline is not None:
                self.deadline.cancel()

    def on_step_end(self, args, state, control, **kwargs):
        # With several ranks every rank learns of a stop one step after it was requested anywhere, all at the same step
        # (trainer/core/ranks.py AnyRank: no GPU sync per step); with one process, at this step.
        if self.any_rank.exchange(self.requested):
            if not self.requested:  # another node was told to stop: stop here too
                self._on_stop(f"a stop signal on another rank at step {state.global_step}")
            self._within_the_deadline(state.global_step)
            self.stop_step = state.global_step
            control.should_save = True
            control.should_evaluate = False
            control.should_training_stop = True
        return control

    def _within_the_deadline(self, step: int) -> None:
        """Before the stop's save: when one checkpoint's write (as measured at start) does not fit the time left, a
        periodic save still in flight is committed and the job ends 75 with it; with none, the job ends 76 at once, naming
        the last committed checkpoint, rather than spending the grace period on a save the deadline would cut off."""
        if self.write_seconds is None or self.requested_at is None:
            return
        left = self.deadline_seconds - (time.monotonic() - self.requested_at)
        if self.write_seconds < 0.8 * left:  # room to spare for the snapshot and the commit
            return
        need = (f"a checkpoint takes ~{self.write_seconds:.0f} s to write here (measured at start), more than the {max(left, 0):.0f} s left of "
                f"FT_STOP_DEADLINE_SECONDS={self.deadline_seconds}")
        from trainer.checkpointing import manifest

        if self.saves is not None and self.saves.in_flight:
            self.saves.wait()  # its commit runs as the write ends; past the deadline the timer still ends the job with 76
            last = manifest.last_committed(self.checkpoints)
            self._leave(Preempted.exit_code, f"{need}: the save already in flight is committed instead, {last}; a retry resumes from it"
                        f" and redoes the steps after it, up to step {step}")
        last = manifest.last_committed(self.checkpoints)
        where = f"the last committed checkpoint is {last}; a retry resumes from it and redoes the steps after it, up to step {step}" if last else \
            f"no checkpoint is committed yet; a retry starts from step 0 (step {step} was reached)"
        self._leave(StopAbandoned.exit_code, f"{need}: no checkpoint written for this stop; {where}. Give the volume more speed or the "
                    "stop more time (FT_STOP_DEADLINE_SECONDS, and the grace period above it): docs/checkpoints.md#choosing-the-cadence")

    def on_train_end(self, args, state, control, **kwargs):
        """The last step's exchange, waited for on every rank: a stop requested in the last step is seen by all or none."""
        if self.any_rank.settle() and not self.requested:
            self._on_stop(f"a stop signal on another rank at step {state.global_step}")


def end_with_the_launcher(every_seconds: float = 1.0) -> None:
    """Exit when entrypoint.py is gone (killed alone, e.g. `kill -9` outside a container).

    It holds the volume's lease (trainer/launch/lease.py); a training process left running without it would go on
    writing a volume the next job on this machine takes over at once, seeing the lease's holder gone.  The
    launcher is the parent of torchrun or accelerate, not of this process, so the kernel's parent-death signal
    cannot say it; polling its pid once a second can.
    """
    pid = int(os.environ.get(LAUNCHER_PID) or 0)
    if not pid:
        return

    def watch() -> None:
        while True:
            time.sleep(every_seconds)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print(f"fulltune: the launcher (entrypoint.py, pid {pid}) is gone: stopping without saving, so "
                      "that no other job finds this one still writing the volume", file=sys.stderr, flush=True)
                os._exit(1)
            except PermissionError:  # alive, under another uid
                pass

    threading.Thread(target=watch, name="fulltune-launcher-watch", daemon=True).start()
