"""What the Trainer logs, as metrics of the job's one run: `MetricsCallback` replaces transformers' MLflowCallback,
which would start a new run on every restart (transformers #30563) and log every TrainingArguments field."""

from __future__ import annotations

import re

from transformers import TrainerCallback

from trainer.tracking.run import Tracker


class MetricsCallback(TrainerCallback):
    """What the Trainer logs (loss, eval_loss, learning_rate, grad_norm, ...) as metrics of the job's run, at the
    optimizer step.  Numbers only, names sanitised as transformers' MLflowCallback does."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        metrics = {re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", k): float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)}
        if metrics:
            self.tracker.log_metrics(metrics, step=state.global_step)
