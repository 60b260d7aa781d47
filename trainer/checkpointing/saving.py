"""Checkpoint saves that do not stall training: a snapshot in host memory, written and committed in the background.

Training waits only for the snapshot of the state, plus the few small files (scheduler, RNG states, trainer
state).  The snapshot is a copy into host memory by torch's checkpoint stager
(`torch.distributed.checkpoint.staging.DefaultStager`, the one `dcp.async_save` uses), into buffers kept from one
save to the next (pinned on a GPU).  On CPU too: a fork of the training process, the copy-free snapshot this replaced,
cost the steps after each save 2-6x what the copy costs them (bench/RESULTS.md, docs/checkpoints.md).  A background
thread then writes the snapshot, flushes and checksums every file and writes `commit.json` last
(checkpointing/manifest.py).  At most
one save is in flight: the next one first waits for it, and that wait is counted as time blocked.  A crash or
SIGKILL in the background leaves a folder without a manifest, which the next start sets aside as it always did.

Why this much of our own code: transformers 5.24 has no asynchronous save, and `dcp.async_save` writes DCP's own
layout, which the Trainer's resume (exact, tests/test_preemption.py) and its best-model reload do not read.  So
the snapshot is written in the Trainer's own layout by the Trainer's own writer (`Trainer._save` given the
snapshot as its state dict: the weights as safetensors with the tied head dropped, the config, the tokenizer),
and the optimizer snapshot with `torch.save` as `_save_optimizer_and_scheduler` would (loaded back with
`weights_only=True`).  The rest of transformers' `_save_checkpoint` (best-model bookkeeping, trainer state) is
repeated in `save` below.  Under FSDP each rank writes its own shard of the
weights and optimizer states through torch DCP (accelerate's SHARDED_STATE_DICT path, a collective every rank
joins), in the foreground; only their commit is in the background.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from trainer.checkpointing.costs import Costs
from trainer.core import ranks

TRAINING_ARGS_JSON = "training_args.json"  # instead of transformers' training_args.bin, a pickle of the arguments
PROBE_BYTES = 32 << 20  # written and flushed once at start to measure the volume: ~0.25 s at 0.125 GB/s


class Saves:
    """One background save at a time, on one thread; its error is raised in the training thread at the next wait."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._executor: ThreadPoolExecutor | None = None
        self._stager: Any = None
        self._inflight: Future | None = None
        self._core = WriterCore(enabled=not pinned)
        self._flushing = False  # the save in flight has only its flush left, which waits on the disk, not a core
        self.costs = Costs()

    def stage(self, state_dict: dict) -> dict:
        """A copy of `state_dict` in host memory (its tensors copied, the rest deep-copied)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Pinned host buffers, reused from save to save, and copies that overlap on a GPU; plain copies on CPU.
            options = StagingOptions(use_pinned_memory=self.pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=self.pinned)
            self._stager = DefaultStager(options)
        return self._stager.stage(state_dict)

    def snapshot(self, trainer: Any, folder: str, background: bool) -> Callable[[], None]:
        """Take the snapshot of the weights and optimizer states now; what writes them into `folder` afterwards."""

        def live() -> dict:
            return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}

        if not background:  # written before the save returns: nothing changes the state meanwhile
            return lambda: write_snapshot(trainer, folder, live())
        staged = self.stage(live())
        return lambda: write_snapshot(trainer, folder, staged)

    def start(self, job: Callable[[], None]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fulltune-checkpoint")
        began = time.perf_counter()

        def timed() -> None:
            job()
            self.costs.background.append(time.perf_counter() - began)

        self._core.give()
        self._flushing = False
        self._inflight = self._executor.submit(timed)

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def flushing(self) -> None:
        """Called by the save in flight once its CPU work is done (written and checksummed): from here it only waits
        for the disk, and the next step takes the core back (~0.5 s of each 1.2 GB save on CPU, bench/RESULTS.md)."""
        self._flushing = True

    def between_steps(self) -> None:
        """Before each step: the writer's core back to training once the write no longer needs it."""
        if self._flushing or not self.in_flight:
            self._core.take_back()

    def raise_if_failed(self) -> None:
        """Re-raise at once what failed in a save that has ended (a full volume), without waiting for one in flight:
        the job stops at the step after, naming that checkpoint, instead of training on until the next save."""
        if self._inflight is not None and self._inflight.done() and self._inflight.exception() is not None:
            self.wait()

    def wait(self) -> float:
        """Wait for the save in flight (re-raising what failed in it); the seconds waited."""
        if self._inflight is None:
            return 0.0
        began = time.perf_counter()
        inflight, self._inflight = self._inflight, None
        try:
            inflight.result()
        finally:
            self._core.take_back()
        return time.perf_counter() - began

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class WriterCore:
    """On CPU, one of training's threads stands down while a write is in flight, so the writer has a core of its own.

    Training's threads take every core and run each operation in lockstep (OpenMP): a writer thread that takes a core
    from one of them holds up the other at every operation, so a step beside the write took ~2x longer and a save
    cost training about twice the writer's own CPU time (bench/RESULTS.md).  With one thread fewer until the write
    ends, the steps beside it run at the speed of that many threads and no longer wait on each other.  A GPU job's
    threads only feed the device: left as they are.  Only the training thread changes the count, as OpenMP's is its own.
    """

    def __init__(self, enabled: bool):
        self.enabled, self._threads, self._owner = enabled, 0, 0

    def give(self) -> None:
        import torch

        if self.enabled and not self._threads and (threads := torch.get_num_threads()) > 1:
            self._threads, self._owner = threads, threading.get_ident()
            torch.set_num_threads(threads - 1)

    def take_back(self) -> None:
        if self._threads and threading.get_ident() == self._owner:
            import torch

            torch.set_num_threads(self._threads)
            self._threads = 0


