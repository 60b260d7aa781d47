"""Host memory: what the machine's RAM (its cgroup's limit) must hold besides the GPU plan, worked out before any weight
is downloaded: the model while every process loads it, then the checkpoint snapshot or, under FSDP, the final model's
gathered weights (and on CPU the training state itself).  The preflight (trainer/model/memory.py) exits 2 when it does not
fit; the overview prints the staging (trainer/console/overview.py)."""

from __future__ import annotations

import os
from typing import Any

from trainer.core.config import Precision

GB = 1e9


def checkpoint_staging_bytes(precision: Precision, n_params: int, strategy: str, processes: int) -> int:
    """Host memory a process holds for the snapshot of an asynchronous checkpoint (trainer/checkpointing/saving.py):
    its weights and AdamW states, copied into buffers kept from save to save, on the main process (on a GPU and on
    CPU alike).  Under FSDP
    nothing is staged: each process writes its own shard through DCP straight from its memory (a tensor at a time
    from a GPU)."""
    return 0 if strategy == "fsdp" else precision.checkpoint_bytes * n_params


def final_gather_bytes(precision: Precision, n_params: int, strategy: str) -> int:
    """Host memory the main process holds under FSDP when the final model is gathered, once, weights only
    (trainer/publishing/final_model.py); without FSDP the model is saved from where it is."""
    return precision.weight_bytes * n_params if strategy == "fsdp" else 0


def host_memory_bytes() -> int:
    """The memory this container may use: its cgroup's limit when it has one, else the machine's."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="utf-8") as f:
            limit = f.read().strip()
        return min(machine, int(limit)) if limit.isdigit() else machine
    except OSError:
        return machine


def check_host_memory(precision: Precision, n_params: int, chosen: Any, cuda: bool, processes_per_node: int = 1) -> str | None:
    """None when the host holds the model while it loads, and later the checkpoint snapshot, or under FSDP the final
    model's gathered weights (and, on CPU, the training state itself), else the problem.

    Loading is a peak of its own: every process on this node reads the whole model into host memory in its weights'
    dtype before DDP moves it to its GPU or FSDP shards it (transformers 5.24 loads it whole on every rank, also with
    accelerate's `cpu_ram_efficient_loading`: docs/gpus.md#what-holds-with-several-processes), 8 x 16 GB for Qwen3-4B on an 8-GPU node."""
    host, problems = host_memory_bytes(), []
    loading = processes_per_node * precision.weight_bytes * n_params
    if loading > host:
        each = f"each of the {processes_per_node} processes on this node" if processes_per_node > 1 else "the process"
        fewer = ", or run fewer processes per node on more nodes (FT_NUM_PROCESSES, FT_NUM_NODES)" if processes_per_node > 1 else ""
        problems.append(f"the host has {host / GB:.1f} GB of memory; while the model loads, {each} holds the whole model "
                        f"({precision.weight_bytes * n_params / GB:.1f} GB in {precision.weight_dtype}): {loading / GB:.1f} GB. "
                        f"Give the container more memory{fewer}.")
    staging = checkpoint_staging_bytes(precision, n_params, chosen.strategy, chosen.processes)
    staging = max(staging, final_gather_bytes(precision, n_params, chosen.strategy))  # one or the other, never both
    training = 0 if cuda else precision.training_bytes * n_params // chosen.shards
    training += processes_per_node * getattr(chosen, "offloaded", 0.0)  # the recomputed layers' inputs, offloaded (pinned)
    if staging + training > host:
        on_cpu = f" and {training / GB:.1f} GB of training state ({'CPU' if not cuda else 'activations offloaded to host memory'})" if training else ""
        if chosen.strategy == "fsdp":
            snapshot, fix = "the final model's weights, gathered on it once at the end", "Give the container more memory."
        else:
            snapshot, fix = "the checkpoint snapshot", "Give the container more memory, or shard the state over more processes (FT_DISTRIBUTED=fsdp)."
        problems.append(f"the host has {host / GB:.1f} GB of memory; the main process needs {staging / GB:.1f} GB for {snapshot}{on_cpu}. {fix}")
    return " ".join(problems) or None
