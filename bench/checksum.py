#!/usr/bin/env python3
"""What the checkpoint checksums cost: GB/s of xxh3 over a file in the page cache, and seconds for Qwen3-4B.

    .venv/bin/python bench/checksum.py [--gb 1] [--dir /tmp]

The commit checksums each file right after writing it (still in the page cache), so this is its cost; a
resume reads the newest checkpoint back, from the disk when the page cache no longer holds it (a new pod,
another node), and is then bound by the disk's read speed instead (bench/checkpoint_save.py measures its
write speed).  Qwen3-4B's checkpoint bytes come from the job's own numbers: parameters from its config
(bench/qwen3-4b-config.json) times the precision's checkpoint bytes per parameter (trainer/core/config.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def gb_per_second(path: str, algorithm: str, rounds: int = 3) -> float:
    """Best of `rounds` passes of the commit's own read-and-hash loop over `path`."""
    import xxhash

    from trainer.checkpointing import manifest

    size = os.path.getsize(path)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        digest = getattr(xxhash, algorithm)()
        with open(path, "rb") as f:
            while chunk := f.read(manifest.CHUNK):
                digest.update(chunk)
        best = min(best, time.perf_counter() - start)
    return size / best / 1e9


def qwen3_4b_checkpoint_bytes() -> dict[str, int]:
    from transformers import Qwen3Config

    from trainer.core.config import PRECISIONS
    from trainer.model import loading as model

    fields = json.load(open(os.path.join(HERE, "qwen3-4b-config.json")))
    n_params = model.parameter_count(Qwen3Config(**{k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype")}))
    return {name: precision.checkpoint_bytes * n_params for name, precision in PRECISIONS.items() if name != "fp32"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0, help="size of the file hashed")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the file is written (then read from the page cache)")
    args = parser.parse_args()

    from trainer.checkpointing import manifest

    size = int(args.gb * 1e9)
    with tempfile.NamedTemporaryFile(dir=args.dir, prefix="fulltune-checksum-bench-") as f:
        block = os.urandom(64 << 20)
        for offset in range(0, size, len(block)):
            f.write(block[: size - offset])
        f.flush()
        gb_per_second(f.name, manifest.CHECKSUM, rounds=1)  # the first pass brings the whole file into the page cache
        speeds = {algorithm: gb_per_second(f.name, algorithm) for algorithm in ("xxh3_64", "xxh3_128")}
    for algorithm, speed in speeds.items():
        print(f"{algorithm}: {speed:.1f} GB/s from the page cache ({1 / speed:.2f} s per GB, one core, {size / 1e9:.1f} GB file)")
    speed = speeds[manifest.CHECKSUM]
    for precision, total in qwen3_4b_checkpoint_bytes().items():
        print(f"qwen3_4b {precision} checkpoint: {total / 1e9:.1f} GB -> {total / 1e9 / speed:.1f} s of {manifest.CHECKSUM} at commit (page cache)")


if __name__ == "__main__":
    main()
