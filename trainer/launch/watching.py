"""While the training processes run: end them all at once when one of them ran out of GPU memory.

The rank that runs out records the next plan down on the volume (trainer/model/stepdown.py), then its exit code, and
leaves.  The others cannot learn of it: under NCCL they wait in their collective with the host blocked in a CUDA
call, where no signal handler runs, until torchrun kills them 30 s after its SIGTERM (longer across nodes: until NCCL
notices the lost peer, or FT_COLLECTIVE_TIMEOUT_SECONDS), and each step-down costs that wait.  Nothing of theirs needs
saving (every rank starts again from the last committed checkpoint), so the launcher ends the whole process group as
soon as it reads the record (trainer/launch/launcher.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from trainer.core.errors import OutOfMemory, StepDownRestart
from trainer.core.files import read_json

WATCH_SECONDS = 0.25  # how often the launcher reads the ranks' exit records while they run


class StepDownWatch:
    """Whether this attempt's processes are over because one ran out of GPU memory: a local rank recorded 4 (the
    smallest plan), or 75 beside a new plan recorded (75 alone also ends a stop, after its commit).  On the other
    nodes no rank of theirs recorded anything: the new plan on the shared volume is the sign there."""

    def __init__(self, plans: str, before: Any, nodes: int):
        self.plans, self.before, self.nodes = plans, before, nodes
        self._seen: tuple[int, int] | None = None  # the record's (mtime, size) when last read: read again only when it changed
        self._changed = False

    def __call__(self, outcome: str) -> bool:
        codes = recorded_codes(outcome)
        if OutOfMemory.exit_code in codes.values():
            return True  # the smallest plan ran out: the job ends with 4 whatever the others do
        if StepDownRestart.exit_code not in codes.values() and self.nodes == 1:
            return False
        return self._plan_changed()

    def _plan_changed(self) -> bool:
        try:
            stat = os.stat(self.plans)
        except OSError:
            return False
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            self._seen = (stat.st_mtime_ns, stat.st_size)
            self._changed = (read_json(self.plans) or {}).get("plan") not in (None, self.before)
        return self._changed


def wait(child: subprocess.Popen, outcome: str, watch: StepDownWatch | None) -> int:
    """Wait for the child; with `watch`, end its whole process group as soon as the watch says the attempt is over."""
    if watch is None:
        return child.wait()
    while True:
        try:
            return child.wait(timeout=WATCH_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        if watch(outcome):
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended meanwhile
            return child.wait()


def recorded_codes(folder: str) -> dict[int, int]:
    """Each local rank's recorded exit code, by local rank (an empty record is a failure: 1)."""
    codes = {}
    for name in os.listdir(folder):
        if name.startswith("rank."):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                codes[int(name.rsplit(".", 1)[1])] = int(f.read().strip() or 1)
    return codes
