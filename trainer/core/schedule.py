"""How long the job trains: the optimizer steps from `FT_MAX_STEPS` or `FT_NUM_EPOCHS`, the warm-up from
`FT_WARMUP_STEPS` or `FT_WARMUP_RATIO` (which of each pair applies is precedence.py's).

Worked out once the training rows are known (after the data check), as transformers' Trainer counts an epoch: the
passes of one epoch are ceil(rows / sequences per pass / processes), grouped into optimizer steps of `passes per
step` with the last one short, which is ceil(rows / sequences per optimizer step) steps however the memory plan
splits a step into passes.  The Trainer is then given that many steps (`max_steps`), so the learning-rate schedule,
the progress line's step and ETA, the summary, the report and a resume all count the same steps.
"""

from __future__ import annotations

import dataclasses
import math

from trainer.core.settings import Settings


@dataclasses.dataclass(frozen=True)
class Schedule:
    steps: int  # optimizer steps to train
    warmup_steps: int
    steps_per_epoch: int
    by_epochs: bool  # FT_NUM_EPOCHS decided the steps (else FT_MAX_STEPS)

    @property
    def epochs(self) -> float:
        """The passes over the training rows the steps make."""
        return self.steps / self.steps_per_epoch

    def describe(self, settings: Settings) -> str:
        """`2 epochs of 29 steps = 58 steps (FT_NUM_EPOCHS=2)` or `40 steps (FT_MAX_STEPS), 1.38 epochs of 29 steps`."""
        if self.by_epochs:
            return f"{settings.num_epochs:g} epoch(s) of {self.steps_per_epoch} steps = {self.steps} steps (FT_NUM_EPOCHS={settings.num_epochs:g})"
        return f"{self.steps} steps (FT_MAX_STEPS), {self.epochs:.2f} epoch(s) of {self.steps_per_epoch} steps"


def of(settings: Settings, train_rows: int, processes: int = 1) -> Schedule:
    """The schedule of a job that trains on `train_rows` checked rows with `processes` training processes in all."""
    per_step = settings.batch_size * settings.gradient_accumulation_steps * processes
    per_epoch = max(math.ceil(train_rows / per_step), 1)
    by_epochs = settings.num_epochs > 0
    steps = max(math.ceil(settings.num_epochs * per_epoch), 1) if by_epochs else settings.max_steps
    warmup = math.ceil(settings.warmup_ratio * steps) if settings.warmup_ratio else settings.warmup_steps
    return Schedule(steps, warmup, per_epoch, by_epochs)
