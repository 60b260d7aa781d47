"""Why a busy 2-core machine slows a training process many times over: CPU threads that wait for each other.

    .venv/bin/python bench/contention.py [--seconds 10]

The tiny CPU model of bench/run.py (bench/synthetic.py, 4 layers, hidden 256), the same 8 sequences
per optimizer step (lengths from synthetic.py, mean 300 tokens), trained by hand, no Trainer:
- *literal*: the seed's layout: 8 passes of 1 sequence, every layer recomputed in the backward pass;
- *fulltune*: the job's CPU layout: 1 padding-free pass of the 8 sequences, no recomputation.

Each runs in its own process, measured in four placements:
- alone: torch's default 2 threads on this 2-core machine, as the benchmark's children;
- beside another job: while a second training process (the fulltune layout, 2 threads) runs, as when
  other engineers' tests or jobs share the machine (a load average of about 4);
- the same with `OMP_WAIT_POLICY=PASSIVE` for both: OpenMP threads sleep at once at a barrier instead
  of spinning first;
- alone, 2 threads pinned to 1 CPU (`taskset -c 0`): the two threads take turns on one core, but
  OpenMP sees one CPU and hardly spins.

Every operator of a pass is split over torch's threads, which then wait for each other.  OpenMP's
threads wait by spinning for a while: when two processes' threads share the cores, a spinning thread
holds a core that a thread with work needs, and each process runs several times slower than its fair
half of the machine; with passive waiting it gets that half.  Measured on 2026-12-01 (bench/RESULTS.md):
each layout ran 3-8x slower beside one other 2-thread job, ~2x with passive waiting.
It prints tokens/s per layout and placement, and first the FLOP/s of the model's own matmul shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PLACEMENTS = [  # label, CPUs (taskset), environment, a competing 2-thread training process alongside
    ("alone", None, {}, False),
    ("beside another job", None, {}, True),
    ("beside another job, passive", None, {"OMP_WAIT_POLICY": "PASSIVE"}, True),
    ("alone, 2 threads on 1 CPU", "0", {"OMP_NUM_THREADS": "2"}, False),
]


def lengths(n: int = 8, mean_tokens: int = 300, max_length: int = 1024, seed: int = 1234) -> list[int]:
    from bench import synthetic

    rng = random.Random(seed)
    return [min(synthetic.length(rng, mean_tokens), max_length) for _ in range(n)]


def measure(layout: str, seconds: float) -> dict:
    """Optimizer steps of one layout for about `seconds` after a warm-up step; real tokens per second."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench import synthetic
    from trainer.model import attention

    torch.manual_seed(0)
    net = Qwen3ForCausalLM(Qwen3Config(vocab_size=synthetic.WORDS + 7, max_position_embeddings=4096, tie_word_embeddings=True, **synthetic.TINY)).train()
    seqs = [torch.randint(10, synthetic.WORDS, (n,)) for n in lengths()]
    optimizer = torch.optim.AdamW(net.parameters(), lr=2e-5)
    if layout == "literal":
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        net.set_attn_implementation(attention.register())
        flat = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        bounds = torch.tensor([0, *torch.cumsum(torch.tensor([len(s) for s in seqs]), 0).tolist()], dtype=torch.int32)

    def step() -> None:
        if layout == "literal":
            for s in seqs:
                (net(input_ids=s[None], labels=s[None], use_cache=False).loss / len(seqs)).backward()
        else:
            net(input_ids=flat, labels=flat, position_ids=positions, use_cache=False, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    ops = count_ops(step)
    steps, started = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - started < seconds:
        step()
        steps += 1
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": steps * sum(len(s) for s in seqs) / elapsed, "steps": steps, "seconds": elapsed, "threads": torch.get_num_threads(), "ops": ops}


def count_ops(step) -> int:
    """The ATen operators one optimizer step runs (forward, recomputation, backward, AdamW)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.n


def model_gemms(seconds: float = 1.0) -> list[tuple[str, float]]:
    """fp32 FLOP/s of the tiny model's own matmul shapes (hidden 256, MLP 768, vocabulary 2,000 as in the issue's
    run) at a literal pass (1 sequence, ~700 tokens) and a fulltune pass (8 sequences, ~5,600 tokens), 2 threads."""
    import torch

    out = []
    for tokens in (700, 5600):
        for k, n in ((256, 768), (768, 256), (256, 2000)):
            a, b = torch.randn(tokens, k), torch.randn(k, n)
            torch.mm(a, b)
            times, until = [], time.perf_counter() + seconds
            while time.perf_counter() < until:
                started = time.perf_counter()
                torch.mm(a, b)
                times.append(time.perf_counter() - started)
            out.append((f"{tokens}x{k} @ {k}x{n}", 2 * tokens * k * n / min(times)))
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("CONTENTION " + json.dumps(measure(args.child, args.seconds)), flush=True)
        return 0
    print(f"contention: 8 sequences per step of {lengths()} tokens; load average {os.getloadavg()[0]:.1f}", flush=True)
    for shape, flops in model_gemms():
        print(f"contention: the model's matmul {shape}: {flops / 1e9:.0f} GFLOP/s (best of 1 s)", flush=True)
    for label, cpus, extra, beside in PLACEMENTS:
        env = {**os.environ, **extra}
        competitor = None
        if beside:  # another training process with torch's default 2 threads, as the other jobs on this machine
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "fulltune", "--seconds", str(10 * args.seconds)]
            competitor = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            time.sleep(5)  # past its imports
        try:
            for layout in ("literal", "fulltune"):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", layout, "--seconds", str(args.seconds)]
                if cpus is not None:
                    cmd = ["taskset", "-c", cpus, *cmd]
                load = os.getloadavg()[0]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
                result = json.loads(next(line for line in out.splitlines() if line.startswith("CONTENTION ")).removeprefix("CONTENTION "))
                print(
                    f"contention: {label:28} {layout:8} {result['tokens_per_s']:7.0f} tokens/s ({result['steps']} steps, {result['threads']} threads, "
                    f"{result['ops']} operators per step, load average {load:.1f}→{os.getloadavg()[0]:.1f})",
                    flush=True,
                )
        finally:
            if competitor is not None:
                competitor.terminate()
                competitor.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
