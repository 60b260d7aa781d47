"""When the job saves besides transformers' every `FT_SAVE_STEPS`: at an evaluation step, by time since the last save.

`FT_SAVE_EVERY_MINUTES`: once that many minutes have passed, to bound the work a hard kill loses.

`FT_SAVE_STEPS=auto`: once the measured costs (saving.py's `Costs`) allow another save.  Two floors, in seconds from
one save to the next:

- the last writes took W s in the background: wait SPARE x W, so that a save never waits for the one before
  (a save never starts while one is still in flight either, whatever the estimate said);
- the last saves cost training B s each: wait B / BLOCKED_SHARE, so that saves cost at most 5 % of the wall time.  B is
  the time a save blocked training plus its share of the slowdown of the steps that ran beside a write (costs.py):
  on CPU most of what a save costs is paid there, not in the time blocked.

`FT_SAVE_EVERY_MINUTES`, set too, bounds the second floor (the work lost matters more than 5 %), never the first: a
save that would wait for the previous one saves nothing sooner.  Before the first write is measured, W is the one
the volume's probe at start predicts (state size / measured speed: overview.py), and B is taken as 0.  The longest of
the last RECENT saves decides, as a volume's speed varies.  A periodic save whose write would still run when the last
step saves is left out: the last step's save would wait for it.

Saves come only at evaluation steps, so the best model is always chosen among evaluated checkpoints (transformers'
`load_best_model_at_end` rule, which makes a fixed `FT_SAVE_STEPS` a multiple of `FT_EVAL_STEPS`); with `auto` the
Trainer's own step-based saves are moved past the last step (recipe.py), and the last step still saves.  When saves
happen changes nothing of the training: a resume is exact whatever cadence wrote its checkpoint, so the cadence is
not part of the volume's fingerprint (trainer/core/config.py).
"""

from __future__ import annotations

import math
import time

from trainer.checkpointing.costs import Costs

BLOCKED_SHARE = 0.05  # auto: the share of the wall time saves may block training
SPARE = 1.25  # auto: the next save starts once the last one's write has had this many times its measured length
RECENT = 3  # auto: the longest of the last this many writes (and blocked times) decides


def interval(write_s: float, blocked_s: float, bound_s: float = 0.0) -> float:
    """auto: seconds from one save to the next (see the module's docstring); `bound_s`: FT_SAVE_EVERY_MINUTES, 0 = none."""
    cheap = blocked_s / BLOCKED_SHARE
    return max(write_s * SPARE, min(cheap, bound_s) if bound_s else cheap)


def in_steps(seconds: float, step_s: float, eval_steps: int) -> int:
    """An interval in seconds as the steps it spans, rounded up to a multiple of FT_EVAL_STEPS (where saves can happen)."""
    return eval_steps * max(1, math.ceil(seconds / (step_s * eval_steps))) if step_s > 0 else eval_steps


def fixed_cost(write_s: float, blocked_s: float, every_s: float) -> tuple[float, float]:
    """A save every `every_s` seconds of training: (the share of the wall time blocked, the seconds each waits for the one before)."""
    waits = max(0.0, write_s - every_s)
    cycle = every_s + blocked_s + waits
    return ((blocked_s + waits) / cycle if cycle > 0 else 0.0), waits


class Cadence:
    """The main rank's clock and the measured costs decide; CommitCheckpoints (commits.py) asks at each evaluation step."""

    def __init__(self, costs: Costs, every_minutes: float = 0.0, auto: bool = False):
        self.costs, self.auto = costs, auto
        self.bound = every_minutes * 60
        self.expected_write: float | None = None  # seconds, one write as the volume's probe at start predicts it (None: unknown)
        self.last_save = time.monotonic()
        self.began, self.first_step = time.monotonic(), 0
        self.told = False  # the cost line is printed once, at the step after the first save

    def started(self, step: int) -> None:
        self.began = self.last_save = time.monotonic()
        self.first_step = step

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def measured(self) -> tuple[float, float]:
        """(write, cost) seconds of one save: the longest recent write (the probe's estimate before any) and the longest time
        a recent save blocked training, plus each save's share of the steps slowed beside writes; 0 before any."""
        write = max(self.costs.background[-RECENT:], default=self.expected_write or 0.0)
        slowed = self.costs.slowdown / len(self.costs.blocked) if self.costs.blocked else 0.0  # each save's share of the steps slowed beside writes
        return write, max(self.costs.own[-RECENT:], default=0.0) + slowed

    def seconds(self) -> float:
        """auto: seconds from one save to the next."""
        return interval(*self.measured(), self.bound)

    def step_seconds(self, step: int) -> float | None:
        """Wall seconds per optimizer step since training (re)started, evaluations and saves included."""
        done = step - self.first_step
        return (time.monotonic() - self.began) / done if done > 0 else None

    def due(self, step: int, max_steps: int, in_flight: bool) -> bool:
        """At an evaluation step that saves nothing else: whether to save now."""
        elapsed = time.monotonic() - self.last_save
        if not self.auto:
            return bool(self.bound) and elapsed >= self.bound
        if in_flight or elapsed < self.seconds():
            return False
        per_step = self.step_seconds(step)
        return per_step is None or (max_steps - step) * per_step >= self.measured()[0] * SPARE

    def cost_line(self, step: int, save_steps: int, eval_steps: int) -> str | None:
        """Once, at the step after the first save: what a save costs (its write as measured, or while it still runs as the
        probe predicts it), what this cadence costs, what auto would do."""
        per_step = self.step_seconds(step)
        if self.told or not self.costs.own or per_step is None or not (self.costs.background or self.expected_write):
            return None
        self.told = True
        write, blocked = self.measured()
        how = "measured" if self.costs.background else "as the volume's speed at start predicts"
        said = f"fulltune: checkpoint cost: a save cost training {blocked:.2f} s and writes for {write:.1f} s in the background ({how})"
        auto = interval(write, blocked, self.bound)
        if self.auto:
            return (f"{said}; FT_SAVE_STEPS=auto saves at the first evaluation step {auto:.0f} s after the last save, about every "
                    f"{in_steps(auto, per_step, eval_steps)} steps at {per_step:.2f} s a step")
        share, waits = fixed_cost(write, blocked, save_steps * per_step)
        queue = f" and queue behind each other (each waits ~{waits:.0f} s for the one before)" if waits else ""
        return (f"{said}; at FT_SAVE_STEPS={save_steps} (~{save_steps * per_step:.0f} s of training at {per_step:.2f} s a step) saves take "
                f"{share:.1%} of the wall time{queue}; FT_SAVE_STEPS=auto would save every {in_steps(auto, per_step, eval_steps)} steps")
