"""Step down, never die of a plan: a CUDA out-of-memory error moves the job to the next plan down.

The memory plan (trainer/model/memory.py) is an estimate; CUDA-only terms it models (context, cuBLAS workspace,
allocator slack) may be larger on a real card.  When a training pass runs out of memory and a smaller plan is
possible, the job takes the next one down (more recomputation, then more passes per step: the same 8 sequences
per optimizer step, normalised by the step's token count, so the same updates) and trains on from its last
committed checkpoint, or from step 0 before the first.  The plan that fit and the peaks measured are written to
the volume (`.fulltune/memory-plan.json`), so a restart starts there instead of failing the same way again.
Only when the smallest plan runs out of memory does the job end: exit 4 with what to change.

With several processes the rank that ran out records the next plan and ends (exit 75): the other ranks wait in a
collective and cannot learn of it in time (they fail on their lost peer at once).  The launcher, reading the record,
starts the processes again at that plan; across nodes the orchestrator's retry does (trainer/launch/launcher.py).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from transformers import TrainerCallback

from trainer.core import ranks
from trainer.core.config import Config
from trainer.core.ending import is_out_of_memory
from trainer.core.errors import SmallestPlanOutOfMemory, StepDownRestart
from trainer.core.files import read_json, write_json
from trainer.core.volume import Volume
from trainer.model import memory
from trainer.model.estimate import checkpointed_layers

T = TypeVar("T")


def _layout(plan: memory.Plan) -> list[int]:
    """[sequences, passes, checkpoint_every], and a 1 after them when the recomputed layers' inputs are offloaded."""
    return [plan.sequences_per_pass, plan.passes_per_step, plan.checkpoint_every, *([1] if plan.offload else [])]


def _recomputed(plan: memory.Plan) -> int:
    return checkpointed_layers(plan.checkpoint_every, plan.layers) if plan.checkpoint_every else 0


def next_down(current: memory.Plan, plans: list[memory.Plan]) -> memory.Plan | None:
    """The fastest plan (`plans` run fastest first) that cannot need more memory than `current`; None at the bottom.

    "Cannot need more" is decided by the layout, not by the estimate that just proved wrong: no more sequences per
    pass, no fewer recomputed layers and no less offload, one of them strictly, so every step down makes progress
    and the descent ends at one sequence per pass with every layer recomputed (and offloaded, on a GPU).  Among
    those, one whose planned peak is lower than `current`'s first: a step with more passes keeps the earlier passes'
    gradients alive, so its estimate can be higher, and it is taken only when no lower one is left."""
    def key(p: memory.Plan) -> tuple[int, int, bool]:
        return p.sequences_per_pass, _recomputed(p), p.offload

    def smaller(p: memory.Plan) -> bool:
        fewer, more, offloaded = p.sequences_per_pass <= current.sequences_per_pass, _recomputed(p) >= _recomputed(current), p.offload >= current.offload
        return fewer and more and offloaded and key(p) != key(current)

    below = [p for p in plans if smaller(p)]
    return next((p for p in below if p.peak < current.peak), below[0] if below else None)


def measured_peak() -> tuple[float, str]:
    """The peak this process reached (bytes) and how it was measured."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return float(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "process RSS: no GPU"


def _describe_peak(peak: float, how: str) -> str:
    return f"{peak / memory.GB:.1f} GB ({how})"


def fixes(job: Config, plan: memory.Plan) -> list[str]:
    """What to change once nothing smaller is left, each a setting that lowers the peak."""
    settings, precision = job.settings, job.precision
    found = []
    if settings.max_length >= 256:
        found.append(f"FT_MAX_LENGTH={settings.max_length // 2} (tokens per sequence)")
    if precision.name == "bf16-mixed":
        found.append("FT_PRECISION=bf16-sr (12 instead of 16 bytes per parameter, no autocast copies)")
    if settings.activation_checkpointing == "off":
        found.append("FT_ACTIVATION_CHECKPOINTING=auto (recompute layers when needed)")
    if settings.batch_layout == "as-set":
        found.append("FT_BATCH_LAYOUT=auto (fewer sequences per pass)")
    more = max(2, 2 * plan.processes)
    found.append(f"FT_NUM_PROCESSES={more} FT_DISTRIBUTED=fsdp (the model sharded over {more} GPUs; FT_NUM_NODES for more machines)")
    return found


def _for(job: Config, plan: memory.Plan) -> dict[str, Any]:
    """What the recorded plan depends on: a record made for other settings or another card is not used."""
    s = job.settings
    return {
        "model": s.model, "precision": job.precision.name, "max_length": s.max_length, "batch_size": s.batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps, "batch_layout": s.batch_layout,
        "activation_checkpointing": s.activation_checkpointing, "capacity": plan.capacity, "strategy": plan.strategy, "processes": plan.processes,
        **({"replicas": plan.replicas} if plan.replicas > 1 else {}),  # a record of a flat FSDP plan stays valid
    }  # fmt: skip


def _plans(job: Config, plan: memory.Plan) -> list[memory.Plan]:
    from trainer.model import loading as model

    config = model.read_config(job.settings)
    settings = job.settings
    return memory.candidates(
        config, model.parameter_count(config, settings.trust_remote_code), settings, job.precision, plan.capacity,
        settings.activation_checkpointing, plan.processes, plan.strategy, plan.replicas, plan.device, plan.tokens_per_sequence,
    )


def resumed(job: Config, plan: memory.Plan) -> memory.Plan:
    """The plan to start with: the preflight's, or the smaller one an earlier attempt stepped down to."""
    record = read_json(Volume(job.settings.output_dir).memory_plan_file)
    if not record or record.get("for") != _for(job, plan) or record.get("plan") == _layout(plan):
        return plan
    recorded = next((p for p in _plans(job, plan) if _layout(p) == record.get("plan")), None)
    if recorded is None or recorded.peak >= plan.peak:
        return plan
    print(f"fulltune: memory plan: starting at the plan an earlier attempt stepped down to after running out of memory: {recorded.describe()}", flush=True)
    return recorded


