#!/usr/bin/env python3
"""Side by side: the seed notebook's SFTTrainer call (literal) against this project's job (fulltune).

    .venv/bin/python bench/run.py                      # CPU: tiny Qwen3, 2 interleaved rounds, ~10 minutes on 2 cores
    .venv/bin/python bench/run.py --gpu --dry-run      # no training: Qwen3-4B memory plan on the meta device
    bash bench/gpu_check.sh                            # GPU: random-init Qwen3-4B, within 540 s on an H100/H200

The fulltune variants are the job's own trainer: bench/child.py builds the job's `Config` from `FT_*`
values and calls `trainer.sft_trainer.build_trainer`, after the stages `job.run` runs before it.  The literal
variant is the seed's `SFTTrainer` call, written out.  Both train the same model (same initial
weights), on the same synthetic conversations, the same 90/10 split, the same number of optimizer
steps and the same evaluation cadence, each in a fresh process so imports and peak memory are
counted.  By default no checkpoint is written (transformers would save one at the last step: the children
switch saving off, bench/child.py `without_checkpoints`; `--save-steps N`, or a variant's `FT_SAVE_STEPS`, saves)
and the final model is not saved.  Both log the loss at every step so
the per-step losses can be compared (loss parity).  After training, each evaluates its final model
with the same procedure (token-weighted NLL over the validation rows), since the trainers' own eval
loss averages per batch and so depends on the evaluation batch size.

On a shared machine one run says little: the variants run interleaved (`--rounds N`, default 2:
literal, fulltune, ..., literal, fulltune, ...), the table gives each variant's min and median (max
and median for rates), and a ratio between variants is only given when both ran in at least 2
interleaved rounds.  Each run records the 1-minute load average when it starts and ends.  On CPU each
round first measures the fp32 matrix-multiply peak (bench/child.py `gemm`, same torch threads), and
the table reports the model FLOP/s achieved inside optimizer steps over it ("CPU MFU").

`--set FT_NAME=value` changes a setting of the fulltune variant; `--variant` adds more of them, e.g.
`--variant padded:FT_PADDING_FREE=off`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import child  # noqa: E402 - its imports are light; torch and the job load in the child process only
import synthetic  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="random-init Qwen3-4B from bench/qwen3-4b-config.json, bf16")
    p.add_argument("--dry-run", action="store_true", help="print the data statistics and memory plans; train nothing")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds: every variant once per round, in the same order")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-steps", type=int, default=10)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (default: after the last step, i.e. none, as the seed's 25)")
    p.add_argument("--rows", type=int, default=2000, help="conversations; 10%% are held out for validation")
    p.add_argument("--mean-tokens", type=int, default=None, help="mean conversation length (default 1100 on GPU, 300 on CPU)")
    p.add_argument("--max-length", type=int, default=None, help="truncation for both variants (default 2048 on GPU, 1024 on CPU)")
    p.add_argument("--vocab", type=int, default=synthetic.WORDS + 7, help="the synthetic tokenizer's size, and the tiny CPU model's vocabulary")
    p.add_argument("--literal-fp32", action="store_true", help="the literal variant in fp32 (always on CPU, where bf16 is 7-25x slower)")
    p.add_argument("--no-mlflow", action="store_true", help="neither variant reports to MLflow (for machines without it)")
    p.add_argument("--set", action="append", default=[], metavar="FT_NAME=value", help="a setting for the fulltune variant")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:FT_A=1,FT_B=2", help="another fulltune variant")
    p.add_argument("--only", default="", help="comma-separated variant names to run, in this order (default: all, in the order defined)")
    p.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="append the results table here ('' = do not write)")
    p.add_argument("--results", default="", help="write each run's result and log here as it finishes, and RESULTS.md (the table so far) after each")
    p.add_argument("--run-seconds", type=float, default=0, help="stop a run that takes longer than this (0 = no limit)")
    p.add_argument("--card-gb", type=float, default=0, help="GPU: hold each run's allocator to a card of this size (the literal one too; "
                                                             "a variant's BENCH_CARD_GB or FT_GPU_MEMORY_GB first)")
    p.add_argument("--work", default="", help="folder for the model, data and outputs (default: a temporary one)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.mean_tokens = args.mean_tokens or (1100 if args.gpu else 300)
    args.max_length = args.max_length or (2048 if args.gpu else 1024)
    return args


def variants(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    found = {"literal": {}, "fulltune": dict(s.split("=", 1) for s in args.set)}
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        found[name] = {**found["fulltune"], **dict(p.split("=", 1) for p in pairs.split(",") if p)}
    if args.only:  # in the order given: the first ones run first
        found = {k: found[k] for k in args.only.split(",") if k in found}
    return found


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.child:
        result = child.run(args)
        print("BENCH-RESULT " + json.dumps(result), flush=True)
        return 0
    work = args.work or tempfile.mkdtemp(prefix="fulltune-bench-")
    stats = synthetic.build(
        work, rows=args.rows, mean_tokens=args.mean_tokens, gpu=args.gpu, config_path=os.path.join(HERE, "qwen3-4b-config.json"), vocab=args.vocab
    )
    print(f"bench: data {stats}", flush=True)
    if args.dry_run:
        child.dry_run(args, work)
        return 0
    chosen = variants(args)
    results: dict[str, list[dict]] = {name: [] for name in chosen}
    gemms: list[dict] = []
    running, stopped = [], []
    if args.results:
        os.makedirs(args.results, exist_ok=True)

    def stop(signum, frame):  # `timeout` in gpu_check.sh: stop the run in progress, keep the finished ones
        stopped.append(signum)
        for proc in running:
            proc.terminate()

    def one(name: str, round_: int, overrides: dict[str, str]) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", name, "--work", work,
               "--overrides", json.dumps(overrides), "--t0", str(time.time()), "--round", str(round_)]
        started = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        log = os.path.join(args.results or work, f"{name}-r{round_}.log")
        with open(log, "w") as out:  # written as the run goes: a run cut short still leaves its log
            # Its own process group (outside `timeout`'s, which would signal it directly), in this session (a machine's cleanup ends it).
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, process_group=0)
            running[:] = [proc]
            loads, over = [os.getloadavg()[0]], False
            while True:  # the 1-minute load average every 5 s while the run lasts: its start and end miss the spikes
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    loads.append(os.getloadavg()[0])
                if args.run_seconds and time.perf_counter() - started > args.run_seconds and not over:
                    over = True
                    proc.terminate()
                if stopped or over:
                    _end(proc)
        running[:] = []
        wall = time.perf_counter() - started
        with open(log, encoding="utf-8", errors="replace") as f:
            output = f.read()
        lines = [line for line in output.splitlines() if line.startswith("BENCH-RESULT ")]
        if proc.returncode or not lines:
            why = f"stopped: over its {args.run_seconds:g} s" if over else "stopped: out of time" if stopped else f"failed (exit {proc.returncode})"
            print(f"bench: round {round_} {name} {why}; log: {log}\n{output[-3000:]}", flush=True)
            result = {"failed": proc.returncode, "stopped": bool(stopped or over), "round": round_, "wall_s": wall}
        else:
            result = json.loads(lines[-1].removeprefix("BENCH-RESULT ")) | {"wall_s": wall, "overrides": overrides, "round": round_, "load_max": max(loads)}
            print(f"bench: round {round_} {name}: {json.dumps({k: v for k, v in result.items() if k != 'losses'})}", flush=True)
        if args.results:
            with open(os.path.join(args.results, f"{name}-r{round_}.json"), "w") as f:
                json.dump(result, f)
        return result

    def tabulate() -> str:
        with open(os.path.join(work, "results.json"), "w") as f:  # to render the table again: table(args, argv, stats, results, gemms)
            json.dump({"argv": argv, "stats": stats, "results": results, "gemms": gemms}, f)
        report = table(args, argv, stats, results, gemms, stopped=bool(stopped))
        if args.results:
            with open(os.path.join(args.results, "RESULTS.md"), "w", encoding="utf-8") as f:
                f.write(report)
        return report

    signal.signal(signal.SIGTERM, stop)
    for round_ in range(1, args.rounds + 1):
        if not args.gpu and not stopped:
            gemm = one("gemm", round_, {})
            if "failed" not in gemm:
                gemms.append(gemm)
        for name, overrides in chosen.items():
            if stopped:
                break
            results[name].append(one(name, round_, overrides))
            tabulate()
    report = tabulate()
    print(report, flush=True)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write("\n" + report)
    return 0 if all("failed" not in r for runs in results.values() for r in runs) and not stopped else 1


def _end(proc: subprocess.Popen) -> None:
    """The run in progress, stopped: SIGTERM was sent; what is still there 5 s later is killed (a child waiting on the
    GPU may not answer it), with everything it started."""
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


ROWS = [  # label, key, format, "min" (lower is better: min / median) or "max" (a rate: max / median)
    ("end-to-end wall (s)", "wall_s", "{:.1f}", "min"),
    (f"training tokens/s (real tokens, after the first {child.WARMUP_STEPS} steps)", "tokens_per_s", "{:.0f}", "max"),
    ("model GFLOP/s in optimizer steps", "model_gflops", "{:.1f}", "max"),
    ("CPU MFU (model FLOP/s / measured fp32 GEMM peak)", "cpu_mfu", "{:.1%}", "max"),
    ("MFU (GPU, dense bf16 datasheet peak)", "mfu", "{:.3f}", "max"),
    ("time to first step (s)", "first_step_s", "{:.1f}", "min"),
    ("time in optimizer steps (s)", "train_s", "{:.1f}", "min"),
    ("time in evaluations, saves, best-model load (s)", "eval_s", "{:.1f}", "min"),
    ("peak memory (GB)", "peak_gb", "{:.2f}", "min"),
    ("peak memory reserved by the allocator (GB)", "reserved_gb", "{:.2f}", "min"),
    ("device memory in use at step ends, context included (GB, total - free)", "device_used_gb", "{:.2f}", "min"),
    ("peak memory planned (GB, the plan that trained)", "plan_gb", "{:.2f}", "min"),
    ("allocator capped at (GB, the card planned for)", "capped_gb", "{:.0f}", "min"),
    ("out-of-memory step-downs before it trained", "stepdowns", "{:.0f}", "min"),
    ("checkpoints written", "saves", "{:.0f}", "min"),
    ("checkpoint size (GB)", "checkpoint_gb", "{:.1f}", "min"),
    ("training blocked by the first checkpoint (s: pinning the staging buffers, then the copy)", "save_first_blocked_s", "{:.1f}", "min"),
    ("training blocked by the last checkpoint (s: the copy to the pinned buffers)", "save_blocked_s", "{:.1f}", "min"),
    ("longest checkpoint write and commit in the background (s)", "save_background_s", "{:.1f}", "min"),
    ("final eval loss (same procedure)", "eval_loss", "{:.4f}", "min"),
    ("trainer's last eval_loss", "trainer_eval_loss", "{:.4f}", "min"),
]


def summary(values: list[float], fmt: str, best: str) -> str:
    """'best / median' over the rounds, or one value when every round gave the same (as printed)."""
    if not values:
        return "-"
    top = min(values) if best == "min" else max(values)
    a, b = fmt.format(top), fmt.format(statistics.median(values))
    return a if a == b and len({fmt.format(v) for v in values}) == 1 else f"{a} / {b}"


def load(run: dict) -> str:
    start, end = run["load_avg"]
    return f"load {start:.1f}→{end:.1f}" + (f", max {run['load_max']:.1f}" if "load_max" in run else "")


def paired(results: dict[str, list[dict]], name: str, base: str, key: str) -> list[float]:
    """Per-round ratios name/base, from the rounds where both ran (interleaved, so both saw the same machine)."""
    by_round = {r["round"]: r for r in results[base] if "failed" not in r}
    out = []
    for run in results[name]:
        other = by_round.get(run["round"])
        if "failed" not in run and other is not None and isinstance(run.get(key), float | int) and isinstance(other.get(key), float | int) and other[key]:
            out.append(run[key] / other[key])
    return out


def status_of(runs: list[dict], stopped: bool) -> str:
    """How a variant's runs went, in a word or two: finished, failed, stopped (time), not run (time)."""
    if not runs:
        return "not run (time)" if stopped else "-"
    done = sum("failed" not in r for r in runs)
    if done == len(runs):
        return "finished"
    if any(r.get("stopped") for r in runs):
        return "stopped (time)" if not done else f"{done} finished, then stopped (time)"
    return "failed" if not done else f"{done} finished, {len(runs) - done} failed"


