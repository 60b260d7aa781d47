#!/usr/bin/env python3
"""One trivial Triton kernel, launched before anything else of the GPU check: a machine without a C compiler or
Python's headers fails here in seconds ("Failed to find C compiler"), not at the first training step of every variant.

Triton compiles each kernel's launcher with the host's C compiler against Python.h at its first launch (TRL's fused LM
head does so on every CUDA forward).  Prints what it compiled with and how long it took; exit 1 if the kernel cannot
run or computes wrong, 0 without CUDA (nothing to check: `gpu_check.sh --dry-run`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time


def main() -> int:
    started = time.perf_counter()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: triton: no CUDA device here: skipped", flush=True)
        return 0
    import triton
    import triton.language as tl

    @triton.jit
    def add(x, y, out, n, block: tl.constexpr):
        offsets = tl.program_id(0) * block + tl.arange(0, block)
        mask = offsets < n
        tl.store(out + offsets, tl.load(x + offsets, mask=mask) + tl.load(y + offsets, mask=mask), mask=mask)

    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or "none found"
    x, y = torch.arange(1000, device="cuda", dtype=torch.float32), torch.ones(1000, device="cuda")
    out = torch.empty_like(x)
    try:
        add[(triton.cdiv(1000, 256),)](x, y, out, 1000, block=256)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - whatever stops Triton (no compiler, no Python.h, no libcuda.so) is the finding
        print(f"gpu_check: triton {triton.__version__}: the kernel did not run (C compiler: {compiler}): {type(error).__name__}: {error}", flush=True)
        return 1
    if not torch.equal(out, x + 1):
        print("gpu_check: triton: the kernel computed wrong values", flush=True)
        return 1
    print(f"gpu_check: triton {triton.__version__}: a kernel compiled and ran in {time.perf_counter() - started:.1f} s (C compiler: {compiler})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
