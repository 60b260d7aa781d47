"""What one short demo job costs from start to exit: wall and CPU seconds of `entrypoint.py`, its children included.

    python bench/demo_job_cost.py --rounds 3 [--also before=/tmp/checkout]

The tests' 40-step demo job (tests/conftest.py QUICK_DEMO: 40 steps of 8 sequences, evaluation, registration into
the volume's own MLflow store), run to exit 0 on a fresh volume, once per round from this checkout and from each
`--also` checkout (`git archive <commit> | tar -x -C <dir>`), interleaved A B A B so that the machine's load falls on
each alike.  Most of such a job is what every process pays whatever it trains (imports, the collector, the
interpreter's exit), which is what this measures: hundreds of them run in the tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--also", action="append", default=[], metavar="NAME=CHECKOUT")
    args = parser.parse_args()
    from conftest import QUICK_DEMO, job_env

    arms = dict(pair.split("=", 1) for pair in args.also) | {"this checkout": ROOT}
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    scratch = tempfile.mkdtemp(prefix="fulltune-demo-cost-")
    for round_ in range(args.rounds):
        for name, root in arms.items():
            out = os.path.join(scratch, "out")
            shutil.rmtree(out, ignore_errors=True)
            before, began = os.times(), time.perf_counter()
            done = subprocess.run([sys.executable, os.path.join(root, "entrypoint.py")], env=job_env(out, **QUICK_DEMO), cwd=root,
                                  capture_output=True, text=True, timeout=900)
            wall, after = time.perf_counter() - began, os.times()
            if done.returncode != 0:
                raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
            cpu = after.children_user + after.children_system - before.children_user - before.children_system
            seconds[name].append((wall, cpu))
            print(f"round {round_ + 1} {name}: {wall:.1f} s wall, {cpu:.1f} CPU-s (load {os.getloadavg()[0]:.1f})", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    print("| checkout | wall (s), each round | median | CPU-s, each round | median |")
    print("|---|---|---|---|---|")
    for name, runs in seconds.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"| {name} | {' · '.join(f'{w:.1f}' for w in walls)} | {statistics.median(walls):.1f} | "
              f"{' · '.join(f'{c:.1f}' for c in cpus)} | {statistics.median(cpus):.1f} |")


if __name__ == "__main__":
    main()
