"""Memory and disk preflight: will this configuration fit, worked out before any weight is downloaded.

The GPU plan needs only the model's config.json (a few KB): trainer/model/estimate.py gives the bytes of
each phase of a step (forward, start and end of the backward, the optimizer's update) for a layout, as
bench/simulate_memory.py measures them with torch's own accounting; the plan is the fastest layout whose
highest phase fits.  Per parameter, before activations:

  weights      fp32 master copy                                  4 B/param
  gradients    fp32                                              4 B/param
  optimizer    AdamW exp_avg + exp_avg_sq, fp32                  8 B/param
  (FT_PRECISION=bf16-sr: bf16 weights 2 + bf16 gradients 2 + fp32 states 8 = 12 B/param, no autocast copies)

docs/memory-plan.md describes every term, the CUDA-only ones (context, cuBLAS workspace, allocator slack)
and `python entrypoint.py plan`, which prints this plan for a card.

The preflight also checks the volume's room (trainer/model/disk_space.py) and the host's memory
(trainer/model/host_memory.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.core.config import Config, Precision, sharings
from trainer.core.errors import ConfigError
from trainer.core.settings import Settings
from trainer.model import disk_space, step_cost
from trainer.model.estimate import (  # noqa: F401  (the plan's public names stay here)
    LOSS_TILE_TOKENS,
    LOSS_TILE_VOCAB,
    SIMULATED_TOLERANCE,
    checkpointed_layers,
    checkpointing_label,
    estimate,
    layer_bytes_per_token,
    offloaded_bytes,
    parameter_count,
    phases,
    shape,
)
from trainer.model.host_memory import check_host_memory, checkpoint_staging_bytes, final_gather_bytes, host_memory_bytes  # noqa: F401

GB = 1e9
TOLERANCE = 0.15  # allowed error against RSS measured on CPU (fp32); against bench/simulate_memory.py: SIMULATED_TOLERANCE


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the job will run with, and what it is expected to cost."""

    sequences_per_pass: int
    passes_per_step: int
    checkpoint_every: int  # 0: no recomputation; n: every n-th decoder layer recomputes (transformers' `every_n_layers`)
    breakdown: dict[str, float]  # bytes, by component
    capacity: float  # bytes; 0 = no device limit (CPU)
    layers: int = 0  # decoder layers, for describing the recomputation
    strategy: str = "none"  # how several processes share the model: none (one process), ddp or fsdp
    processes: int = 1

    phase: str = "forward"  # of the step, where the peak is
    replicas: int = 1  # fsdp: replicas of the sharded model (HSDP: one per node, sharded within it); else 1
    offload: bool = False  # the recomputed layers' saved inputs held in host memory (transformers' `offload`)
    seconds: float = 0.0  # estimated time of one optimizer step (trainer/model/step_cost.py), on `device`
    device: step_cost.Device = step_cost.DEVICES["cpu"]  # whose speeds the time was estimated with
    tokens_per_sequence: float = 0.0  # the mean sequence the time was estimated for
    offloaded: float = 0.0  # bytes of pinned host memory the offloaded activations take at once
    parameters: int = 0  # the model's parameter count, as the preflight counted it (trainer/model/loading.py); 0: no model read

    @property
    def shards(self) -> int:
        return self.processes // self.replicas if self.strategy == "fsdp" else 1

    @property
    def peak(self) -> float:
        return sum(self.breakdown.values())

    @property
    def checkpointing(self) -> bool:
        return self.checkpoint_every > 0

    @property
    def fits(self) -> bool:
        return not self.capacity or self.peak <= self.capacity

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.breakdown.items())
        limit = f" of {self.capacity / GB:.1f} GB" if self.capacity else " (no device limit)"
        sharing = {
            "none": "",
            "ddp": f"{self.processes} processes (ddp: a whole model each), per process: ",
            "fsdp": f"{self.processes} processes (fsdp: 1/{self.shards} of the model each{self._replicated}), per process: ",
        }
        return (
            f"{sharing[self.strategy]}{self.sequences_per_pass} sequences x {self.passes_per_step} passes per step, activation checkpointing "
            f"{checkpointing_label(self.checkpoint_every, self.layers)}{self.offload_label}: peak ~{self.peak / GB:.1f} GB{limit} ({parts} GB)"
        )


    @property
    def offload_label(self) -> str:
        return ", offloaded to host memory" if self.offload else ""

    @property
    def _replicated(self) -> str:
        return f", sharded within each of {self.replicas} nodes and replicated across them" if self.replicas > 1 else ""


def plan(config: Any, n_params: int, settings: Settings, precision: Precision, capacity: float, checkpointing: str, processes: int = 1,
         device: step_cost.Device | None = None, tokens_per_sequence: float | None = None) -> Plan:
    """The cheapest sharing of the model (none for one process; `auto`: ddp, else fsdp; on several nodes fsdp within
    each node first, HSDP), then the layout with the shortest estimated step (trainer/model/step_cost.py) among those
    that fit `capacity` (0 = no limit) in each process.

    `checkpointing` is FT_ACTIVATION_CHECKPOINTING; with `FT_BATCH_LAYOUT=as-set` the passes are as set.  `device`:
    whose speeds rank the layouts (by default from `capacity`); `tokens_per_sequence`: the data's mean sequence
    after preparation when known (else FT_MAX_LENGTH).
    """
    ways = sharings(settings, processes)
    chosen = [_plan(config, n_params, settings, precision, capacity, checkpointing, strategy, processes, replicas, device, tokens_per_sequence)
              for strategy, replicas in ways]
    return next((c for c in chosen if c.fits), chosen[-1])


