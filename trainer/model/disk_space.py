"""Disk space: whether the volume has room for what the job will still write, worked out before any weight is
downloaded.  The preflight (trainer/model/memory.py) exits 2 when it has not: a forecast, unlike a volume that
fills while the job writes (exit 6, trainer/checkpointing/diskfull.py).

The check needs: a checkpoint (fp32 weights + AdamW states = 12 B/param, measured 3.0x the fp32
weights on the demo model; bf16-sr: bf16 weights + fp32 states = 10 B/param, measured) times the
retained ones (`FT_SAVE_TOTAL_LIMIT` + the best + the one being written before the oldest is deleted),
less those already on the volume, plus the final model (bf16 on GPU or with bf16-sr, fp32 on CPU).
"""

from __future__ import annotations

import os

from trainer.core.config import Precision
from trainer.core.settings import Settings
from trainer.core.volume import Volume, free_bytes

GB = 1e9


def check_disk(settings: Settings, n_params: int, precision: Precision) -> str | None:
    """None when the volume has room for the retained checkpoints and the final model, else the problem."""
    free = free_bytes(settings.output_dir)
    checkpoint_dir = Volume(settings.output_dir).checkpoints
    existing = sum(1 for n in os.listdir(checkpoint_dir) if n.startswith("checkpoint-")) if os.path.isdir(checkpoint_dir) else 0
    # by epochs the steps are known once the rows are, and FT_SAVE_STEPS=auto's saves once training runs: count every retained checkpoint
    by_count = not settings.num_epochs and settings.save_steps != "auto"
    steps_saved = settings.max_steps // settings.save_steps if by_count else settings.save_total_limit + 2
    retained = min(settings.save_total_limit + 2, steps_saved)  # + the best + the one written before rotation
    new = max(retained - existing, 0)
    final = precision.serving_bytes * n_params
    checkpoint = precision.checkpoint_bytes * n_params
    need = new * checkpoint + final
    if need <= free:
        return None
    return (
        f"the volume at {os.path.abspath(settings.output_dir)} has {free / GB:.1f} GB free; this job needs ~{need / GB:.1f} GB: {new} more checkpoint(s) of "
        f"{checkpoint / GB:.1f} GB ({'bf16' if precision.weight_bytes == 2 else 'fp32'} weights + AdamW states; "
        f"FT_SAVE_TOTAL_LIMIT={settings.save_total_limit} + the best "
        f"+ the one being written) and the final model ({final / GB:.1f} GB). Lower FT_SAVE_TOTAL_LIMIT, raise FT_SAVE_STEPS, "
        "or mount a larger FT_OUTPUT_DIR volume."
    )
