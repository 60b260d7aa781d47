#!/usr/bin/env bash
# The first GPU run in one command, bounded to return within one 600 s device call (BENCH_BUDGET_SECONDS, default 540):
#   bash bench/gpu_check.sh             # on the GPU machine (wheels from bench/gpu_wheels.sh in .whl/)
#   bash bench/gpu_check.sh --dry-run   # here, on CPU: the same script, a tiny model, every path that runs on CPU
# First, in seconds: the wheels and what they need, the driver against torch, torch's version (varlen_attn needs 2.13),
# one Triton kernel (a missing C compiler shows here).  Then random-init Qwen3-4B (bench/qwen3-4b-config.json, no
# download), 2,000 synthetic conversations (mean ~1.1k tokens, long tail), 10 optimizer steps of 8 sequences, the
# first 2 left out of tokens/s and MFU, evaluation every 5 steps, max length 2048.  One fresh process per variant, in
# this order (the most needed first: what the time bound cuts is the last):
#   fulltune   the job's defaults (trainer.sft_trainer.build_trainer), planned for an 80 GB H100 and capped there
#   stepdown   planned for a 140 GB card, capped at 80 GB: runs out of memory, steps down (trainer/model/stepdown.py), finishes
#   save       a Qwen3-1.7B-sized model (0.6B when the disk is short) saving at steps 2 and 4: the pinned DefaultStager
#   literal    the seed notebook's SFTTrainer call, written out (capped at 80 GB too)
#   loop       the per-sequence SDPA loop instead of torch's varlen kernel (only with torch >= 2.13: varlen vs loop)
#   padded     FT_PADDING_FREE=off
#   bf16-sr    FT_PRECISION=bf16-sr
# "Capped": torch.cuda.set_per_process_memory_fraction holds the allocator to the card planned for, so on an H200 the
# 80 GB plan meets 80 GB and the step-down's out-of-memory error is CUDA's own.  No variant but `save` writes a checkpoint.
# Each variant's result (JSON) and log land in $OUT (else $BENCH_WORK/results) as it finishes, with RESULTS.md, the table
# so far, rewritten by run.py after each; a run is stopped after BENCH_RUN_SECONDS (150) and the whole benchmark at the
# budget, and the table says which were stopped or not run.
#
# --step-cost: instead of the variants, the memory plan's cost model against measured step times (bench/step_cost.py
# --gpu): Qwen3-4B's sizes with 6 of its 36 layers, 8 sequences of ~1,024 tokens a step, four layouts (8 x 1 and 1 x 8
# without recomputation, 8 x 1 recomputing every layer, and the same with offload), 9 steps each, one at a time: about
# 2 minutes after the wheels, bounded at 300 s; step-cost.json in $OUT.  A second device call, so the variants keep theirs.
#
# --dry-run (tests/test_bench.py runs it): the same checks against the versions installed here (what CI tests), the
# Qwen3-4B memory plans from config.json alone, and the variants on CPU with the tiny model, 2 steps each (bf16-sr needs
# a bf16 GPU: its plan is printed, it is not run); the step-down there is an out-of-memory error injected from outside
# (tests/faults/sitecustomize.py), since a CPU has no card to fill.  Arguments after --dry-run go to bench/run.py.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=""
step_cost=""
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
if [ "${1:-}" = "--step-cost" ]; then step_cost=1; shift; fi
python="${PYTHON:-python3}"
work="${BENCH_WORK:-/tmp/bench-gpu}"
results="${OUT:-$work/results}"
budget="${BENCH_BUDGET_SECONDS:-$([ -n "$dry" ] && echo 1800 || echo 540)}"  # the whole script; a device call allows 600 s
run_seconds="${BENCH_RUN_SECONDS:-$([ -n "$dry" ] && echo 600 || echo 150)}"  # one variant
mkdir -p "$work" "$results"
say() { echo "gpu_check: $* (at $SECONDS s of $budget)"; }
left() { echo $((budget - SECONDS)); }

check_wheels() {  # the wheels bench/gpu_wheels.sh pins: each the version importable here, present in .whl/, and what they need here
  "$python" - <<'EOF'
import glob, importlib.metadata as metadata, re, sys
from packaging.requirements import Requirement
CRITICAL = {"torch", "accelerate", "huggingface-hub", "huggingface_hub", "tokenizers", "safetensors", "transformers", "trl", "datasets", "environs"}
pins = re.findall(r"\b([A-Za-z][A-Za-z0-9_.-]*)==([0-9][0-9A-Za-z.]*)", open("bench/gpu_wheels.sh").read())
wheels = [path.rsplit("/", 1)[-1].lower() for path in glob.glob(".whl/*.whl")]
problems = []
for name, version in pins:
    try:
        here = metadata.version(name)
    except metadata.PackageNotFoundError:
        here = None
    if here is not None and here != version:  # the GPU machine's image may lack a package the wheels bring
        problems.append(f"{name}=={version} pinned, {here} installed here")
    stem = f"{re.sub(r'[-.]', '_', name.lower())}-{version}-"
    if wheels and not any(w.startswith(stem) for w in wheels):
        problems.append(f"{name}=={version} has no wheel in .whl/ (run bash bench/gpu_wheels.sh)")
    for line in (metadata.requires(name) or []) if here is not None else []:  # what the machine must bring: torch, accelerate, hub, ...
        need = Requirement(line)
        if need.marker is not None and not need.marker.evaluate({"extra": ""}):
            continue
        try:
            found = metadata.version(need.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} needs {need}, not installed")
            continue
        if not need.specifier.contains(found, prereleases=True):
            unmet = f"{name} needs {need}, {found} installed"
            if need.name.lower() in CRITICAL:
                problems.append(unmet)
            else:  # e.g. datasets' pyarrow floor, which nothing checks at import
                print(f"gpu_check: note: {unmet}", flush=True)
if problems or not pins:
    sys.exit("gpu_check: the wheel list does not match: " + ("; ".join(problems) or "no pins found in bench/gpu_wheels.sh"))
print(f"gpu_check: wheel list: {len(pins)} pins, each the version installed here, their requirements met"
      + (f", {len(wheels)} wheels in .whl/" if wheels else ""), flush=True)
EOF
}

