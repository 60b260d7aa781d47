"""Several training processes (ranks): who does what, and how they agree.

Rank 0 alone writes shared state (the data cache and report, the fingerprint, checkpoint manifests, the final
model, the MLflow run, the registry); every rank trains on its share of each optimizer step.  With one
process every function here is a no-op, so the job reads the same either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from trainer.core.errors import ConfigError

T = TypeVar("T")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun for every worker


def is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def start(config: Any) -> None:
    """Join the process group (gloo on CPU, NCCL on GPU, through accelerate) with the job's collective timeout,
    and check that every rank runs the same configuration (each node parsed its own FT_* variables)."""
    if world_size() == 1:
        return
    from accelerate import PartialState

    PartialState(timeout=timedelta(seconds=config.settings.collective_timeout_seconds))
    global _flags
    import torch.distributed as dist

    _flags = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.settings.collective_timeout_seconds))  # every rank, once
    shared = dataclasses.replace(config.settings, node_rank=0, termination_message_path="")  # the two settings that are each node's own
    mine = hashlib.sha256(json.dumps(dataclasses.asdict(shared), sort_keys=True).encode()).hexdigest()
    ours = gather(mine)
    if len(set(ours)) > 1:
        differ = [rank for rank, digest in enumerate(ours) if digest != ours[0]]
        raise ConfigError(
            f"ranks {differ} run with other FT_* settings than rank 0: give every node the "
            "same settings (only FT_NODE_RANK and FT_TERMINATION_MESSAGE_PATH may differ)"
        )


def gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    found: list[Any] = [None] * world_size()
    dist.all_gather_object(found, value)
    return found


def barrier() -> None:
    if world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


_flags: Any = None  # a gloo group beside the training one (NCCL on GPU): flags travel between the hosts' CPUs


def end_together() -> None:
    """After the job: every rank waits until rank 0 has finished its own part (the final save, the registration,
    minutes for a large model), so that the processes of every node end together.  Without it the others return at
    once and, on another node, torchrun's exit barrier logs an error after 300 s (the job still exits 0).

    The wait is on the gloo group (no GPU, no NCCL watchdog).  It ends when rank 0 arrives or when its process ends
    whatever its code, and then, or after FT_COLLECTIVE_TIMEOUT_SECONDS, the other ranks end as they would have
    (their part is done; rank 0's code is the job's)."""
    if world_size() == 1 or _flags is None:
        return
    import torch.distributed as dist

    try:
        dist.barrier(group=_flags)
    except Exception as error:  # noqa: BLE001 - a rank ended without arriving (rank 0 failing at the end): its own code is the job's
        print(f"fulltune: rank {os.environ.get('RANK', '0')}: a rank ended before the final barrier ({type(error).__name__}); "
              "its own exit code says why", file=sys.stderr, flush=True)


def leave() -> None:
    """Destroy the process groups once every collective has completed (the job succeeded): NCCL then frees its
    communicators here instead of warning at the interpreter's exit.  Not after a failure: a peer may be gone or a
    collective still in flight, which the destruction would wait for; the launcher ends those processes."""
    global _flags
    if world_size() == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()  # every group, the gloo one of the flags too
    _flags = None


class AnyRank:
    """Whether a flag (a stop signal that reached one node) is up on any rank, agreed by every rank, without a
    GPU sync and without waiting for the network: each call starts this call's exchange and returns the previous
    one's result, so every rank learns of a flag one call later, at the same call.

    The exchange is an all-reduce of a CPU tensor on a gloo group, started with `async_op`: under NCCL a flag on
    the GPU would cost a device-to-host copy (`.item()`) that waits for the whole step's queued work, every step.
    With one process the flag is returned as it is."""

    def __init__(self) -> None:
        self._pending: tuple[Any, Any] | None = None

    def exchange(self, flag: bool) -> bool:
        if world_size() == 1:
            return flag
        import torch
        import torch.distributed as dist

        seen = self.settle()
        value = torch.tensor([1.0 if flag else 0.0])
        self._pending = (dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_flags, async_op=True), value)
        return seen

    def settle(self) -> bool:
        """The result of the exchange in flight (False when none is): waits for it."""
        if self._pending is None:
            return False
        work, value = self._pending
        self._pending = None
        work.wait()
        return bool(value.item())  # a CPU tensor: no device sync


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any, at this call (it waits for every rank: for rare checks, e.g. once per save)."""
    exchange = AnyRank()
    seen = exchange.exchange(flag)
    return seen if world_size() == 1 else exchange.settle()


def main_first(work: Callable[[], T]) -> T:
    """Rank 0 does `work` first (e.g. tokenizes and caches the data); the others wait, then do it (reading the cache).

    Unlike accelerate's `main_process_first`, the others are released even when rank 0 fails, and fail the same
    way on the same input, instead of waiting for the collective timeout.
    """
    if world_size() == 1:
        return work()
    if is_main():
        try:
            return work()
        finally:
            barrier()
    barrier()
    return work()
