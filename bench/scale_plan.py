#!/usr/bin/env python3
"""How many GPUs each Qwen3 size needs for a full fine-tune, from the job's own memory plan (no GPU, no download).

    .venv/bin/python bench/scale_plan.py            # the table in docs/gpus.md#several-gpus-and-nodes

For each model and card it prints the fewest processes (one per GPU) whose per-process plan fits, with the
reference recipe's settings (bf16-mixed, FT_MAX_LENGTH=4096, 1 x 8 sequences per step per process, AdamW):
`ddp` while a whole model fits one card, else FSDP2 across the processes.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trainer.core import config as job_config  # noqa: E402
from trainer.core import settings  # noqa: E402
from trainer.model import loading as model  # noqa: E402
from trainer.model import memory  # noqa: E402

MODELS = {
    "Qwen3-4B": os.path.join(HERE, "qwen3-4b-config.json"),
    "Qwen3-8B": os.path.join(HERE, "configs", "qwen3-8b", "config.json"),
    "Qwen3-14B": os.path.join(HERE, "configs", "qwen3-14b", "config.json"),
    "Qwen3-32B": os.path.join(HERE, "configs", "qwen3-32b", "config.json"),
}
CARDS = {"H100 80 GB": 85.5e9, "H200 141 GB": 150.7e9}  # what each reports to torch (81,559 and 143,771 MiB)
PROCESSES = (1, 2, 4, 8, 16, 32, 64)


def qwen3(path: str):
    from transformers import Qwen3Config

    return Qwen3Config(**{k: v for k, v in json.load(open(path)).items() if k not in ("architectures", "torch_dtype")})


def smallest(config, n_params: int, capacity: float) -> memory.Plan | None:
    recipe = settings.load({"FT_PLATFORM": "none", "FT_MAX_LENGTH": "4096"})
    precision = job_config.PRECISIONS["bf16-mixed"]
    for processes in PROCESSES:
        chosen = memory.plan(config, n_params, recipe, precision, capacity, "auto", processes)
        if chosen.fits:
            return chosen
    return None


def main() -> None:
    print("| Model | Parameters | " + " | ".join(CARDS) + " |")
    print("|---|---|" + "---|" * len(CARDS))
    for name, path in MODELS.items():
        config = qwen3(path)
        n_params = model.parameter_count(config)
        cells = []
        for capacity in CARDS.values():
            chosen = smallest(config, n_params, capacity)
            if chosen:
                cells.append(f"{chosen.processes} ({chosen.strategy if chosen.processes > 1 else 'one GPU'}), {chosen.peak / 1e9:.0f} GB each")
            else:
                cells.append(f"more than {PROCESSES[-1]}")
        print(f"| {name} | {n_params / 1e9:.1f} B | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
