"""The plan, printed once before training: what a user would otherwise work out by hand.

    model and precision, rows; steps x effective batch (x processes) = sequences, epochs, tokens per step;
    the eval and checkpoint cadence and where checkpoints land; what one checkpoint costs to write and stage.
"""

from __future__ import annotations

from trainer.checkpointing import saving
from trainer.core import ranks
from trainer.core.config import Config
from trainer.core.volume import Volume
from trainer.data.prepare import Prepared
from trainer.model import loading as model
from trainer.model import memory


def print_plan(config: Config, prepared: Prepared, plan: memory.Plan) -> None:
    """What a user would otherwise work out by hand, printed once."""
    settings = config.settings
    per_rank = settings.batch_size * settings.gradient_accumulation_steps
    effective = per_rank * config.world_size
    ranks_line = f" x {config.world_size} processes ({plan.strategy})" if config.world_size > 1 else ""
    by_time = f" or at the first evaluation {settings.save_every_minutes:g} min after the last" if settings.save_every_minutes else ""
    early = f" (stop after {settings.early_stopping_patience} without improvement)" if settings.early_stopping_patience else ""
    n_train, n_eval = len(prepared.train), len(prepared.eval) if prepared.eval is not None else 0
    print(
        "fulltune: plan\n"
        f"  model {settings.model} ({config.precision.name}), data {settings.dataset}: {n_train} train / {n_eval} validation rows\n"
        f"  {settings.max_steps} steps x effective batch {effective} ({settings.batch_size} x {settings.gradient_accumulation_steps} accumulation{ranks_line})"
        f" = {settings.max_steps * effective} sequences, {settings.max_steps * effective / max(n_train, 1):.2f} epochs,"
        f" up to {effective * settings.max_length} tokens per step\n"
        f"  eval every {settings.eval_steps} steps{early}, checkpoint every {settings.save_steps} steps{by_time} (keep {settings.save_total_limit} + best)"
        f" in {Volume(settings.output_dir).checkpoints}\n"
        f"  {_checkpoint_cost(config, plan)}",
        flush=True,
    )


def _checkpoint_cost(config: Config, plan: memory.Plan) -> str:
    """The checkpoint's size and how long the volume takes to write it (measured now: 32 MiB, flushed)."""
    n_params = model.parameter_count(model.read_config(config.settings), config.settings.trust_remote_code)
    size = config.precision.checkpoint_bytes * n_params
    staging = memory.checkpoint_staging_bytes(config.precision, n_params, plan.strategy, config.world_size)
    speed = saving.write_speed(Volume(config.settings.output_dir).state) if ranks.is_main() else None
    write = "write time unknown (the volume's speed could not be measured)"
    if speed:
        write = f"~{size / speed:.1f} s at the volume's measured {speed / 1e9:.2f} GB/s"
    if plan.strategy == "fsdp":
        shard = size / config.world_size / 1e9
        return (f"each checkpoint ~{size / 1e9:.2f} GB (weights + AdamW states), one ~{shard:.2f} GB shard per process written in parallel "
                f"through DCP while training waits, committed in the background: {write}; nothing staged in host memory")
    return f"each checkpoint ~{size / 1e9:.2f} GB (weights + AdamW states), written in the background: {write}; host staging {staging / 1e9:.2f} GB per process"
