"""The layout a checkpoint was saved in, and whether this job's way of sharing the model can resume it.

Under FSDP each rank writes its shard of the weights and AdamW states, keyed by parameter name, into torch DCP
folders (`pytorch_model_fsdp_0/`, `optimizer_0/`), which any number of FSDP processes load back (DCP reshards at
load time); one process or DDP write one safetensors file and torch's own `optimizer.pt`, keyed by position.
transformers 5.24 resumes each only the way it was written (a ValueError or a missing file after the model has
loaded).  No torch here: entrypoint.py asks before any training process starts whenever the settings alone fix
the sharing; under FT_DISTRIBUTED=auto the memory plan picks it, and the training process asks (trainer/job.py).
"""

from __future__ import annotations

import os

from trainer.checkpointing.manifest import last_committed
from trainer.core.config import Config, strategies
from trainer.core.errors import ConfigError
from trainer.core.volume import Volume

FSDP_MODEL = "pytorch_model_fsdp_0"  # accelerate's DCP folder of an FSDP checkpoint's weights (SHARDED_STATE_DICT)
FSDP_WHOLE = "pytorch_model_fsdp.bin"  # what FULL_STATE_DICT wrote, gathered on rank 0, before checkpoints were sharded


def check_readable(job: Config) -> None:
    """Exit 2 for a checkpoint on the volume this job would have to refuse once it has started, when its settings
    alone say how the processes share the model (one process, or FT_DISTRIBUTED other than auto)."""
    volume, ways = Volume(job.settings.output_dir), strategies(job.settings.distributed, job.world_size)
    if len(ways) == 1 and not volume.status().final_model:  # a finished job resumes nothing
        check_resumable(last_committed(volume.checkpoints), ways[0])


def check_resumable(checkpoint: str | None, strategy: str) -> None:
    """Refuse (exit 2), before any weights load, to resume a checkpoint in a layout a job sharing the model by
    `strategy` (none, ddp, fsdp) cannot read; an FSDP checkpoint from before checkpoints were sharded
    (`pytorch_model_fsdp.bin`) is refused too."""
    if checkpoint is None:
        return
    if os.path.exists(os.path.join(checkpoint, FSDP_WHOLE)):
        raise ConfigError(
            f"the checkpoint to resume, {checkpoint}, holds FSDP's whole gathered state ({FSDP_WHOLE}), a layout this version "
            "no longer reads: FSDP checkpoints are sharded by torch DCP now. Resume it with the version that wrote it, or use a new FT_OUTPUT_DIR."
        )
    by_fsdp = os.path.isdir(os.path.join(checkpoint, FSDP_MODEL))
    if by_fsdp == (strategy == "fsdp"):
        return
    written, now = ("FSDP", strategy if strategy != "none" else "one process") if by_fsdp else ("one process or DDP", "fsdp")
    way = "FT_DISTRIBUTED=fsdp with 2 or more processes" if by_fsdp else "FT_DISTRIBUTED=ddp (or one process)"
    raise ConfigError(
        f"the checkpoint to resume, {checkpoint}, was written by {written} and this job runs {now}: its weights and optimizer "
        f"states are stored in that layout only. Resume with {way}, or use a new FT_OUTPUT_DIR."
    )
