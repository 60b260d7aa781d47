#!/usr/bin/env python3
"""Start-up to the first training step of the demo job, per stage, from the job's own log.

    .venv/bin/python bench/startup.py                  # 3 runs of the demo job, each on a fresh volume
    .venv/bin/python bench/startup.py --runs 5 --json startup.json
    .venv/bin/python bench/startup.py --root /tmp/before     # another checkout of the job, interleaved with this one

Each run starts `entrypoint.py` with FT_PRESET=demo on a fresh volume (FT_LOGGING_STEPS=1, so the first
progress line is the first optimizer step) and stamps every line of its output with the time it arrived
(stdout and stderr merged, both unbuffered).  A stage ends at the first line that matches its marker, so
a stage is the time between two lines the job prints anyway; FT_LOG_LEVEL=debug adds the job's own
`fulltune: debug: start-up:` markers between them, which are used where they exist.  Separately, each run
times a fresh interpreter that only imports torch, transformers, trl, datasets, accelerate and mlflow: the
floor that no change to the job can cut.

"Everything else" is the time to "starting from step" (the job is about to call `Trainer.train`) less
that import floor.  The machine's 1-minute load average is printed with each run: on a shared machine
compare runs taken at the same load, and take the median of several.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPORTS = "import torch, transformers, trl, datasets, accelerate, mlflow"
# (stage, the first line that ends it), in the order the job prints them; a marker the log lacks is skipped.
MARKERS = [
    ("entrypoint: interpreter, settings", r"^fulltune: (no batch platform|.*platform)"),
    ("training process: imports", r"start-up: imported"),
    ("demo assets, hub check, memory plan", r"^fulltune: memory plan"),
    ("tokenizer", r"^fulltune: data: checking|^fulltune: data: reusing"),
    ("data: checked and tokenized", r"^fulltune: plan$"),
    ("MLflow run, model and trainer", r"^fulltune: (starting from step|resuming from)"),
    ("first step (sample answers at step 0 included)", r"^fulltune: step=1/"),
]
READY = "MLflow run, model and trainer"
TRACKING = r"start-up: tracking started|Started monitoring system metrics"  # the run is open: on the path to the first step, or beside it


def run_job(root: str, volume: str, debug: bool) -> tuple[list[tuple[float, str]], int]:
    """The demo job's output lines with their arrival time (seconds since it was started)."""
    env = dict(os.environ, FT_PRESET="demo", FT_OUTPUT_DIR=volume, FT_MAX_STEPS="2", FT_LOGGING_STEPS="1", FT_EVAL_STEPS="2", FT_SAVE_STEPS="2",
               PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    if debug:
        env["FT_LOG_LEVEL"] = "debug"
    started = time.perf_counter()
    job = subprocess.Popen([sys.executable, "entrypoint.py"], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[tuple[float, str]] = []
    for line in job.stdout:
        lines.append((time.perf_counter() - started, line.rstrip("\n")))
    return lines, job.wait()


def import_floor() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], check=True, cwd=ROOT)
    return time.perf_counter() - started


def stages(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Each stage's seconds, from the end of the one before it that the log shows; and when the MLflow run was open,
    in seconds after the data was checked (before READY: the first step waited for it)."""
    found, previous, at = {}, 0.0, 0
    plan = next((t for t, line in lines if line == "fulltune: plan"), None)
    tracked = next((t for t, line in lines if re.search(TRACKING, line)), None)
    if plan is not None and tracked is not None:
        found["(MLflow run open, after the data was checked)"] = tracked - plan
    for stage, marker in MARKERS:
        for index in range(at, len(lines)):
            if re.search(marker, lines[index][1]):
                found[stage] = lines[index][0] - previous
                previous, at = lines[index][0], index + 1
                break
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-debug", action="store_true", help="without FT_LOG_LEVEL=debug (only the lines every job prints)")
    p.add_argument("--root", action="append", default=[], help="a checkout to measure instead of this one; repeat to interleave several")
    p.add_argument("--json", default="", help="also write every run's stages here")
    args = p.parse_args()
    roots = args.root or [ROOT]
    runs: dict[str, list[dict]] = {root: [] for root in roots}
    for n in range(1, args.runs + 1):
        for root in roots:  # interleaved: each round runs every checkout once, at about the same load
            load = os.getloadavg()[0]
            floor = import_floor()
            with tempfile.TemporaryDirectory(prefix="startup-") as work:
                lines, code = run_job(root, os.path.join(work, "volume"), debug=not args.no_debug and root == ROOT)
            if code != 0:
                print("\n".join(line for _, line in lines[-30:]), file=sys.stderr)
                raise SystemExit(f"run {n} of {root}: the demo job exited {code}")
            found = stages(lines)
            chain = [stage for stage, _ in MARKERS]
            ready = (sum(seconds for stage, seconds in found.items() if stage in chain and chain.index(stage) <= chain.index(READY))
                     if READY in found else float("nan"))
            runs[root].append({"load_avg": load, "import_floor_s": floor, "stages": found, "ready_s": ready, "everything_else_s": ready - floor})
            print(f"{root} run {n} (load {load:.2f}): to 'starting from step' {ready:.2f} s, "
                  f"import floor {floor:.2f} s, everything else {ready - floor:.2f} s", flush=True)
            for stage, seconds in found.items():
                print(f"  {seconds:6.2f} s  {stage}", flush=True)
    for root, done in runs.items():
        print(f"\n{root}: median over {len(done)} runs (s)")
        for stage in [stage for stage, _ in MARKERS] + ["(MLflow run open, after the data was checked)"]:
            values = [run["stages"][stage] for run in done if stage in run["stages"]]
            if values:
                print(f"  {statistics.median(values):6.2f}  {stage}")
        for key in ("ready_s", "import_floor_s", "everything_else_s"):
            print(f"  {statistics.median(run[key] for run in done):6.2f}  {key}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