torch_version() {  # varlen_attn(..., window_size=, enable_gqa=) is torch 2.13's: before it the job's attention is the loop
  "$python" - <<'EOF'
import importlib.metadata as metadata, sys
from packaging.version import Version
version = metadata.version("torch")
if Version(version).release < (2, 13):
    print(f"gpu_check: torch {version} < 2.13: torch's varlen_attn (window_size, enable_gqa) is not there, so the job's attention is the "
          "per-sequence loop in every variant: varlen against loop cannot be compared, and the loop variant is left out", flush=True)
    sys.exit(1)
print(f"gpu_check: torch {version}: varlen_attn is there (the loop variant compares it with the per-sequence loop)", flush=True)
EOF
}

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false
if [ -n "$dry" ]; then
  check_wheels
  torch_version || true
  "$python" bench/triton_smoke.py
  "$python" bench/run.py --gpu --dry-run --work "$work"  # the Qwen3-4B plans (defaults, 4096 tokens, as-set, bf16-sr)
  say "benchmark: $(( $(left) - 15 )) s left for it"
  if [ "$(left)" -lt 40 ]; then say "too little time left for any variant"; exit 1; fi  # a 2-step variant on CPU: ~20 s
  status=0
  PYTHONPATH="tests/faults${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 $(( $(left) - 15 )) "$python" bench/run.py --rounds 1 --steps 2 --eval-steps 1 \
    --rows 40 --mean-tokens 48 --vocab 300 --no-mlflow --out "" --results "$results" --run-seconds "$run_seconds" --work "$work" --set FT_EVAL_SAMPLES=0 \
    --variant stepdown:FT_GPU_MEMORY_GB=240,FT_PREFLIGHT=warn,FAULT_OOM_ABOVE_SEQUENCES=4 \
    --variant save:BENCH_MODEL=qwen3-1.7b,FT_SAVE_STEPS=1,FT_SAVE_TOTAL_LIMIT=1 \
    --variant loop:BENCH_ATTENTION=loop --variant padded:FT_PADDING_FREE=off "$@" || status=$?
  say "done, exit $status; results in $results"
  exit "$status"
fi

if compgen -G ".whl/*.whl" > /dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
say "wheels installed"
check_wheels  # after the install: what the image lacks comes from the wheels, at the pinned versions
if [ -n "$step_cost" ]; then
  status=0
  timeout -k 10 300 "$python" bench/step_cost.py --gpu --out "$results/step-cost.json" "$@" || status=$?
  say "step cost done, exit $status; results in $results"
  exit "$status"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
varlen=1
torch_version || varlen=""
# entrypoint.py takes the GPUs from the NVIDIA driver, without torch (trainer/core/devices.py): it must say what torch says.
"$python" -c "
import sys, torch
from trainer.core import devices
probe, torch_says = devices.visible(), (torch.cuda.device_count(), torch.cuda.get_device_capability(0)[0] >= 8)
print('gpu_check: driver probe', probe, 'torch', torch.__version__, torch_says)
sys.exit(0 if (probe.count, probe.bf16) == torch_says else 'gpu_check: the driver probe disagrees with torch')"
timeout -k 5 120 "$python" bench/triton_smoke.py  # a missing C compiler or Python.h fails the check here, in seconds
"$python" -c "import mlflow" 2>/dev/null && NO_MLFLOW="" || NO_MLFLOW="--no-mlflow"
free=$(df -B1 --output=avail "$work" | tail -1)
save="save:BENCH_MODEL=qwen3-1.7b,FT_MAX_STEPS=4,FT_EVAL_STEPS=2,FT_SAVE_STEPS=2,FT_SAVE_TOTAL_LIMIT=1"  # two 20.6 GB checkpoints at once at most
if [ "$free" -lt 50000000000 ]; then save="${save/qwen3-1.7b/qwen3-0.6b}"; fi  # two of 7.2 GB
if [ "$free" -lt 20000000000 ]; then save=""; say "$((free / 1000000000)) GB free under $work: no save variant"; fi
say "$(( $(left) - 15 )) s left for the variants ($((free / 1000000000)) GB free on the disk)"
if [ "$(left)" -lt 90 ]; then say "too little time left for any variant"; exit 1; fi
status=0
timeout -k 10 $(( $(left) - 15 )) "$python" bench/run.py --gpu --rounds 1 --steps 10 --eval-steps 5 --work "$work" $NO_MLFLOW \
  --out "" --results "$results" --run-seconds "$run_seconds" --card-gb 80 --set FT_GPU_MEMORY_GB=80 --set FT_PREFLIGHT=warn \
  --only "fulltune,stepdown,${save:+save,}literal,${varlen:+loop,}padded,bf16-sr" \
  --variant stepdown:FT_GPU_MEMORY_GB=140,BENCH_CARD_GB=80 ${save:+--variant "$save"} --variant loop:BENCH_ATTENTION=loop \
  --variant padded:FT_PADDING_FREE=off --variant bf16-sr:FT_PRECISION=bf16-sr "$@" || status=$?
say "done, exit $status; results in $results"
exit "$status"
