"""What checkpoints cost training, measured where it is paid: for the progress line, MLflow and the run report.

A background save costs training twice.  It blocks training for its snapshot (and any wait for the save before it),
timed in `saving.save`.  Then, while it is written, the steps are slower: the writer's serialisation, checksums
and the kernel's writeback run on the same cores as training (on CPU), and it holds the GIL between its calls.
That second cost never shows in the time blocked (with the forked writer CPU jobs had before, a 101M-parameter
model on 2 cores: 0.6 % of the wall time blocked, while the job took 30 % longer than without the saves;
bench/RESULTS.md).  So each optimizer step is timed and marked by whether a
save was being written when it began (a save starts between two steps), and

    overhead = time blocked + sum over the steps that overlapped a write of (their time - the median clean step)

where a clean step is one with no write in flight (the process's first step left out).  Noise goes both ways, so the sum is taken as it is and only the
total is floored at 0.  Until a clean step has been timed (a save at the very first step) there is no baseline,
and the overhead is the time blocked alone.  What this leaves out: an evaluation that overlaps a write is slowed
too (the job evaluates before it saves, so a write rarely outlasts the steps up to the next evaluation).
"""

from __future__ import annotations

import dataclasses
import statistics
import time


@dataclasses.dataclass
class Costs:
    """What checkpoints cost the training loop, for the progress line, MLflow and the run report."""

    began: float | None = None  # perf_counter at the start of training
    blocked: list[float] = dataclasses.field(default_factory=list)  # seconds training waited, per save
    waited: float = 0.0  # of those, seconds spent waiting for the previous save to finish
    own: list[float] = dataclasses.field(default_factory=list)  # of each save's, the seconds it blocked for itself (no wait for the one before)
    background: list[float] = dataclasses.field(default_factory=list)  # seconds each background write and commit took
    bytes: int = 0  # of the last committed checkpoint
    steps: list[tuple[float, bool]] = dataclasses.field(default_factory=list)  # (seconds, a write in flight) per step

    @property
    def last(self) -> float:
        return self.blocked[-1] if self.blocked else 0.0

    def _elapsed(self) -> float:
        return time.perf_counter() - self.began if self.began else 0.0

    @property
    def share(self) -> float:
        """Fraction of the wall time since training began spent blocked on checkpoints."""
        elapsed = self._elapsed()
        return sum(self.blocked) / elapsed if elapsed > 0 else 0.0

    @property
    def clean_step(self) -> float | None:
        """The median seconds of a step with no write in flight, the process's first step left out (AdamW allocates its
        states in it: the demo's took 2x the next ones); None before one was timed."""
        clean = [seconds for seconds, overlapped in self.steps[1:] if not overlapped]
        return statistics.median(clean) if clean else None

    @property
    def slowdown(self) -> float:
        """Seconds the steps that overlapped a background write took beyond a clean step (module docstring)."""
        clean = self.clean_step
        if clean is None:
            return 0.0
        return max(0.0, sum(seconds - clean for seconds, overlapped in self.steps if overlapped))

    @property
    def overhead(self) -> float:
        """Seconds checkpoints cost training so far: blocked, plus the slowdown of the steps beside a write."""
        return sum(self.blocked) + self.slowdown

    @property
    def overhead_share(self) -> float:
        """Fraction of the wall time since training began that checkpoints cost (blocked and slowed steps)."""
        elapsed = self._elapsed()
        return self.overhead / elapsed if elapsed > 0 else 0.0

    def step(self, seconds: float, overlapped: bool) -> None:
        self.steps.append((seconds, overlapped))

    def summary(self) -> dict[str, float]:
        return {
            "checkpoint_blocked_s": self.last,
            "checkpoint_blocked_total_s": sum(self.blocked),
            "checkpoint_blocked_share": self.share,
            "checkpoint_overhead_total_s": self.overhead,
            "checkpoint_overhead_share": self.overhead_share,
            "checkpoint_saves": len(self.blocked),
            "checkpoint_waited_s": self.waited,
        }
