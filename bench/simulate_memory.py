#!/usr/bin/env python3
"""One real optimizer step of a Qwen3-size model on fake tensors: peak memory by component and phase, and FLOPs.

    .venv/bin/python bench/simulate_memory.py --layers 4                       # Qwen3-4B's sizes, 4 layers: seconds
    .venv/bin/python bench/simulate_memory.py                                  # the whole Qwen3-4B: minutes
    .venv/bin/python bench/simulate_memory.py --sequences 8 --length 1024 --recompute 0 --json
    .venv/bin/python bench/simulate_memory.py --config bench/configs/qwen3-8b/config.json --processes 4   # one FSDP rank
    .venv/bin/python bench/simulate_memory.py --table                          # issue 19's cases, full size, vs the plan

The technique is torchtitan's scripts/estimate/estimation.py: build the model under
`torch._subclasses.fake_tensor.FakeTensorMode` (no memory behind any tensor), run the step the job runs, and let
`torch.distributed._tools.mem_tracker.MemTracker` (`FSDPMemTracker` for FSDP) account every storage as parameter,
gradient, optimizer state, activation or temporary, while `torch.utils.flop_counter.FlopCounterMode` counts FLOPs
(its total only: its per-module tracking would keep the recomputed layers alive, `flop_counter`).
What runs is the job's: bf16 autocast over fp32 weights (or bf16 weights with FT_PRECISION=bf16-sr and its AdamW),
fused AdamW, non-reentrant activation checkpointing through transformers' `every_n_layers`, the padding-free
per-sequence attention (trainer/model/attention.py) and TRL's chunked loss (its plain-torch path: the device is
"cpu").  Fake "cuda" tensors cannot record autograd in a CPU build of torch, so the CUDA-only terms (context,
cuBLAS workspace, allocator slack) are not simulated: trainer/model/memory.py models them (docs/memory-plan.md).

The optimizer states exist before the measured step (a first step creates them), as in every step but the first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

DEFAULT_CONFIG = os.path.join(HERE, "qwen3-4b-config.json")


def qwen3_config(path: str, layers: int | None = None) -> Any:
    from transformers import Qwen3Config

    with open(path) as f:
        values = {k: v for k, v in json.load(f).items() if k not in ("architectures", "torch_dtype")}
    if layers:
        values["num_hidden_layers"] = layers
        values["max_window_layers"] = layers
    return Qwen3Config(**values)


class Bounds(list):
    """Sequence boundaries as plain ints: under fake tensors `cu_seq_lens_q.tolist()` has no values to return."""

    def tolist(self) -> list[int]:
        return list(self)


@contextlib.contextmanager
def fake_tensor_workarounds():
    """What the job's code reads from tensor values, which fake tensors do not have:

    - transformers' mask preparation looks for packed sequences in `position_ids` with a data-dependent `.all()`;
      the job's attention ignores the mask it would build (trainer/model/attention.py registers no mask), so the
      check answers "not packed";
    - TRL's chunked loss would use its Triton kernels on a CUDA device; on "cpu" it folds the tiles in torch.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def batch(sequences: int, length: int, vocab: int) -> dict[str, Any]:
    """A padding-free pass as TRL's collator makes it: the sequences in one row, positions restarting at 0."""
    import torch

    total = sequences * length
    ids = torch.randint(0, vocab, (1, total))
    bounds = Bounds(range(0, total + 1, length))
    positions = torch.arange(length).repeat(sequences).unsqueeze(0)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions,
            "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": length, "max_length_k": length}