class Ladder:
    """Runs training at one plan after another, stepping down on each out-of-memory error."""

    def __init__(self, job: Config, plan: memory.Plan):
        self.job, self.plan = job, plan
        self.volume = Volume(job.settings.output_dir)
        self.record = read_json(self.volume.memory_plan_file) or {}
        if self.record.get("for") != _for(job, plan):
            self.record = {}

    def run(self, attempt: Callable[[memory.Plan, Any], T]) -> T:
        """`attempt(plan, callback)` builds and trains a trainer at `plan`, with `callback` among its callbacks."""
        import torch

        while True:
            try:
                return attempt(self.plan, _Watch(self))
            except torch.OutOfMemoryError as error:
                peak, how = measured_peak()
                reason = " ".join(str(error).split())[:300]
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                # cuBLAS, cuDNN or NCCL out of device memory: the library's state after it is not to be trusted, so the
                # process ends (75) and the launcher starts it again at the recorded plan (trainer/launch/launcher.py)
                peak, how = measured_peak()
                self._step_down(peak, how, " ".join(str(error).split())[:300], restart=True)
            gc.collect()  # the failed trainer and its tensors, now that the exception no longer holds its frames
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            self._step_down(peak, how, reason)

    def _step_down(self, peak: float, how: str, reason: str, restart: bool = False) -> None:
        failed = self.plan
        lower = next_down(failed, _plans(self.job, failed))
        self.record.setdefault("out_of_memory", []).append({"plan": _layout(failed), "described": failed.describe(), "measured_peak_bytes": peak,
                                                            "measured_by": how, "error": reason})
        if lower is None:
            self._write()
            raise SmallestPlanOutOfMemory(_describe_peak(peak, how), failed.describe(), fixes(self.job, failed))
        self.record.update({"for": _for(self.job, lower), "plan": _layout(lower), "described": lower.describe(), "fit": None})
        self._write()
        if restart or ranks.world_size() > 1:  # the launcher says it in one line, for the whole job
            where = "on one of several processes" if ranks.world_size() > 1 else f"({reason[:120]})"
            raise StepDownRestart(
                f"out of GPU memory with {_short(failed)} (measured peak {_describe_peak(peak, how)}) {where}: "
                f"the next plan down ({_short(lower)}) is recorded in {self.volume.memory_plan_file}; the processes start again there"
            )
        print(
            f"fulltune: out of memory (measured peak {_describe_peak(peak, how)}) with {_short(failed)}: stepping down to {_short(lower)}"
            f" (the same updates), continuing from the last committed checkpoint (step 0 before the first); recorded in {self.volume.memory_plan_file}",
            file=sys.stdout, flush=True,
        )  # fmt: skip
        self.plan = lower

    def _write(self) -> None:
        write_json(self.volume.memory_plan_file, self.record)

    def fitted(self, step: int) -> None:
        """The first optimizer step at a plan reached after a step-down: record the peak that fit."""
        if self.record.get("plan") == _layout(self.plan) and self.record.get("fit") is None and ranks.is_main():
            peak, how = measured_peak()
            self.record["fit"] = {"step": step, "measured_peak_bytes": peak, "measured_by": how}
            self._write()


def _short(plan: memory.Plan) -> str:
    return (f"{plan.sequences_per_pass} sequences x {plan.passes_per_step} passes, recomputation "
            f"{memory.checkpointing_label(plan.checkpoint_every, plan.layers)}{plan.offload_label} (planned peak ~{plan.peak / memory.GB:.1f} GB)")


class _Watch(TrainerCallback):
    """Tells the ladder each finished optimizer step (the first one at a new plan records what fit)."""

    def __init__(self, ladder: Ladder):
        self.ladder = ladder

    def on_step_end(self, args, state, control, **kwargs):
        self.ladder.fitted(state.global_step)
