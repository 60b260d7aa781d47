"""Under FSDP, once the model is wrapped: one log line that says what each process holds of it."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from trainer.core import ranks


def held_elements(net: Any) -> tuple[int, int]:
    """(parameter elements this process holds, elements of the whole model): FSDP2 parameters are DTensors whose
    local part is this process's shard."""
    held = whole = 0
    for p in net.parameters():
        whole += p.numel()
        held += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return held, whole


class ReportShards(TrainerCallback):
    """Once the model is wrapped (training begins), print what each process holds of it:

    fulltune: fsdp: the model's 445,568 parameter elements, held as 222,848 + 222,720 by 2 processes (largest share 0.500)
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or ranks.world_size() == 1:
            return
        held, whole = held_elements(model)
        counts = ranks.gather(held)
        if ranks.is_main():
            shares = " + ".join(f"{n:,}" for n in counts)
            largest = max(counts) / whole
            held = f"held as {shares} by {len(counts)} processes (largest share {largest:.3f})"
            print(f"fulltune: fsdp: the model's {whole:,} parameter elements, {held}", flush=True)