class PhaseTracker:
    """Wraps a MemTracker: the peak (and its breakdown) of each phase of the step, not only of the whole step."""

    def __init__(self, tracker: Any):
        self.tracker, self.phases, self.where, self.current = tracker, {}, {}, None

    def begin(self, name: str) -> None:
        """End the current phase (if any) and start `name`: the peak restarts from what is allocated now."""
        self.end()
        self.current = name
        self.tracker._peak_mem = {dev: snap["Total"] for dev, snap in self.tracker._curr_mem_snap.items()}
        self.tracker._peak_mem_snap = self.tracker.get_tracker_snapshot("current")
        self.tracker.peak_at = "(start)"

    def end(self) -> None:
        if self.current is None:
            return
        snap = self.tracker.get_tracker_snapshot("peak")
        self.phases[self.current] = {getattr(k, "value", k): int(v) for k, v in next(iter(snap.values())).items()}
        self.where[self.current] = getattr(self.tracker, "peak_at", "")
        self.current = None

    @contextlib.contextmanager
    def phase(self, name: str):
        self.begin(name)
        yield
        self.end()


def quiet_module_peaks(tracker: Any) -> None:
    """Only the global peak is kept: MemTracker's per-module peaks walk every module at every operation, which is
    most of the time on a 36-layer model, and this report does not print them."""

    def update_peak_stats(peak_state: Any) -> None:
        for dev, snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < snap["Total"]:
                tracker._peak_mem[dev] = snap["Total"]
                tracker._peak_mem_snap[dev] = dict(snap)
                tracker.peak_at = sorted(tracker._mod_tracker.parents, key=len)[-1] + (" (backward)" if tracker._mod_tracker.is_bw else "")

    tracker._update_peak_stats = update_peak_stats


def flop_counter() -> Any:
    """`FlopCounterMode` without its per-module attribution, which this report does not print.

    Its `ModuleTracker` keeps a `register_multi_grad_hook` handle on the inputs and outputs of every module call
    until the mode exits; each hook closes over the tensors' autograd nodes and lives in those nodes, a cycle that
    Python's collector cannot see through C++.  A recomputed layer's graph is never run backward (non-reentrant
    checkpointing stops it as soon as the saved tensors are recomputed), so around a backward with recomputation
    those handles kept every recomputed layer's saved tensors alive until the backward ended: +13 GB at 1 x 2048
    for Qwen3-4B, which MemTracker counted correctly and the job, which counts no FLOPs, never holds
    (bench/recompute_retention.py)."""
    from torch.utils.flop_counter import FlopCounterMode

    class GlobalOnly:  # what `FlopCounterMode._count_flops` reads: the modules entered, here always only "Global"
        parents = {"Global"}

        def __enter__(self) -> GlobalOnly:
            return self

        def __exit__(self, *args: Any) -> None:
            return None

    counter = FlopCounterMode(display=False)
    counter.mod_tracker = GlobalOnly()
    return counter