def _plan(config: Any, n_params: int, settings: Settings, precision: Precision, capacity: float, checkpointing: str, strategy: str, processes: int,
          replicas: int, device: step_cost.Device | None, tokens_per_sequence: float | None) -> Plan:
    layouts = candidates(config, n_params, settings, precision, capacity, checkpointing, processes, strategy, replicas, device, tokens_per_sequence)
    fitting = [c for c in layouts if c.fits]
    return fitting[0] if fitting else min(layouts, key=lambda c: c.peak)


def candidates(
    config: Any, n_params: int, settings: Settings, precision: Precision, capacity: float, checkpointing: str, processes: int = 1, strategy: str | None = None,
    replicas: int = 1, device: step_cost.Device | None = None, tokens_per_sequence: float | None = None,
) -> list[Plan]:
    """Every layout the settings allow, fastest first by the estimated step time (the lower peak first between equals).

    The plan is the first that fits; a job that runs out of memory anyway steps down to a layout of no more
    sequences per pass, no fewer recomputed layers and no less offload (trainer/model/stepdown.py): each makes the
    same updates.  `strategy`: none, ddp or fsdp, with `replicas` (HSDP); by default the ones `plan` picks."""
    device = device or step_cost.device_for("", capacity)
    tokens_per_sequence = min(tokens_per_sequence or settings.max_length, settings.max_length)
    if strategy is None:
        chosen = plan(config, n_params, settings, precision, capacity, checkpointing, processes, device, tokens_per_sequence)
        strategy, replicas = chosen.strategy, chosen.replicas
    shards = processes // replicas if strategy == "fsdp" else 1
    communicators = 3 if replicas > 1 else 1  # HSDP: the default group, each node's shard group and the replicas' group
    effective = settings.batch_size * settings.gradient_accumulation_steps
    if settings.batch_layout == "as-set":
        layouts = [(settings.batch_size, settings.gradient_accumulation_steps)]
    else:
        layouts = [(effective // p, p) for p in range(1, effective + 1) if effective % p == 0]
    layers = shape(config)["layers"]
    found = []
    for per_pass, passes in layouts:
        for every in recomputation_choices(checkpointing, layers, bool(capacity), every_layer_only=strategy == "fsdp"):
            # offload: transformers' (5.24) pins host memory, so on an accelerator only; accelerate's FSDP2 checkpointing has none
            for offload in (False, True) if every and capacity and device.host_link and strategy != "fsdp" else (False,):
                layout = {"sequences_per_pass": per_pass, "passes_per_step": passes, "checkpoint_every": every, "offload": offload}
                each = phases(config, n_params, precision=precision, max_length=settings.max_length, shards=shards, processes=processes,
                              communicators=communicators, **layout)
                highest = max(each, key=lambda name: sum(each[name].values()))
                if offload and sum(each[highest].values()) >= found[-1].peak:
                    continue  # the peak is not in the activations (the backward's end, say): offloading would only cost time
                cost = step_cost.step_cost(config, n_params, precision, tokens_per_sequence=tokens_per_sequence, device=device, shards=shards, **layout)
                found.append(Plan(per_pass, passes, every, each[highest], capacity, layers, strategy, processes, highest, replicas, offload, cost.seconds,
                                  device, tokens_per_sequence, offloaded_bytes(config, precision, per_pass, settings.max_length, every) if offload else 0.0,
                                  n_params))
    return sorted(found, key=lambda c: (round(c.seconds, 9), c.peak))


def recomputation_choices(policy: str, layers: int, limited: bool, every_layer_only: bool = False) -> list[int]:
    """`every_n_layers` values to try, least recomputation first (0 = none, 1 = every layer).

    Without a device limit (CPU) recomputation only costs time: `auto` is off and `selective` every 2nd layer.
    `every_layer_only` (FSDP): accelerate 1.15's FSDP2 activation checkpointing (`fsdp2_apply_ac`) wraps every decoder
    layer and has no every-n, so there is nothing between none and all (`selective` is every layer there): a plan
    that said "selective" would recompute every layer, and a step down between two such plans would change nothing.
    """
    largest_n_per_count = {checkpointed_layers(n, layers): n for n in range(2, layers + 1)}
    partial = [] if every_layer_only else [n for _, n in sorted(largest_n_per_count.items())]
    return {
        "off": [0],
        "full": [1],
        "selective": (partial or [1]) if limited or every_layer_only else [min(2, layers)],
        "auto": [0, *partial, 1] if limited else [0],
    }[policy]


def _fixes(config: Any, n_params: int, settings: Settings, precision: Precision, capacity: float, processes: int = 1) -> list[str]:
    """Settings that would make the job fit, each checked against the same estimate."""
    fixes = []
    for length in (settings.max_length // 2, settings.max_length // 4):
        if length >= 256 and plan(config, n_params, dataclasses.replace(settings, max_length=length), precision, capacity, "auto", processes).fits:
            fixes.append(f"FT_MAX_LENGTH={length}")
            break
    sequences = settings.batch_size * settings.gradient_accumulation_steps
    one = dataclasses.replace(settings, batch_layout="as-set", batch_size=1, gradient_accumulation_steps=sequences)
    if plan(config, n_params, one, precision, capacity, "full", processes).fits:
        fixes.append(
            f"FT_BATCH_SIZE=1 FT_GRADIENT_ACCUMULATION_STEPS={one.gradient_accumulation_steps} FT_BATCH_LAYOUT=as-set FT_ACTIVATION_CHECKPOINTING=full"
        )
    for more in (2, 4, 8, 16, 32, 64):
        if more > processes and plan(config, n_params, dataclasses.replace(settings, distributed="fsdp"), precision, capacity, "auto", more).fits:
            fixes.append(f"FT_NUM_PROCESSES={more} (FSDP across {more} GPUs of this size; more than one machine's GPUs with FT_NUM_NODES)")
            break
    if not fixes:
        per_param = precision.training_bytes
        fixes.append(f"a GPU with more memory: weights, gradients and AdamW states alone take {per_param * n_params / GB:.0f} GB ({per_param} B/param)")
    return fixes


def cost_device(capacity: float, cuda: bool) -> step_cost.Device:
    """Whose speeds rank the layouts: this GPU's by its name, else the card planned for (FT_GPU_MEMORY_GB), else the CPU's.
    Without a GPU nothing is offloaded: transformers pins the host copies, which needs an accelerator."""
    if not cuda:
        return dataclasses.replace(step_cost.device_for("", capacity), host_link=0.0)
    import torch

    return step_cost.device_for(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", capacity)  # else by its memory


def for_data(job: Config, chosen: Plan, tokens_per_sequence: float | None) -> Plan:
    """The preflight's plan ranked again once the data is prepared: the fastest layout for its mean sequence
    (`tokens_per_sequence`) that fits, the memory still planned for FT_MAX_LENGTH, the sharing as the preflight chose."""
    from trainer.model import loading as model

    if not tokens_per_sequence or not chosen.fits:
        return chosen
    settings = job.settings
    config = model.read_config(settings)
    n_params = chosen.parameters or model.parameter_count(config, settings.trust_remote_code)  # the preflight's count, not the model built again
    layouts = candidates(config, n_params, settings, job.precision, chosen.capacity,
                         settings.activation_checkpointing, chosen.processes, chosen.strategy, chosen.replicas, chosen.device, tokens_per_sequence)
    faster = next(c for c in layouts if c.fits)
    if (faster.sequences_per_pass, faster.checkpoint_every, faster.offload) != (chosen.sequences_per_pass, chosen.checkpoint_every, chosen.offload):
        print(f"fulltune: memory plan for the prepared data (a sequence is {tokens_per_sequence:.0f} tokens on average, not "
              f"FT_MAX_LENGTH={settings.max_length}): {faster.describe()}", flush=True)
    return faster


def device_capacity(settings: Settings, cuda: bool) -> float:
    if settings.gpu_memory_gb:
        return settings.gpu_memory_gb * GB
    if not cuda:
        return 0.0
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory)


def preflight(job: Config) -> Plan:
    """Check what the model would load (trainer/model/trust.py), plan passes and recomputation from its config, then check GPU
    memory and disk space.

    Raises ConfigError (exit 2) for pickle weights or model code not allowed, and when memory or disk does not fit and
    FT_PREFLIGHT=fail.
    """
    from trainer.model import loading as model
    from trainer.model import trust

    settings, precision, cuda = job.settings, job.precision, job.cuda
    trust.check_model(settings)  # whatever FT_PREFLIGHT says: no pickle weights, no model code, unless allowed
    config = model.read_config(settings)
    n_params = model.parameter_count(config, settings.trust_remote_code)
    capacity = device_capacity(settings, cuda)
    chosen = plan(config, n_params, settings, precision, capacity, settings.activation_checkpointing, job.world_size, cost_device(capacity, cuda))
    print(f"fulltune: memory plan: {chosen.describe()}", flush=True)
    problems = []
    if settings.preflight == "off":
        return chosen
    if not chosen.fits:
        fixes = "; or ".join(_fixes(config, n_params, settings, precision, capacity, job.world_size))
        problems.append(f"the estimated peak GPU memory does not fit: {chosen.describe()}. To fit, set {fixes} (or FT_PREFLIGHT=warn to try anyway).")
    disk = disk_space.check_disk(settings, n_params, precision)
    if disk:
        problems.append(disk)
    if host := check_host_memory(precision, n_params, chosen, cuda, job.processes_per_node):
        problems.append(host)
    if problems and settings.preflight == "fail":
        raise ConfigError("preflight: " + " ".join(problems))
    for problem in problems:
        print(f"fulltune: preflight warning: {problem}", flush=True)
    return chosen
