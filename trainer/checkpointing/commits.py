"""Which committed checkpoint to resume from, which ones to keep, and the callback that commits each save.

What counts as committed (the manifest) is trainer/checkpointing/manifest.py.  Before resuming, the newest
committed checkpoint is read back against its checksums: bytes that changed on the volume since the commit (a
bad disk, a copy cut short, a hand edit) set it aside and the previous committed one is used, never the damaged
one.  A save whose weights are not finite never gets here (trainer/checkpointing/divergence.py).

Retention is ours, not transformers': its `_rotate_checkpoints` deletes older checkpoints *before* the
new one is complete, so a crash in the save could leave nothing to resume from.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable

from transformers import TrainerCallback

from trainer.checkpointing import saving
from trainer.checkpointing.cadence import Cadence
from trainer.checkpointing.costs import Costs
from trainer.checkpointing.manifest import commit, committed, committed_bytes, damage, folders, last_committed, read_manifest
from trainer.core import ranks


def latest_for_resume(checkpoint_dir: str, quarantine_dir: str, verify: bool = True) -> str | None:
    """The newest committed checkpoint whose files match their checksums; the others are moved to `quarantine_dir`.

    Saves cut short (no manifest) are set aside and reported.  With `verify` (rank 0: the others resume from what it
    left), the newest committed checkpoint is read back; a damaged one is set aside with a warning naming the file,
    and the one before it is checked the same way.  None: nothing intact to resume from (training starts at step 0).
    """
    for step, path in folders(checkpoint_dir):
        if read_manifest(path) is None:
            target = set_aside(path, quarantine_dir)
            print(f"fulltune: checkpoint at step {step} was never committed (save cut short): moved to {target}", flush=True)
        elif problem := damage(path, read=False):
            _set_aside_damaged(step, path, problem, quarantine_dir)
    if not verify:
        return last_committed(checkpoint_dir)
    for step, path in reversed(folders(checkpoint_dir)):
        problem = damage(path)
        if problem is None:
            return path
        _set_aside_damaged(step, path, problem, quarantine_dir)
    return None


def _set_aside_damaged(step: int, path: str, problem: str, quarantine_dir: str) -> None:
    target = set_aside(path, quarantine_dir, "damaged")
    print(f"fulltune: warning: checkpoint at step {step} is damaged, not resumed: {problem}; moved to {target}", flush=True)


def set_aside_uncommitted(checkpoint_dir: str, quarantine_dir: str, why: str) -> list[tuple[int, str]]:
    """Move every checkpoint folder without a manifest (a save that just failed) aside; (step, where it is now) of each.
    One that cannot be moved (no room even for the folder `quarantine_dir`) stays: the next start sets it aside."""
    moved = []
    for step, path in folders(checkpoint_dir):
        if read_manifest(path) is None:
            try:
                moved.append((step, set_aside(path, quarantine_dir, why)))
            except OSError:
                moved.append((step, path))
    return moved


def set_aside(path: str, quarantine_dir: str, why: str = "") -> str:
    """Move a checkpoint that must never be resumed out of the checkpoints folder (kept, never deleted)."""
    os.makedirs(quarantine_dir, exist_ok=True)
    target = os.path.join(quarantine_dir, f"{os.path.basename(path)}{'.' + why if why else ''}.{int(time.time())}")
    shutil.move(path, target)
    return target


def rotate(checkpoint_dir: str, keep: int, best: str | None) -> None:
    """Delete committed checkpoints beyond the newest `keep`, never the best one."""
    found = committed(checkpoint_dir)
    protected = {os.path.abspath(path) for _, path in found[-keep:]} | ({os.path.abspath(best)} if best else set())
    for _step, path in found:
        if os.path.abspath(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)


class CommitCheckpoints(TrainerCallback):
    """The job's checkpoint saves (checkpointing/saving.py takes the Trainer's `_save_checkpoint` over): check the
    weights are finite, snapshot, then in the background write, commit and apply our retention.

    `every_minutes`: also save at the first evaluation step once that many minutes have passed since the last save;
    `auto` (FT_SAVE_STEPS=auto): save at evaluation steps as the measured costs allow (checkpointing/cadence.py).
    """

    def __init__(self, keep: int, refuse: TrainerCallback | None = None, every_minutes: float = 0.0, pinned: bool = False,
                 after_commit: Callable[[str], None] | None = None, auto: bool = False):
        self.keep = keep
        self.after_commit = after_commit  # uploads.Uploads.committed: FT_MIRROR_URL gets it in the background
        self.refuse = refuse  # divergence.RefuseNonFiniteCheckpoint: a save whose weights are not finite never counts
        self.saves = saving.Saves(pinned)
        self.cadence = Cadence(self.saves.costs, every_minutes, auto)
        self.saved_step: int | None = None  # the step `save_checkpoint` saved last (a plain Trainer never calls it)
        self._step: tuple[float, bool] | None = None  # (perf_counter, a write in flight) when the step in progress began

    @property
    def costs(self) -> Costs:
        return self.saves.costs

    def save_checkpoint(self, trainer, trial) -> None:
        if self.refuse is not None:  # written whole in the foreground first, so that it can be set aside as it is
            self.refuse.refuse(trainer.args, trainer.state, trainer.model, write=lambda: self._write_now(trainer, trial))
        saving.save(trainer, trial, self.saves, self._commit)
        self.cadence.saved()
        self.saved_step = trainer.state.global_step
        if trainer.control.should_training_stop:  # a stop, early stopping or the last step: committed before `on_save`
            self.wait_for_saves()

    def on_save(self, args, state, control, model=None, **kwargs):
        """A plain Trainer (not the job's) wrote `checkpoint-N` itself, synchronously: check and commit it here."""
        if self.saved_step == state.global_step:
            return
        if self.refuse is not None:
            self.refuse.refuse(args, state, model)
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        ranks.barrier()
        if ranks.is_main():
            self._commit(folder, state.global_step, state.best_model_checkpoint)
        ranks.barrier()

    def _write_now(self, trainer, trial) -> None:
        self.saves.wait()
        saving.save(trainer, trial, self.saves, None, background=False)

    def _commit(self, folder: str, step: int, best: str | None) -> None:
        """On the main rank, once every file of the checkpoint is written (in the background)."""
        commit(folder, step, read=self.saves.flushing)
        rotate(os.path.dirname(folder), self.keep, best)
        self.saves.costs.bytes = committed_bytes(folder)
        print(f"fulltune: committed checkpoint at step {step}: {folder}", flush=True)
        if self.after_commit is not None:
            self.after_commit(folder)

    def wait_for_saves(self) -> None:
        """Every rank returns once the save in flight (on the main rank) is committed."""
        self.saves.wait()
        ranks.barrier()

    def on_train_begin(self, args, state, control, **kwargs):
        self.saves.costs.began = time.perf_counter()
        self.cadence.started(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.saves.between_steps()
        self._step = (time.perf_counter(), self.saves.in_flight)  # a save starts between steps: in flight now, or not at all

    def on_step_end(self, args, state, control, **kwargs):
        if self._step is not None:  # each step's time, and whether a write overlapped it (checkpointing/costs.py)
            began, overlapped = self._step
            self.saves.costs.step(time.perf_counter() - began, overlapped)
            self._step = None
        self.saves.raise_if_failed()
        if ranks.is_main() and (line := self.cadence.cost_line(state.global_step, args.save_steps, args.eval_steps)):
            print(line, flush=True)
        cadence = self.cadence
        if not (cadence.bound or cadence.auto) or control.should_save or state.global_step % args.eval_steps:
            return control
        # every rank decides alike (their clocks do not): the main rank's clock decides
        if ranks.any_rank(ranks.is_main() and cadence.due(state.global_step, state.max_steps, self.saves.in_flight)):
            control.should_save = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.wait_for_saves()
        self.saves.close()

