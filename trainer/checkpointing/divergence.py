"""A diverging run stops (exit 5) instead of training on, then committing and registering a broken model.

A logged training loss that is NaN, infinite, or above FT_LOSS_LIMIT at FT_DIVERGENCE_PATIENCE logging
steps in a row stops the job: a retry with the same settings would diverge the same way.  The weights of
every checkpoint are checked separately, before its manifest is written (checkpoints.CommitCheckpoints),
because a NaN can reach them between two logging steps.

transformers' `logging_nan_inf_filter` is off (trainer/model/recipe.py): with it, a NaN step is logged as the
window's running average (0.0 once every step is NaN), which hides exactly this.
"""

from __future__ import annotations

import math

from transformers import TrainerCallback

from trainer.checkpointing import commits as checkpoints


class StopOnDivergence(TrainerCallback):
    """Counts consecutive logging steps whose loss diverged; at `patience` of them, raises Diverged."""

    def __init__(self, patience: int, limit: float):
        self.patience, self.limit = patience, limit
        self.streak = 0

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
            raise checkpoints.diverged(state.global_step, f"{why} at {self.streak} logging step(s) in a row (FT_DIVERGENCE_PATIENCE={self.patience})", args.output_dir)
