"""A diverging run stops (exit 5) instead of training on, then committing and registering a broken model.

Everything about divergence is here: how the loss is seen, when it counts as diverged, the weights' check
before a checkpoint counts, and the message of exit 5.

- A logged training loss that is NaN, infinite, or above FT_LOSS_LIMIT at FT_DIVERGENCE_PATIENCE logging
  steps in a row stops the job: a retry with the same settings would diverge the same way.
- The weights of every checkpoint are checked before its manifest is written (`RefuseNonFiniteCheckpoint`
  runs before commits.CommitCheckpoints), because a NaN can reach them between two logging steps.
- transformers' `logging_nan_inf_filter` is turned off: with it, a NaN step is logged as the window's running
  average (0.0 once every step is NaN), which hides exactly this.
"""

from __future__ import annotations

import math
import os

from transformers import TrainerCallback

from trainer.checkpointing import commits, manifest
from trainer.core import ranks
from trainer.core.errors import Diverged
from trainer.core.volume import Volume


def diverged(step: int, why: str, checkpoint_dir: str) -> Diverged:
    """Exit 5, naming the step, the last good checkpoint and what to change (the same settings diverge again)."""
    last = manifest.last_committed(checkpoint_dir)
    good = f"the last good checkpoint is {last}" if last else "no checkpoint was committed before it"
    return Diverged(
        f"training diverged at step {step}: {why}; {good}. Nothing was registered and no final model was saved. "
        "A retry with the same settings diverges again: lower FT_LEARNING_RATE (or raise FT_WARMUP_STEPS, or check the data), "
        "then resume with FT_ALLOW_CONFIG_CHANGE=true or start a new FT_OUTPUT_DIR."
    )


class StopOnDivergence(TrainerCallback):
    """Counts consecutive logging steps whose loss diverged; at `patience` of them, raises Diverged."""

    def __init__(self, patience: int, limit: float, settle=None):
        self.patience, self.limit = patience, limit
        self.settle = settle  # waits for the checkpoint save in flight, so that the message names the last one committed
        self.streak = 0

    def on_train_begin(self, args, state, control, **kwargs):
        # The Trainer reads the flag at every step: off, a NaN loss reaches on_log as NaN (see the module docstring).
        args.logging_nan_inf_filter = False

    def diverging(self, loss: float) -> str | None:
        """Why this logged loss counts as diverging, or None."""
        if not math.isfinite(loss):
            return f"the training loss is {loss}"
        if self.limit and loss > self.limit:
            return f"the training loss {loss:.4g} is above FT_LOSS_LIMIT={self.limit:g}"
        return None

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if not self.patience or not isinstance(loss, int | float):
            return
        why = self.diverging(float(loss))
        self.streak = self.streak + 1 if why else 0
        if why and self.streak >= self.patience:
            if self.settle is not None:
                self.settle()
            raise diverged(state.global_step, f"{why} at {self.streak} logging step(s) in a row (FT_DIVERGENCE_PATIENCE={self.patience})", args.output_dir)


def nonfinite_parameters(model) -> list[str]:
    """Names of the parameters holding a NaN or an infinity (one reduction per tensor, on its device)."""
    import torch

    return [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


class RefuseNonFiniteCheckpoint(TrainerCallback):
    """Before commits.CommitCheckpoints: a save whose weights hold a NaN or an infinity is set aside, never committed,
    and the job stops (exit 5), so every committed checkpoint is one a retry can resume from.  Always on, whatever
    FT_DIVERGENCE_PATIENCE says."""

    def __init__(self, quarantine_dir: str | None = None):
        self.quarantine_dir = quarantine_dir  # None: the volume's incomplete/ beside args.output_dir

    def on_save(self, args, state, control, model=None, **kwargs):
        """A plain Trainer's save (written before `on_save`); the job's saver calls `refuse` itself, before its snapshot."""
        self.refuse(args, state, model)

    def refuse(self, args, state, model, write=None) -> None:
        """Exit 5 when the weights are not finite on any rank; `write`: first write the checkpoint whole, to set it aside."""
        bad = nonfinite_parameters(model) if model is not None else []
        if not ranks.any_rank(bool(bad)):  # every rank stops here, not only those whose shard holds the NaN
            return
        if write is not None:
            write()
        target = folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if ranks.is_main():
            target = commits.set_aside(folder, self.quarantine_dir or Volume(os.path.dirname(os.path.abspath(args.output_dir))).incomplete, "not-finite")
        if ranks.world_size() > 1:  # every rank's exit line names where rank 0 put it, not the folder that is gone
            target = ranks.gather(target)[0]
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise diverged(state.global_step, f"the weights hold NaN or infinite values ({shown or 'on another rank'}); "
                                          f"that checkpoint is set aside in {target}", args.output_dir)
