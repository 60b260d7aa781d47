"""One parseable progress line per logging step, and the same numbers in MLflow.

    fulltune: step=20/50 loss=2.3400 lr=1.2e-05 tokens_per_s=15234 mfu=0.470 mem_gb=61.2 eta_s=812

`tokens_per_s` counts real tokens (TRL's `num_tokens`: no padding) over the time spent in optimizer
steps since the previous line, so evaluations do not dilute it.  `mfu` (GPU only) is model FLOPs per
second over the GPU's dense bf16 peak: 6 x parameters + 12 x layers x attention width x sequence length
per token (PaLM's and torchtitan's count: what the step's math needs, with no recomputation of any kind:
not activation checkpointing's, nor the attention kernel's in its backward, nor the logits TRL's chunked
loss recomputes; tests/test_progress_flops.py holds it to torch's FlopCounterMode).  `mem_gb` is
`torch.cuda.max_memory_allocated` on GPU and the peak RSS on CPU.  `eta_s` extrapolates the mean
wall time per step so far, evaluations included.  Keys without a value on this device are left out.
At each checkpoint save a line says what it cost (checkpointing/costs.py): the seconds this save blocked training,
the share of the wall time blocked so far, and the share that checkpoints cost so far, blocked time plus the slowdown
of the steps that ran beside a background write (known once those steps ran: the line at the end of training
gives the last ones, when there were steps after the last save):

    fulltune: step=25/50 checkpoint_blocked_s=0.84 checkpoint_blocked_share=0.012 checkpoint_waited_s=0.00 checkpoint_overhead_share=0.041

(`checkpoint_waited_s`: of the seconds blocked so far, those spent waiting for the previous save's write.)
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

from transformers import TrainerCallback

from trainer.model.estimate import flops_per_token  # the count the plan's step cost (trainer/model/step_cost.py) starts from
from trainer.telemetry.feed import Telemetry
from trainer.tracking.run import Tracker

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "B200": 2250e12}


def peak_flops(device_name: str) -> float | None:
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


FORMATS = {
    "loss": "{:.4f}", "eval_loss": "{:.4f}", "lr": "{:.3g}", "tokens_per_s": "{:.0f}", "mfu": "{:.3f}", "mem_gb": "{:.1f}", "eta_s": "{:.0f}",
    "checkpoint_blocked_s": "{:.2f}", "checkpoint_blocked_share": "{:.3f}", "checkpoint_waited_s": "{:.2f}", "checkpoint_overhead_share": "{:.3f}",
}  # fmt: skip


def format_line(values: dict[str, Any]) -> str:
    return "fulltune: " + " ".join(f"{k}={FORMATS.get(k, '{}').format(v)}" for k, v in values.items() if v is not None)


def parse_line(line: str) -> dict[str, str]:
    """The inverse of format_line, for tools that read the log."""
    return dict(part.split("=", 1) for part in line.removeprefix("fulltune: ").split() if "=" in part)


def memory_gb(cuda: bool) -> float:
    if cuda:
        import torch

        return torch.cuda.max_memory_allocated() / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1e9 if sys.platform == "darwin" else 1e6)  # bytes on macOS, KiB elsewhere


class Progress(TrainerCallback):
    """Print the progress line at every logging step and log its numbers to the active MLflow run.

    Its numbers go to the job's run through the tracker (the Trainer's own `logs` are logged by
    tracking.metrics.MetricsCallback), and with each step to what the cluster sees (trainer/telemetry/).  The last
    step is always logged, so a run shorter than FT_LOGGING_STEPS still prints its training loss.
    """

    def __init__(self, tracker: Tracker, config: Any, n_params: int, sequences_per_step: int, cuda: bool, checkpoint_costs: Any = None,
                 telemetry: Telemetry | None = None, by_epochs: bool = False):
        self.tracker, self.config, self.n_params, self.sequences_per_step, self.cuda = tracker, config, n_params, sequences_per_step, cuda
        self.telemetry = telemetry or Telemetry()
        self.by_epochs = by_epochs  # FT_NUM_EPOCHS: the line also says which epoch the step is in
        self.checkpoint_costs = checkpoint_costs  # checkpointing/costs.Costs: what each save blocked training
        self.peak = None
        if cuda:
            import torch

            self.peak = peak_flops(torch.cuda.get_device_name(0))
        self.step_time = 0.0  # seconds inside optimizer steps since the last line
        self.last_tokens, self.last_step = 0, 0
        self.began = self.step_started = None
        self.costs_steps = 0  # steps timed by checkpoint_costs when its line was printed last

    def on_train_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()
        self.last_step = state.global_step
        self.start_step = state.global_step
        self.telemetry.stage("training", step=state.global_step, max_steps=state.max_steps)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.step_started is not None:
            self.step_time += time.perf_counter() - self.step_started
        if state.global_step >= state.max_steps:
            control.should_log = True  # the Trainer logs every FT_LOGGING_STEPS only: the last loss would go unseen
        self.telemetry.step(state.global_step, last=state.global_step >= state.max_steps or bool(getattr(control, "should_training_stop", False)))

    def on_save(self, args, state, control, **kwargs):
        """At each save: the seconds it blocked training, and the shares of the wall time checkpoints cost so far."""
        costs = self.checkpoint_costs
        if costs is None or not costs.blocked:
            return
        self._checkpoint_line(state, costs)
        self.telemetry.checkpoint(costs.last, costs.share)

    def on_train_end(self, args, state, control, **kwargs):
        """Steps that ran beside a write after the last save's line: the cost line again, with their slowdown."""
        costs = self.checkpoint_costs
        if costs is not None and costs.blocked and len(costs.steps) > self.costs_steps:
            self._checkpoint_line(state, costs)

    def _checkpoint_line(self, state, costs: Any) -> None:
        values = {"step": f"{state.global_step}/{state.max_steps}", "checkpoint_blocked_s": costs.last, "checkpoint_blocked_share": costs.share,
                  "checkpoint_waited_s": costs.waited, "checkpoint_overhead_share": costs.overhead_share}
        print(format_line(values), flush=True)
        self.tracker.log_metrics(costs.summary(), state.global_step)
        self.costs_steps = len(costs.steps)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs or "num_tokens" not in logs:
            if "eval_loss" in logs:
                print(format_line({"step": f"{state.global_step}/{state.max_steps}", "eval_loss": float(logs["eval_loss"])}), flush=True)
                self.telemetry.metrics(eval_loss=float(logs["eval_loss"]))
            return
        tokens = float(logs["num_tokens"]) - self.last_tokens
        steps = state.global_step - self.last_step
        tokens_per_s = tokens / self.step_time if self.step_time > 0 else None
        mfu = None
        if self.peak and tokens_per_s and steps:
            mean_sequence = tokens / (steps * self.sequences_per_step)
            mfu = tokens_per_s * flops_per_token(self.config, self.n_params, mean_sequence) / self.peak
        done = state.global_step - self.start_step
        elapsed = time.perf_counter() - self.began if self.began else 0.0
        eta = elapsed / done * (state.max_steps - state.global_step) if done else None
        values = {
            "step": f"{state.global_step}/{state.max_steps}",
            "loss": float(logs["loss"]),
            "lr": float(logs.get("learning_rate", 0.0)),
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "mem_gb": memory_gb(self.cuda),
            "eta_s": eta,
        }
        if self.by_epochs:
            values["epoch"] = round(float(state.epoch or 0.0), 2)
        print(format_line(values), flush=True)
        self.telemetry.metrics(**{k: v for k, v in values.items() if k != "step"})
        self.tracker.log_metrics({k: v for k, v in values.items() if k in ("tokens_per_s", "mfu", "mem_gb", "eta_s") and v is not None}, state.global_step)
        self.last_tokens, self.last_step, self.step_time = float(logs["num_tokens"]), state.global_step, 0.0
