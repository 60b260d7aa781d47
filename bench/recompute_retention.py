#!/usr/bin/env python3
"""Are a recomputed layer's tensors alive until the backward ends?  Live storages counted with and without observers.

    .venv/bin/python bench/recompute_retention.py                 # a small Qwen3 on real tensors, 2, 4 and 8 layers
    .venv/bin/python bench/recompute_retention.py --fake          # Qwen3-4B's sizes on fake tensors, 1 x 2048
    .venv/bin/python bench/recompute_retention.py --rss           # the resident set of a real CPU step vs its live tensors

The step is bench/simulate_memory.py's (the job's model setup, bf16 autocast, non-reentrant recomputation); a
TorchDispatchMode keeps a weak reference to the storage of every tensor an operation returns and sums the live
ones' bytes: after the loss's backward (the final norm's backward), at each decoder layer's backward, at the
embedding's.  Observers: none; torch's MemTracker; torch's FlopCounterMode around the backward, as the simulator
had it.  Only FlopCounterMode changes what is alive: its ModuleTracker's hooks hold each recomputed layer's graph
until it exits (bench/simulate_memory.py `flop_counter`).  docs/memory-plan.md has the answer, bench/RESULTS.md
the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import weakref
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import simulate_memory  # noqa: E402

OBSERVERS = ("none", "memtracker", "flopcounter")


def live_storages() -> Any:
    """A dispatch mode counting the bytes of the storages alive among those it has seen (and those `add`ed)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map_only
    from torch.utils.weak import WeakIdKeyDictionary

    class LiveStorages(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen, self.refs, self.total, self.peak = WeakIdKeyDictionary(), {}, 0, 0

        def add(self, t: torch.Tensor) -> None:
            storage = t.untyped_storage()
            if storage in self.seen:
                return
            nbytes, key = storage.nbytes(), id(storage)
            self.seen[storage] = nbytes
            self.total += nbytes
            self.peak = max(self.peak, self.total)

            def freed(_: Any) -> None:
                self.total -= nbytes
                self.refs.pop(key, None)

            self.refs[key] = weakref.ref(storage, freed)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            tree_map_only(torch.Tensor, self.add, out)
            return out

    return LiveStorages()


def measure(config: Any, *, recompute: int, observer: str = "none", sequences: int = 1, length: int = 2048, fake: bool = True) -> dict[str, Any]:
    """Live bytes of one bf16-mixed pass's backward (GB), at the points the module docstring names."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with simulate_memory.prepared(config, recompute=recompute, fake=fake) as (net, optimizer, make_tracker, autocast):
        live, at = live_storages(), {}
        for tensor in [*net.parameters(), *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]:
            live.add(tensor)

        def mark(name: str) -> None:
            at[name] = live.total / 1e9

        def layers_begin() -> None:
            mark("layers' backward begins")
            at["peak before"] = live.peak
            live.peak = live.total  # the peak of the layers' backward, not of the loss's

        net.model.norm.register_full_backward_pre_hook(lambda module, grad: layers_begin())
        for i, layer in enumerate(net.model.layers):
            layer.register_full_backward_hook(lambda module, grad_in, grad_out, i=i: mark(f"layer {i}"))
        def embedding_backward(module: Any, args: Any, out: Any) -> None:  # returns None: a forward hook's result replaces the output
            out.register_hook(lambda grad: mark("embedding"))

        net.model.embed_tokens.register_forward_hook(embedding_backward)
        tracker = make_tracker(net, optimizer) if observer == "memtracker" else contextlib.nullcontext()
        if observer == "memtracker":
            simulate_memory.quiet_module_peaks(tracker)
        inputs = simulate_memory.batch(sequences, length, config.vocab_size)
        with tracker, live:
            with autocast:
                loss = net(**inputs, fused_lm_head=True, use_cache=False).loss
            with FlopCounterMode(display=False) if observer == "flopcounter" else contextlib.nullcontext():
                loss.backward()
            del loss
        result = {"layers": config.num_hidden_layers, "recompute": recompute, "observer": observer, "layers peak": live.peak / 1e9,
                  "peak": max(live.peak, at.pop("peak before")) / 1e9, "at": at}
        if observer == "memtracker":  # what it counts is what is alive: the same peak
            result["memtracker peak"] = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"] / 1e9
        return result


def small(layers: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)


RSS_CHILD = """
import ctypes, json, os, sys, threading, time, torch
sys.path.insert(0, {here!r})
import recompute_retention as rr
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.set_num_threads(1)
torch.manual_seed(0)
config = Qwen3Config(vocab_size=16000, hidden_size=384, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=6,
                     num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
highest, running = [0], [True]
def sample():
    while running[0]:
        highest[0] = max(highest[0], rss())
        time.sleep(0.0005)
before = rss()
threading.Thread(target=sample, daemon=True).start()
net = Qwen3ForCausalLM(config)
if {every}:
    net.activation_checkpointing_enable({{"use_reentrant": False}}, every_n_layers={every})
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
ids = torch.randint(0, 16000, (4, 512))
net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
optimizer.step(); optimizer.zero_grad()
live = rr.live_storages()
for t in [*net.parameters(), *(v for s in optimizer.state.values() for v in s.values())]:
    live.add(t)
if {trim}:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
start = rss()
with live:
    net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step(); optimizer.zero_grad()
running[0] = False
print(json.dumps({{"rss at start": (start - before) / 1e9, "rss peak": (highest[0] - before) / 1e9, "live peak": live.peak / 1e9}}))
"""
RSS_VARIANTS = {"glibc defaults": {}, "MALLOC_ARENA_MAX=1": {"MALLOC_ARENA_MAX": "1"}, "malloc_trim(0) before the step": "trim",
                "MALLOC_MMAP_THRESHOLD_=131072": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def rss(every: int) -> dict[str, Any]:
    """tests/test_memory.py's MEASURE step (fp32, 8 layers, 4 x 512), its second step: the resident set's peak above
    the process's start against the peak of its live tensors, under glibc's defaults and three changes."""
    results = {}
    for name, change in RSS_VARIANTS.items():
        env = os.environ | (change if isinstance(change, dict) else {})
        code = RSS_CHILD.format(here=HERE, every=every, trim=change == "trim")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=300)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fake", action="store_true", help="Qwen3-4B's sizes on fake tensors (1 x 2048) instead of a small model on real ones")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rss", action="store_true", help="the resident set of tests/test_memory.py's real CPU step against its live tensors")
    args = parser.parse_args(argv)
    if args.rss:
        for every in (0, 1):
            for name, r in rss(every).items():
                print(f"recompute every {every or '-'}: {name:<32} RSS peak {r['rss peak']:.3f} GB (at the step's start {r['rss at start']:.3f}), "
                      f"live tensors' peak {r['live peak']:.3f} GB", flush=True)
        return 0
    for layers in args.layers:
        config = simulate_memory.qwen3_config(simulate_memory.DEFAULT_CONFIG, layers) if args.fake else small(layers)
        sequences, length = (1, 2048) if args.fake else (2, 256)
        for recompute in (0, 1):
            for observer in OBSERVERS:
                r = measure(config, recompute=recompute, observer=observer, sequences=sequences, length=length, fake=args.fake)
                points = ", ".join(f"{k} {v:.3f}" for k, v in r["at"].items() if not k.startswith("layer ") or k in ("layer 0", f"layer {layers - 1}"))
                extra = f" (MemTracker's {r['memtracker peak']:.3f})" if "memtracker peak" in r else ""
                print(f"{layers} layers, recompute {'every layer' if recompute else 'off':<11}, observer {observer:<11}: peak of the pass "
                      f"{r['peak']:.3f} GB{extra}, of the layers' backward {r['layers peak']:.3f}; live at {points}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
