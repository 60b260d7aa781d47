#!/usr/bin/env python3
"""What the evaluation stage costs: seconds per benchmark sample and per own-task row, and what it adds to a job.

    .venv/bin/python bench/eval_cost.py                 # 2 pairs of demo jobs (40 steps of 8 sequences), with and without the stage
    .venv/bin/python bench/eval_cost.py --pairs 3 --steps 240

Each pair runs the same short demo job twice on fresh volumes, A (the demo preset's stage: its lm-eval task of
48 three-way questions and 24 validation rows, base and fine-tuned) then B (FT_EVAL_TASKS= FT_EVAL_ROWS=0),
alternating A B A B so that a slow minute of a shared machine lands on both.  The stage's cost is paid as wall
time of the whole job (its imports, loading each model, lm-eval's task building), so that is what is compared;
the per-unit seconds come from the stage's own record (FT_OUTPUT_DIR/evaluation/*.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job(out: str, steps: int, evaluate: bool) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "MLFLOW_"))}
    env |= {"FT_PRESET": "demo", "FT_OUTPUT_DIR": out, "FT_MAX_STEPS": str(steps), "FT_BATCH_SIZE": "4", "FT_GRADIENT_ACCUMULATION_STEPS": "2",
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    if not evaluate:
        env |= {"FT_EVAL_TASKS": "", "FT_EVAL_ROWS": "0"}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, os.path.join(ROOT, "entrypoint.py")], env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"the job exited {result.returncode}:\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def units(out: str) -> dict[str, float]:
    """Seconds per benchmark sample (a three-way question: 3 log-likelihood requests) and per own-task row, base and tuned together."""
    folder = os.path.join(out, "evaluation")
    per_sample, per_row = [], []
    for name in os.listdir(folder):
        if name in ("rows.json", "summary.json"):
            continue
        with open(os.path.join(folder, name)) as f:
            unit = json.load(f)
        if "lm_eval" in unit:
            samples = sum(n["effective"] for n in unit["lm_eval"]["n-samples"].values())
            per_sample.append(unit["seconds"] / samples)
        else:
            per_row.append(unit["seconds"] / len(unit["rows"]))
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    return {"benchmark_s_per_sample": statistics.mean(per_sample), "own_task_s_per_row": statistics.mean(per_row), "stage_s": summary["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with_stage, without, records = [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            a = os.path.join(scratch, f"a{pair}")
            with_stage.append(job(a, args.steps, True))
            records.append(units(a))
            without.append(job(os.path.join(scratch, f"b{pair}"), args.steps, False))
            print(f"pair {pair + 1}: with the stage {with_stage[-1]:.1f} s, without {without[-1]:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"job wall time: {statistics.median(with_stage):.1f} s with the stage, {statistics.median(without):.1f} s without "
          f"(median of {args.pairs}); the stage adds {statistics.median(with_stage) - statistics.median(without):.1f} s")
    print(f"inside the stage: {statistics.median(r['stage_s'] for r in records):.2f} s from its start to its summary; "
          f"{statistics.median(r['benchmark_s_per_sample'] for r in records):.4f} s per benchmark sample (3 choices), "
          f"{statistics.median(r['own_task_s_per_row'] for r in records):.4f} s per own-task row (greedy, at most 16 tokens), per model")


if __name__ == "__main__":
    main()
