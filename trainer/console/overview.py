"""The plan, printed once before training: what a user would otherwise work out by hand.

    model and precision, rows; the steps (from FT_MAX_STEPS or FT_NUM_EPOCHS) x the effective batch = sequences,
    epochs, tokens per step; each step as the memory plan trains it (sequences x passes, the same words as the memory
    plan's line); the warm-up; the eval and checkpoint cadence and where checkpoints land; what one checkpoint costs.
"""

from __future__ import annotations

from trainer.checkpointing import saving
from trainer.core import ranks
from trainer.core.config import Config
from trainer.core.schedule import Schedule
from trainer.core.volume import Volume
from trainer.data.prepare import Prepared
from trainer.model import memory


def print_plan(config: Config, prepared: Prepared, plan: memory.Plan, steps: Schedule) -> float | None:
    """What a user would otherwise work out by hand, printed once; return one checkpoint's write time on this volume, in
    seconds, as measured now (None: not measured, or not this process's to write)."""
    settings = config.settings
    per_rank = settings.batch_size * settings.gradient_accumulation_steps
    effective = per_rank * config.world_size
    processes = f" ({per_rank} per process x {config.world_size} processes, {plan.strategy})" if config.world_size > 1 else ""
    per_process = ", in each process" if config.world_size > 1 else ""
    regrouped = "regrouped to fit the device (FT_BATCH_LAYOUT=auto)" if settings.batch_layout == "auto" else "as set (FT_BATCH_LAYOUT=as-set)"
    warmup = f"FT_WARMUP_RATIO={settings.warmup_ratio:g}" if settings.warmup_ratio else "FT_WARMUP_STEPS"
    by_time = f" or at the first evaluation {settings.save_every_minutes:g} min after the last" if settings.save_every_minutes else ""
    if settings.save_every_minutes and settings.save_steps == "auto":
        by_time = f", and at least every {settings.save_every_minutes:g} min (FT_SAVE_EVERY_MINUTES) once the last write has ended"
    early = f" (stop after {settings.early_stopping_patience} without improvement)" if settings.early_stopping_patience else ""
    n_train, n_eval = len(prepared.train), len(prepared.eval) if prepared.eval is not None else 0
    cost, write_seconds = _checkpoint_cost(config, plan)
    print(
        "fulltune: plan\n"
        f"  model {settings.model} ({config.precision.name}), data {settings.dataset}: {n_train} train / {n_eval} validation rows\n"
        f"  {steps.describe(settings)} x effective batch {effective}{processes} = {steps.steps * effective} sequences,"
        f" up to {effective * settings.max_length} tokens per step\n"
        f"  each step{per_process}: {plan.sequences_per_pass} sequences x {plan.passes_per_step} passes (FT_BATCH_SIZE={settings.batch_size} x "
        f"FT_GRADIENT_ACCUMULATION_STEPS={settings.gradient_accumulation_steps}, {regrouped}); warm-up {steps.warmup_steps} steps ({warmup}),"
        f" then {settings.lr_scheduler}\n"
        f"  eval every {settings.eval_steps} steps{early}, {_cadence(settings)}{by_time} (keep {settings.save_total_limit} + best)"
        f" in {Volume(settings.output_dir).checkpoints}\n"
        f"  {cost}",
        flush=True,
    )
    return write_seconds


def _cadence(settings) -> str:
    if settings.save_steps != "auto":
        return f"checkpoint every {settings.save_steps} steps"
    return ("checkpoint at evaluation steps as the measured costs allow (FT_SAVE_STEPS=auto: saves block at most 5 % of the wall time "
            "and never wait for the one before; until the first is measured, the write time below decides)")


def _checkpoint_cost(config: Config, plan: memory.Plan) -> tuple[str, float | None]:
    """The checkpoint's size and how long the volume takes to write it (measured now: 32 MiB, flushed), in words and in seconds."""
    n_params = plan.parameters  # counted once, by the preflight
    size = config.precision.checkpoint_bytes * n_params
    staging = memory.checkpoint_staging_bytes(config.precision, n_params, plan.strategy, config.world_size)
    speed = saving.write_speed(Volume(config.settings.output_dir).state) if ranks.is_main() else None
    write = "write time unknown (the volume's speed could not be measured)"
    if speed:
        write = f"~{size / speed:.1f} s at the volume's measured {speed / 1e9:.2f} GB/s"
    seconds = size / speed if speed else None
    if plan.strategy == "fsdp":
        shard = size / config.world_size / 1e9
        return (f"each checkpoint ~{size / 1e9:.2f} GB (weights + AdamW states), one ~{shard:.2f} GB shard per process written in parallel "
                f"through DCP while training waits, committed in the background: {write}; nothing staged in host memory"), None
    return (f"each checkpoint ~{size / 1e9:.2f} GB (weights + AdamW states), written in the background: {write}; host staging "
            f"{staging / 1e9:.2f} GB per process"), seconds
