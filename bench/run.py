#!/usr/bin/env python3
"""Side by side: the seed notebook's SFTTrainer call (literal) against this project's job (fulltune).

    .venv/bin/python bench/run.py                      # CPU: tiny Qwen3, ~2 minutes
    .venv/bin/python bench/run.py --gpu --dry-run      # no training: Qwen3-4B memory plan on the meta device
    bash bench/gpu_check.sh                            # GPU: random-init Qwen3-4B, ~8 minutes on an H100/H200

Both variants train the same model (same initial weights), on the same synthetic conversations, the
same 90/10 split, the same number of optimizer steps and the same evaluation cadence, each in a fresh
process so imports and peak memory are counted.  No checkpoint is written (the seed saves every 25
steps, after the last one) and the final model is not saved.  Both log the loss at every step so
the per-step losses can be compared (loss parity).  After training, each evaluates its final model
with the same procedure (token-weighted NLL over the validation rows), since the trainers' own eval
loss averages per batch and so depends on the evaluation batch size.

`--set FT_NAME=value` changes a setting of the fulltune variant; `--variant` adds more of them, e.g.
`--variant padded:FT_PADDING_FREE=off`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import synthetic  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="random-init Qwen3-4B from bench/qwen3-4b-config.json, bf16")
    p.add_argument("--dry-run", action="store_true", help="print the data statistics and memory plans; train nothing")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=2000, help="conversations; 10%% are held out for validation")
    p.add_argument("--mean-tokens", type=int, default=None, help="mean conversation length (default 1100 on GPU, 300 on CPU)")
    p.add_argument("--max-length", type=int, default=None, help="truncation for both variants (default 2048 on GPU, 1024 on CPU)")
    p.add_argument("--literal-fp32", action="store_true", help="the literal variant in fp32 (always on CPU, where bf16 is 7-25x slower)")
    p.add_argument("--no-mlflow", action="store_true", help="neither variant reports to MLflow (for machines without it)")
    p.add_argument("--set", action="append", default=[], metavar="FT_NAME=value", help="a setting for the fulltune variant")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:FT_A=1,FT_B=2", help="another fulltune variant")
    p.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="append the results table here ('' = do not write)")
    p.add_argument("--work", default="", help="folder for the model, data and outputs (default: a temporary one)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mean_tokens = args.mean_tokens or (1100 if args.gpu else 300)
    args.max_length = args.max_length or (2048 if args.gpu else 1024)
    return args


def variants(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    found = {"literal": {}, "fulltune": dict(s.split("=", 1) for s in args.set)}
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        found[name] = {**found["fulltune"], **dict(p.split("=", 1) for p in pairs.split(",") if p)}
    if args.only:
        found = {k: v for k, v in found.items() if k in args.only.split(",")}
    return found


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.child:
        import child

        result = child.run(args)
        print("BENCH-RESULT " + json.dumps(result), flush=True)
        return 0
    work = args.work or tempfile.mkdtemp(prefix="fulltune-bench-")
    stats = synthetic.build(work, rows=args.rows, mean_tokens=args.mean_tokens, gpu=args.gpu, config_path=os.path.join(HERE, "qwen3-4b-config.json"))
    print(f"bench: data {stats}", flush=True)
    if args.dry_run:
        import child

        child.dry_run(args, work)
        return 0
    results, running, stopped = {}, [], []

    def stop(signum, frame):  # `timeout` in gpu_check.sh: stop the variant in progress, keep the finished ones
        stopped.append(signum)
        for proc in running:
            proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    for name, overrides in variants(args).items():
        if stopped:
            break
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", name, "--work", work, "--overrides", json.dumps(overrides), "--t0", str(time.time())]
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
        running[:] = [proc]
        stdout, stderr = proc.communicate()
        wall = time.perf_counter() - started
        lines = [line for line in stdout.splitlines() if line.startswith("BENCH-RESULT ")]
        log = os.path.join(work, f"{name}.log")
        with open(log, "w") as f:
            f.write(stdout + stderr)
        if proc.returncode or not lines:
            why = "stopped: out of time" if stopped else f"failed (exit {proc.returncode})"
            print(f"bench: {name} {why}; log: {log}\n{(stdout + stderr)[-3000:]}", flush=True)
            results[name] = {"failed": proc.returncode, "stopped": bool(stopped)}
            continue
        results[name] = json.loads(lines[-1].removeprefix("BENCH-RESULT ")) | {"wall_s": wall, "overrides": overrides}
        print(f"bench: {name}: {json.dumps(results[name])}", flush=True)
    report = table(args, argv, stats, results)
    print(report, flush=True)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write("\n" + report)
    return 0 if all("failed" not in r for r in results.values()) else 1


def table(args: argparse.Namespace, argv: list[str], stats: dict, results: dict) -> str:
    import torch
    import transformers
    import trl

    device = torch.cuda.get_device_name(0) if args.gpu and torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    rows = [
        ("end-to-end wall (s)", "wall_s", "{:.1f}"),
        ("training tokens/s (real tokens)", "tokens_per_s", "{:.0f}"),
        ("time to first step (s)", "first_step_s", "{:.1f}"),
        ("time in optimizer steps (s)", "train_s", "{:.1f}"),
        ("time in evaluations (s)", "eval_s", "{:.1f}"),
        ("peak memory (GB)", "peak_gb", "{:.2f}"),
        ("MFU", "mfu", "{:.3f}"),
        ("final eval loss (same procedure)", "eval_loss", "{:.4f}"),
        ("trainer's last eval_loss", "trainer_eval_loss", "{:.4f}"),
        ("layout (seqs x passes), checkpointing, padding-free", "layout", "{}"),
    ]
    names = list(results)
    ok = [n for n in names if "failed" not in results[n]]
    out = [
        f"### {time.strftime('%Y-%m-%d %H:%M')} — {device}",
        "",
        f"`{' '.join(['python', 'bench/run.py', *argv])}`  ",
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, python {platform.python_version()}  ",
        f"{args.steps} steps, eval every {args.eval_steps}, max length {args.max_length}, data: {stats}",
        "",
        "| | " + " | ".join(names) + (" | fulltune / literal |" if "literal" in ok and "fulltune" in ok else " |"),
        "|---" * (len(names) + 1 + ("literal" in ok and "fulltune" in ok)) + "|",
    ]
    for label, key, fmt in rows:
        cells = []
        for n in names:
            v = results[n].get(key)
            if "failed" in results[n]:
                cells.append("stopped (time)" if results[n]["stopped"] else "failed")
            else:
                cells.append("-" if v is None else fmt.format(v))
        ratio = ""
        if "literal" in ok and "fulltune" in ok:
            a, b = results["literal"].get(key), results["fulltune"].get(key)
            ratio = f" {b / a:.2f} |" if isinstance(a, float | int) and isinstance(b, float | int) and a else " |"
        out.append(f"| {label} | " + " | ".join(cells) + (" |" + ratio if ratio else " |"))
    if "literal" in ok:
        base = results["literal"]["losses"]
        for n in ok:
            if n != "literal" and results[n]["losses"]:
                worst = max(abs(b - a) / abs(a) for a, b in zip(base, results[n]["losses"], strict=False))
                out.append(f"\nper-step training loss, {n} vs literal over {min(len(base), len(results[n]['losses']))} steps: max relative difference {worst:.2%}")
    for n in ok:
        if results[n].get("overrides"):
            out.append(f"\n{n}: {' '.join(f'{k}={v}' for k, v in results[n]['overrides'].items())}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
