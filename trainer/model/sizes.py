"""What a job writes for a model of this size: a checkpoint, the final model, the volume they need at once, and
how long one checkpoint takes to write.  Torch-free: `entrypoint.py plan` asks before any GPU or volume exists.

    checkpoint = precision.checkpoint_bytes x parameters   (bf16-mixed: fp32 weights + AdamW's two fp32 states, 12 B)
    volume     = (FT_SAVE_TOTAL_LIMIT + the best + the one being written) checkpoints + the final model + the base model's download

Qwen3-4B (4.02 B parameters, bf16-mixed): a 48.3 GB checkpoint, an 8.0 GB final model, 209 GB of volume (195 GiB)
with the default 2 kept, and 241 s to write one checkpoint at 200 MB/s.  The manifests in k8s/ are sized from these
numbers (tests/test_plan_command.py holds them to it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# A network disk's sustained sequential write, the speed the manifests plan for: EBS gp3 at its 125 MB/s baseline is
# slower, provisioned (up to 1,000 MB/s) or a local NVMe faster; the job measures its own volume at start.
DEFAULT_WRITE_MB_S = 200.0


@dataclasses.dataclass(frozen=True)
class Sizes:
    checkpoint: int  # bytes of one checkpoint: weights + optimizer states
    final_model: int  # the final model in its serving precision
    download: int  # the base model's weights as the hub holds them (bf16), in the Hugging Face cache on the volume
    checkpoints_at_once: int  # kept + the best + the one being written
    write_mb_s: float

    @property
    def volume(self) -> int:
        return self.checkpoints_at_once * self.checkpoint + self.final_model + self.download

    @property
    def write_seconds(self) -> float:
        return self.checkpoint / (self.write_mb_s * 1e6)


def of(n_params: int, precision: Any, save_total_limit: int, write_mb_s: float = DEFAULT_WRITE_MB_S) -> Sizes:
    return Sizes(checkpoint=precision.checkpoint_bytes * n_params, final_model=precision.serving_bytes * n_params, download=2 * n_params,
                 checkpoints_at_once=save_total_limit + 2, write_mb_s=write_mb_s)
