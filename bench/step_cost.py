#!/usr/bin/env python3
"""Measured step times of memory-plan layouts against the plan's cost model (trainer/model/step_cost.py).

    .venv/bin/python bench/step_cost.py                         # CPU: a tiny Qwen3, 4 layouts interleaved, ~20 s
    bash bench/gpu_check.sh --step-cost                         # GPU: Qwen3-4B's sizes with 6 of its 36 layers, ~2 min
    python bench/step_cost.py --layouts 8x1:0,1x8:1:offload     # sequences x passes : checkpoint_every [: offload]

Each layout is one optimizer step of 8 sequences as the job trains it: padding-free passes through the job's
attention (trainer/model/attention.py), transformers' recomputation (`every_n_layers`, `offload`), the loss scaled
by the pass's share of the step's tokens, AdamW (fused on a GPU), bf16 autocast on a GPU.  Random-init model,
random token ids of the given mean length (half to one and a half times it).  On CPU every layout has its own copy
of the model and the steps are interleaved (round r runs every layout once, starting at a different one), so load
from other processes falls on all of them alike; on a GPU one layout at a time (one model fits) with a
synchronisation at each step's end.  The first `--warmup` steps of each are left out; the median of the rest is
reported next to the cost model's estimate for the same device (`--device`, default cpu or h100), and both as
ratios to the fastest layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A tiny Qwen3 whose passes are cheap next to their fixed cost at 1 sequence a pass (tests/test_step_cost.py)
TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "tie_word_embeddings": True}
CPU_LAYOUTS = "8x1:0,2x4:0,1x8:0,1x8:1"
GPU_LAYOUTS = "8x1:0,8x1:1,1x8:0,8x1:1:offload"


def parse_layout(text: str) -> dict[str, Any]:
    split, every, *rest = text.split(":")
    per_pass, passes = (int(v) for v in split.split("x"))
    return {"sequences_per_pass": per_pass, "passes_per_step": passes, "checkpoint_every": int(every), "offload": rest == ["offload"]}


def label(layout: dict[str, Any]) -> str:
    return (f"{layout['sequences_per_pass']}x{layout['passes_per_step']}:{layout['checkpoint_every']}"
            + (":offload" if layout["offload"] else ""))


def build(config_values: dict[str, Any], layout: dict[str, Any], cuda: bool) -> tuple[Any, Any]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.core import settings as settings_table
    from trainer.model import recipe

    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):  # initialised where it trains: a billion parameters in seconds on a GPU
        net = Qwen3ForCausalLM(Qwen3Config(**config_values))
    settings = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused"})
    net = recipe.prepare_model(net, settings, cuda)
    net.train()
    if layout["checkpoint_every"]:
        net.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=layout["checkpoint_every"], offload=layout["offload"])
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5, fused=cuda, foreach=None if cuda else False)  # the job's: fused, or the loop on CPU
    return net, optimizer


def sequences(count: int, mean: int, vocab: int, seed: int) -> list[Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean // 2, mean + mean // 2 + 1, (count,), generator=generator)
    return [torch.randint(3, vocab, (int(n),), generator=generator) for n in lengths]


def step(net: Any, optimizer: Any, batch: list[Any], layout: dict[str, Any], cuda: bool) -> float:
    """One optimizer step of `batch` in the layout's passes; its wall time (seconds)."""
    import torch

    device = "cuda" if cuda else "cpu"
    total = sum(len(s) for s in batch)
    per_pass = layout["sequences_per_pass"]
    started = time.perf_counter()
    for first in range(0, len(batch), per_pass):
        part = batch[first:first + per_pass]
        ids = torch.cat(part)[None].to(device)
        positions = torch.cat([torch.arange(len(s)) for s in part])[None].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = net(input_ids=ids, position_ids=positions, labels=ids).loss
        (loss * ids.shape[1] / total).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def predicted(config_values: dict[str, Any], layout: dict[str, Any], mean: float, device_name: str, cuda: bool) -> float:
    import types

    from trainer.core.config import PRECISIONS
    from trainer.model import step_cost
    from trainer.model.estimate import parameter_count

    config = types.SimpleNamespace(**config_values)
    precision = PRECISIONS["bf16-mixed" if cuda else "fp32"]
    return step_cost.step_cost(config, parameter_count(config), precision, tokens_per_sequence=mean, device=step_cost.DEVICES[device_name],
                               **layout).seconds