@contextlib.contextmanager
def prepared(config: Any, *, precision: str = "bf16-mixed", recompute: int = 1, processes: int = 1, fake: bool = True):
    """The job's model and optimizer, its states created by a first step, inside fake mode when `fake`: yields
    (model, optimizer, a tracker's constructor, the forward's autocast)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trainer.core.config import PRECISIONS
    from trainer.model import attention

    chosen = PRECISIONS[precision]
    mesh = None
    if processes > 1:  # the mesh is built outside fake mode (FakeStore: no other process exists)
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=processes, store=FakeStore())
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (processes,))
    config._attn_implementation = attention.register()
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), fake_tensor_workarounds():
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(chosen.dtype())  # built in the weights' dtype: `.to()` cannot swap fake parameters
        try:
            net = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        net.train()
        if recompute and mesh is None:
            net.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=recompute)
        add_fused_lm_head(net, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer does
        tracker = shard(net, mesh, recompute) if mesh is not None else lambda module, optimizer: tracked(MemTracker(), module, optimizer)
        optimizer = make_optimizer(net, chosen)
        for p in net.parameters():  # the states exist before the measured step, as in every step but the first
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield net, optimizer, tracker, torch.autocast("cpu", dtype=torch.bfloat16) if chosen.bf16 else contextlib.nullcontext()


def tracked(tracker: Any, module: Any, optimizer: Any) -> Any:
    tracker.track_external(module, optimizer)
    return tracker


def simulate(config: Any, *, precision: str = "bf16-mixed", sequences: int = 1, length: int = 2048, passes: int = 1, recompute: int = 1,
             processes: int = 1, fake: bool = True) -> dict[str, Any]:
    """Peak bytes by phase and component, and FLOPs, of one optimizer step; `recompute` as FT's `every_n_layers`
    (0 none, 1 every layer); `processes` > 1: one rank of FSDP2 over that many (a fake process group).
    `fake=False` runs the same step on real tensors: for small models, to check the fake accounting against it."""
    with prepared(config, precision=precision, recompute=recompute, processes=processes, fake=fake) as (net, optimizer, make_tracker, autocast):
        inputs = [batch(sequences, length, config.vocab_size) for _ in range(passes)]
        tracker = make_tracker(net, optimizer)
        quiet_module_peaks(tracker)
        phases, flops = PhaseTracker(tracker), {}
        began = time.perf_counter()
        with tracker:
            for i, pass_inputs in enumerate(inputs, 1):
                tracker.reset_mod_stats()  # module statistics are per forward; the phases keep what this report needs
                # the loss's backward, then the layers' (from the final norm's): their peaks are different terms
                hook = net.model.norm.register_full_backward_pre_hook(lambda module, grad, i=i: phases.begin(f"backward {i} layers"))
                with phases.phase(f"forward {i}"), flop_counter() as counted, autocast:
                    out = net(**pass_inputs, fused_lm_head=True, use_cache=False)
                flops[f"forward {i}"] = counted.get_total_flops()
                loss = out.loss / passes
                del out
                with phases.phase(f"backward {i} loss"), flop_counter() as counted:
                    loss.backward()
                hook.remove()
                flops[f"backward {i}"] = counted.get_total_flops()
                del loss
            with phases.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    tokens = sequences * length
    return {
        "case": {"layers": config.num_hidden_layers, "precision": precision, "sequences": sequences, "length": length, "passes": passes,
                 "recompute": recompute, "processes": processes},
        "phases": phases.phases,
        "peak_at": phases.where,
        "peak": max(p["Total"] for p in phases.phases.values()),
        "flops_per_token": {"forward": flops["forward 1"] / tokens, "backward": flops["backward 1"] / tokens},
        "seconds": round(time.perf_counter() - began, 1),
    }


def make_optimizer(net: Any, precision: Any) -> Any:
    import torch

    if precision.stochastic_rounding:
        from trainer.model.optim import StochasticRoundingAdamW

        return StochasticRoundingAdamW(net.parameters(), lr=1e-5)
    return torch.optim.AdamW(net.parameters(), lr=1e-5, fused=True)  # the job's adamw_torch_fused


def shard(net: Any, mesh: Any, recompute: int) -> Any:
    """FSDP2 as the job's accelerate config makes it: every decoder layer a unit, resharded after its forward, and
    FSDP's own activation checkpointing; returns the tracker's constructor."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    layers = net.model.layers
    for i, layer in enumerate(layers):
        if recompute and i % recompute == 0:
            layers[i] = checkpoint_wrapper(layer)
        fully_shard(layers[i], mesh=mesh, reshard_after_forward=True)
    fully_shard(net, mesh=mesh, reshard_after_forward=True)

    return lambda module, optimizer: FSDPMemTracker(mod=module, optm=optimizer)


GIB = 2**30


def describe(result: dict[str, Any]) -> str:
    case = result["case"]
    lines = [
        f"{case['layers']} layers, {case['precision']}, {case['sequences']} x {case['length']} tokens x {case['passes']} passes, "
        f"recompute every {case['recompute'] or '-'} layer(s), {case['processes']} process(es): peak {result['peak'] / 1e9:.2f} GB ({result['seconds']} s)"
    ]
    keys = [k for k in next(iter(result["phases"].values())) if k != "Total"]
    lines.append(f"  {'phase':<12}" + "".join(f"{k:>12}" for k in [*keys, "Total"]) + "   (GB)")
    for name, snap in result["phases"].items():
        lines.append(f"  {name:<12}" + "".join(f"{snap.get(k, 0) / 1e9:>12.3f}" for k in [*keys, "Total"]) + f"   at {result['peak_at'][name]}")
    f = result["flops_per_token"]
    lines.append(f"  FLOPs per token (first pass, recomputation included): forward {f['forward'] / 1e9:.2f} G, backward {f['backward'] / 1e9:.2f} G")
    return "\n".join(lines)