def _version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def table(args: argparse.Namespace, argv: list[str], stats: dict, results: dict[str, list[dict]], gemms: list[dict], stopped: bool = False) -> str:
    """The results as a markdown table.  Imports nothing heavy (the versions come from the installed metadata, the device
    from the runs): it is written after every run and once more when `timeout` stops the benchmark, within seconds."""
    cpu = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    device = next((r["device"] for runs in results.values() for r in runs if r.get("device")), "") or (cpu if not args.gpu else "GPU (no run finished)")
    peak = max((g["peak_flops"] for g in gemms), default=None)
    for runs in results.values():
        for r in runs:
            if "failed" not in r and "model_flops" in r:
                r["model_gflops"] = r["model_flops"] / 1e9
                if peak and not args.gpu:
                    r["cpu_mfu"] = r["model_flops"] / peak
    names = list(results)
    ok = {n: [r for r in results[n] if "failed" not in r] for n in names}
    rounds_done = max((len(v) for v in ok.values()), default=0)
    # a ratio only from interleaved runs: both variants finished in at least 2 of the same rounds
    compared = [n for n in names if n != "literal" and "literal" in names and len(paired(results, n, "literal", "wall_s")) >= 2]
    threads = sorted({r.get("threads") for runs in ok.values() for r in runs if r.get("threads")})
    saves = f"checkpoint every {args.save_steps}" if args.save_steps else "no checkpoint but in a variant that sets FT_SAVE_STEPS"
    order = " | ".join(" ".join(n for n in names if any(r["round"] == i for r in results[n])) for i in range(1, args.rounds + 1))
    out = [
        f"### {time.strftime('%Y-%m-%d %H:%M')} — {device}",
        "",
        f"`{shlex.join(['python', 'bench/run.py', *argv])}`  ",
        f"torch {_version('torch')}, transformers {_version('transformers')}, trl {_version('trl')}, python {platform.python_version()}, "
        f"torch threads {'/'.join(map(str, threads)) or '-'}  ",
        f"{args.steps} steps, eval every {args.eval_steps}, {saves}, max length {args.max_length}, "
        f"data: {stats}  ",
        f"{args.rounds} round(s), interleaved, each run a fresh process: {order}" + ("  " if gemms else ""),
    ]
    if gemms:
        medians = ", ".join(f"{g['median_flops'] / 1e9:.1f}" for g in gemms)
        sizes = ", ".join(f"{n}²: {max(g['by_size'][n] for g in gemms) / 1e9:.1f}" for n in gemms[0]["by_size"])
        out.append(
            f"fp32 GEMM peak (`torch.mm`, {gemms[0]['threads']} threads, best single matmul over {len(gemms)} round(s)): "
            f"**{peak / 1e9:.1f} GFLOP/s** ({sizes} GFLOP/s; the median matmul per round: {medians})"
        )
    header = "| | " + " | ".join(f"{n} ({'min' if len(ok[n]) > 1 else 'one run'}{' / median' if len(ok[n]) > 1 else ''})" for n in names)
    header += "".join(f" | {n} / literal: of the mins · of the medians · per round" for n in compared) + " |"
    out += ["", header, "|---" * (1 + len(names) + len(compared)) + "|"]
    status = [status_of(results[n], stopped) for n in names]
    out.append("| run | " + " | ".join(status + [""] * len(compared)) + " |")
    for label, key, fmt, best in ROWS:
        if not any(key in r for runs in ok.values() for r in runs):
            continue
        cells = []
        for n, state in zip(names, status, strict=True):
            if not ok[n]:
                cells.append(state)
            else:
                cells.append(summary([r[key] for r in ok[n] if isinstance(r.get(key), float | int)], fmt, best))
        for n in compared:
            ratios = paired(results, n, "literal", key)
            if not ratios:
                cells.append("")
                continue
            a = [r[key] for r in ok["literal"] if isinstance(r.get(key), float | int)]
            b = [r[key] for r in ok[n] if isinstance(r.get(key), float | int)]
            pick = min if best == "min" else max
            per_round = ", ".join(f"{x:.2f}" for x in ratios)
            cells.append(f"{pick(b) / pick(a):.2f} · {statistics.median(b) / statistics.median(a):.2f} · {per_round}")
        mark = " (max / median)" if best == "max" and rounds_done > 1 else ""
        out.append(f"| {label}{mark} | " + " | ".join(cells) + " |")
    layouts = [", ".join(sorted({r.get("layout", "-") for r in ok[n]})) if ok[n] else "-" for n in names]
    out.append("| layout (seqs x passes), recomputation, padding-free | " + " | ".join(layouts + [""] * len(compared)) + " |")
    paths = [", ".join(sorted({r.get("attention", "-") for r in ok[n]})) if ok[n] else "-" for n in names]
    out.append("| attention (and its self-check) | " + " | ".join(paths + [""] * len(compared)) + " |")
    if not compared and len(names) > 1 and "literal" in names:
        out.append("\nNo ratio: variants are compared only when both ran in at least 2 interleaved rounds.")
    out.append("\nRuns in order (1-minute load average when each run started → ended, and the highest seen every 5 s; the run's own threads add ~2):")
    for i in range(1, args.rounds + 1):
        parts = [f"GEMM {g['peak_flops'] / 1e9:.1f} GFLOP/s ({load(g)})" for g in gemms if g["round"] == i]
        for n in names:
            for r in results[n]:
                if r["round"] != i:
                    continue
                if "failed" in r:
                    parts.append(f"{n} {'stopped' if r['stopped'] else 'failed'}")
                else:
                    parts.append(f"{n} {r['wall_s']:.1f} s, {r['tokens_per_s']:.0f} tokens/s ({load(r)})")
        if parts:
            out.append(f"- round {i}: " + "; ".join(parts))
    if ok.get("literal"):
        base = ok["literal"][0]["losses"]
        for n in names:
            if n != "literal" and ok[n] and ok[n][0]["losses"]:
                losses = ok[n][0]["losses"]
                worst = max(abs(b - a) / abs(a) for a, b in zip(base, losses, strict=False))
                out.append(f"\nper-step training loss, {n} vs literal over {min(len(base), len(losses))} steps: max relative difference {worst:.2%}")
    for n in names:
        if len(ok[n]) > 1:
            first = ok[n][0]["losses"]
            drift = max((abs(b - a) / abs(a) for r in ok[n][1:] for a, b in zip(first, r["losses"], strict=False)), default=0.0)
            out.append(f"\n{n}, round to round: per-step training loss max relative difference {drift:.2%}")
    for n in names:
        if ok[n] and ok[n][0].get("overrides"):
            out.append(f"\n{n}: {' '.join(f'{k}={v}' for k, v in ok[n][0]['overrides'].items())}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