def measure(config_values: dict[str, Any], layouts: list[dict[str, Any]], mean: int, steps: int, warmup: int, cuda: bool,
            device_name: str) -> list[dict[str, Any]]:
    """Each layout's measured median step and estimated step, in seconds."""
    import torch

    batches = [sequences(8, mean, config_values["vocab_size"], seed) for seed in range(warmup + steps)]
    times: dict[str, list[float]] = {label(layout): [] for layout in layouts}
    if cuda:  # one model at a time on the card
        for layout in layouts:
            net, optimizer = build(config_values, layout, cuda)
            times[label(layout)] = [step(net, optimizer, batch, layout, cuda) for batch in batches]
            del net, optimizer
            torch.cuda.empty_cache()
    else:
        built = [build(config_values, layout, cuda) for layout in layouts]
        for index, batch in enumerate(batches):
            for turn in range(len(layouts)):
                which = (index + turn) % len(layouts)
                times[label(layouts[which])].append(step(*built[which], batch, layouts[which], cuda))
    results = []
    for layout in layouts:
        kept = times[label(layout)][warmup:]
        results.append({"layout": label(layout), "measured_s": statistics.median(kept), "spread_s": [min(kept), max(kept)],
                        "estimated_s": predicted(config_values, layout, mean, device_name, cuda)})
    fastest_measured = min(r["measured_s"] for r in results)
    fastest_estimated = min(r["estimated_s"] for r in results)
    for r in results:
        r["measured_relative"], r["estimated_relative"] = r["measured_s"] / fastest_measured, r["estimated_s"] / fastest_estimated
    return results


def gpu_config(layers: int) -> dict[str, Any]:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3-4b-config.json"), encoding="utf-8") as f:
        values = {k: v for k, v in json.load(f).items() if k not in ("architectures", "torch_dtype", "transformers_version")}
    return values | {"num_hidden_layers": layers, "use_cache": False}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="Qwen3-4B's sizes with --layers layers, bf16 autocast, on the GPU")
    p.add_argument("--layers", type=int, default=6, help="decoder layers of the GPU model (36 in Qwen3-4B)")
    p.add_argument("--layouts", help=f"comma-separated SxP:N[:offload] (default {CPU_LAYOUTS} on CPU, {GPU_LAYOUTS} on a GPU)")
    p.add_argument("--mean-tokens", type=int, help="mean tokens of a sequence (default 32 on CPU, 1024 on a GPU)")
    p.add_argument("--steps", type=int, default=7, help="measured steps of each layout")
    p.add_argument("--warmup", type=int, default=2, help="steps of each layout left out first")
    p.add_argument("--device", help="the cost model's constants (trainer/model/step_cost.py DEVICES; default cpu, or h100 with --gpu)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of a table")
    p.add_argument("--out", help="also write the JSON object to this file")
    args = p.parse_args(argv)
    config_values = gpu_config(args.layers) if args.gpu else TINY
    layouts = [parse_layout(t) for t in (args.layouts or (GPU_LAYOUTS if args.gpu else CPU_LAYOUTS)).split(",")]
    mean = args.mean_tokens or (1024 if args.gpu else 32)
    device_name = args.device or ("h100" if args.gpu else "cpu")
    if args.gpu:
        import torch

        device_name = args.device or ("h200" if "H200" in torch.cuda.get_device_name(0) else "h100")
    results = measure(config_values, layouts, mean, args.steps, args.warmup, args.gpu, device_name)
    found = {"device": device_name, "mean_tokens": mean, "layers": config_values["num_hidden_layers"], "results": results}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(found, f, indent=1)
    if args.json:
        print(json.dumps(found))
    else:
        print(f"step_cost: {config_values['num_hidden_layers']} layers, 8 sequences of ~{mean} tokens a step, constants of {device_name}")
        for r in results:
            print(f"  {r['layout']:<16} measured {r['measured_s'] * 1e3:8.1f} ms (x{r['measured_relative']:.2f})   "
                  f"estimated {r['estimated_s'] * 1e3:8.1f} ms (x{r['estimated_relative']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