QWEN3_8B = os.path.join(HERE, "configs", "qwen3-8b", "config.json")
TABLE = [  # case, config, precision, sequences, length, passes, every n-th layer recomputed, processes
    ("bf16-mixed 1 x 2048, full recomputation", DEFAULT_CONFIG, "bf16-mixed", 1, 2048, 1, 1, 1),
    ("the second accumulation pass (1 x 2048 x 2)", DEFAULT_CONFIG, "bf16-mixed", 1, 2048, 2, 1, 1),
    ("8 packed x 1024, full recomputation", DEFAULT_CONFIG, "bf16-mixed", 8, 1024, 1, 1, 1),
    ("1 x 2048, no recomputation", DEFAULT_CONFIG, "bf16-mixed", 1, 2048, 1, 0, 1),
    ("8 x 1024, no recomputation", DEFAULT_CONFIG, "bf16-mixed", 8, 1024, 1, 0, 1),
    ("selective: every 2nd layer, 1 x 2048", DEFAULT_CONFIG, "bf16-mixed", 1, 2048, 1, 2, 1),
    ("bf16-sr 1 x 2048, full recomputation", DEFAULT_CONFIG, "bf16-sr", 1, 2048, 1, 1, 1),
    ("bf16-sr 8 x 1024, no recomputation", DEFAULT_CONFIG, "bf16-sr", 8, 1024, 1, 0, 1),
    ("Qwen3-8B, one FSDP rank of 4, 1 x 2048, full recomputation", QWEN3_8B, "bf16-mixed", 1, 2048, 1, 1, 4),
]


def table() -> str:
    """Markdown: each case's simulated peak against the plan's (trainer/model/estimate.py, its CUDA-only terms left out)."""
    from trainer.core.config import PRECISIONS
    from trainer.model import estimate

    rows = ["| Case | Simulated peak, GB (MemTracker) | Simulated phase | Planned (no CUDA-only terms) | Error | Planned phase |",
            "|---|---|---|---|---|---|"]
    for name, path, precision, sequences, length, passes, every, processes in TABLE:
        config = qwen3_config(path)
        result = simulate(config, precision=precision, sequences=sequences, length=length, passes=passes, recompute=every, processes=processes)
        each = estimate.phases(
            config, estimate.parameter_count(config), precision=PRECISIONS[precision], sequences_per_pass=sequences, passes_per_step=passes,
            max_length=length, checkpoint_every=every, shards=processes
        )
        planned = {phase: sum(v for k, v in parts.items() if k != "workspace") for phase, parts in each.items()}
        highest = max(planned, key=planned.get)
        rows.append(
            f"| {name} | {result['peak'] / 1e9:.1f} | {max(result['phases'], key=lambda p: result['phases'][p]['Total'])} | "
            f"{planned[highest] / 1e9:.1f} | {planned[highest] / result['peak'] - 1:+.1%} | {highest} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a Qwen3 config.json (default: Qwen3-4B)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers instead of the config's (fast runs)")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "bf16-sr", "fp32"])
    parser.add_argument("--sequences", type=int, default=1, help="sequences per pass (packed, padding-free)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--passes", type=int, default=1, help="forward/backward passes per optimizer step")
    parser.add_argument("--recompute", type=int, default=1, help="every n-th layer recomputes (0: none, 1: all)")
    parser.add_argument("--processes", type=int, default=1, help="FSDP2 over this many processes: one rank's memory")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--table", action="store_true", help="issue 19's cases at full size against the plan, as a markdown table")
    args = parser.parse_args(argv)
    if args.table:
        print(table())
        return 0
    config = qwen3_config(args.config, args.layers)
    result = simulate(config, precision=args.precision, sequences=args.sequences, length=args.length, passes=args.passes,
                      recompute=args.recompute, processes=args.processes)
    print(json.dumps(result) if args.json else describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
