#!/usr/bin/env bash
# The first GPU run in one command, sized for one ~9-minute call on an H100/H200:
#   bash bench/gpu_check.sh             # on the GPU machine (wheels from bench/gpu_wheels.sh in .whl/)
#   bash bench/gpu_check.sh --dry-run   # here, on CPU: the same script, a tiny model, every path that runs on CPU
# Random-init Qwen3-4B (bench/qwen3-4b-config.json, no download), 2,000 synthetic conversations (mean ~1.1k
# tokens, long tail), 12 optimizer steps of 8 sequences, evaluation every 6 steps, max length 2048.  One round,
# one fresh process per variant, in this order:
#   literal    the seed notebook's SFTTrainer call, written out
#   fulltune   the job's defaults (trainer.job.build_trainer), planned for an 80 GB H100 (FT_GPU_MEMORY_GB=80)
#   loop       the same with the per-sequence SDPA loop instead of torch's varlen kernel (varlen vs loop)
#   padded     FT_PADDING_FREE=off
#   bf16-sr    FT_PRECISION=bf16-sr
#   stepdown   a plan sized for a larger card (FT_GPU_MEMORY_GB=240): it runs out of memory on this one, steps down
#              (trainer/model/stepdown.py) and finishes
# The table prints per variant: tokens/s, MFU, the measured peak and the planned one, the step-downs, and which
# attention trained with what its self-check said.  Each variant warns instead of stopping when the estimate says
# it does not fit (FT_PREFLIGHT=warn), so the peak is measured.  On timeout run.py stops the run in progress and
# still writes the table of the finished ones.  Results: bench/RESULTS.md, and $OUT if set.
#
# --dry-run (tests/test_bench.py runs it): checks the wheel list against the versions installed here (what CI
# tests), prints the Qwen3-4B memory plans from config.json alone, and runs the same variants on CPU with the tiny
# model, 2 steps each (bf16-sr needs a bf16 GPU: its plan is printed, it is not run); the step-down there is an
# out-of-memory error injected from outside (tests/faults/sitecustomize.py), since a CPU has no card to fill.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=""
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
python="${PYTHON:-python3}"
work="${BENCH_WORK:-/tmp/bench-gpu}"


check_wheels() {  # the wheels bench/gpu_wheels.sh pins: each the version importable here, each present in .whl/ when it exists
  "$python" - <<'EOF'
import glob, importlib.metadata as metadata, re, sys
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
if problems or not pins:
    sys.exit("gpu_check: the wheel list does not match: " + ("; ".join(problems) or "no pins found in bench/gpu_wheels.sh"))
print(f"gpu_check: wheel list: {len(pins)} pins, each the version installed here" + (f", {len(wheels)} wheels in .whl/" if wheels else ""), flush=True)
EOF
}

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false
if [ -n "$dry" ]; then
  check_wheels
  "$python" bench/run.py --gpu --dry-run --work "$work"  # the Qwen3-4B plans (defaults, 4096 tokens, as-set, bf16-sr)
  PYTHONPATH="tests/faults${PYTHONPATH:+:$PYTHONPATH}" "$python" bench/run.py --rounds 1 --steps 2 --eval-steps 1 --rows 40 --mean-tokens 48 \
    --vocab 300 --no-mlflow --out "" --work "$work" --set FT_EVAL_SAMPLES=0 \
    --variant loop:BENCH_ATTENTION=loop --variant padded:FT_PADDING_FREE=off \
    --variant stepdown:FT_GPU_MEMORY_GB=240,FT_PREFLIGHT=warn,FAULT_OOM_ABOVE_SEQUENCES=4 "$@"
  exit 0
fi

if compgen -G ".whl/*.whl" > /dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
check_wheels  # after the install: what the image lacks comes from the wheels, at the pinned versions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$python" -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
# entrypoint.py takes the GPUs from the NVIDIA driver, without torch (trainer/core/devices.py): it must say what torch says.
"$python" -c "
import sys, torch
from trainer.core import devices
probe, torch_says = devices.visible(), (torch.cuda.device_count(), torch.cuda.get_device_capability(0)[0] >= 8)
print('gpu_check: driver probe', probe, 'torch', torch_says)
sys.exit(0 if (probe.count, probe.bf16) == torch_says else 'gpu_check: the driver probe disagrees with torch')"
"$python" -c "import mlflow" 2>/dev/null && NO_MLFLOW="" || NO_MLFLOW="--no-mlflow"
"$python" bench/run.py --gpu --dry-run --work "$work"
status=0
timeout 540 "$python" bench/run.py --gpu --rounds 1 --steps 12 --eval-steps 6 --work "$work" $NO_MLFLOW \
  --set FT_GPU_MEMORY_GB=80 --set FT_PREFLIGHT=warn \
  --variant loop:BENCH_ATTENTION=loop --variant padded:FT_PADDING_FREE=off --variant bf16-sr:FT_PRECISION=bf16-sr \
  --variant stepdown:FT_GPU_MEMORY_GB=240 "$@" || status=$?
if [ -n "${OUT:-}" ]; then cp bench/RESULTS.md "$OUT/RESULTS.md"; cp "$work"/*.log "$OUT/" 2>/dev/null || true; fi
exit "$status"