def write_snapshot(trainer: Any, folder: str, staged: dict) -> None:
    """Write the host snapshot in the Trainer's layout, with the Trainer's writer (see the module's docstring)."""
    import torch
    from transformers.trainer import OPTIMIZER_NAME, TRAINING_ARGS_NAME

    trainer._save(folder, state_dict=staged["model"])
    os.remove(os.path.join(folder, TRAINING_ARGS_NAME))  # a pickle: nothing resumes from it, and unpickling can run code
    with open(os.path.join(folder, TRAINING_ARGS_JSON), "w", encoding="utf-8") as f:
        f.write(trainer.args.to_json_string())
    crc32 = torch.serialization.get_crc32_options()
    # The manifest checksums every file (checkpointing/manifest.py): zip's CRC-32 of each record would be a second pass
    # over the whole optimizer state, 0.5-2 s of CPU per GB beside training (bench/RESULTS.md).  Only this write runs
    # then: a save's own files are written before its background write starts, the next save's after it ends.
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(staged["optimizer"], os.path.join(folder, OPTIMIZER_NAME))
    finally:
        torch.serialization.set_crc32_options(crc32)


def save(trainer: Any, trial: Any, saves: Saves, committed: Callable[[str, int, str | None], None] | None, background: bool = True) -> str:
    """transformers' `_save_checkpoint`, blocking training only for the snapshot; returns the checkpoint folder.

    `committed(folder, step, best)` runs on the main rank once every file is written (in the background unless
    `background` is off); None: nothing commits this save (a save set aside).
    """
    import torch
    from transformers.trainer import PREFIX_CHECKPOINT_DIR, SCHEDULER_NAME, TRAINER_STATE_NAME
    from transformers.trainer_callback import ExportableState

    began = time.perf_counter()
    waited = saves.wait()  # at most one save in flight
    saves.costs.waited += waited
    args, state = trainer.args, trainer.state
    trainer.store_flos()
    run_dir = trainer._get_output_dir(trial=trial)
    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    write: Callable[[], None] | None = None
    if trainer.is_fsdp_enabled:
        # SHARDED_STATE_DICT (recipe.fsdp_config): accelerate's save_fsdp_model/save_fsdp_optimizer write DCP folders,
        # each rank its own shard in parallel, flushed (FileSystemWriter's sync_files) before dcp.save returns on any rank
        trainer._save_optimizer_and_scheduler(folder)
    elif args.should_save:
        os.makedirs(folder, exist_ok=True)
        write = saves.snapshot(trainer, folder, background and ranks.is_main())
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(folder, SCHEDULER_NAME))
    ranks.barrier()  # the folder exists for every rank before the best checkpoint is looked up
    if state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if os.path.exists(best):
            state.best_model_checkpoint = best
    trainer._save_scaler(folder)
    trainer._save_rng_state(folder)
    if args.should_save:
        for callback in [cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)]:
            name, exported = callback.__class__.__name__, callback.state()
            if isinstance(state.stateful_callbacks[name], list):
                state.stateful_callbacks[name].append(exported)
            else:
                state.stateful_callbacks[name] = exported
        state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))
    ranks.barrier()  # every rank's own files (its RNG state, its shards under FSDP) are written

    step, best = state.global_step, state.best_model_checkpoint

    def finish() -> None:
        if write is not None:
            write()
        if committed is not None and ranks.is_main():
            committed(folder, step, best)

    if background and ranks.is_main():
        saves.start(finish)
    else:
        finish()
    saves.costs.blocked.append(time.perf_counter() - began)
    saves.costs.own.append(saves.costs.blocked[-1] - waited)
    return folder


def write_speed(folder: str) -> float | None:
    """Bytes per second of a flushed write to `folder` (one 32 MiB file, removed); None when it cannot be measured."""
    path = os.path.join(folder, ".write-speed-probe")
    try:
        os.makedirs(folder, exist_ok=True)
        began = time.perf_counter()
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20) * (PROBE_BYTES >> 20))
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - began
        return PROBE_BYTES / seconds if seconds > 0 else None
    except OSError:
        return None
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
