#!/usr/bin/env bash
# The GPU benchmark in one command, sized for ~9 minutes on one H100/H200:
#   bash bench/gpu_check.sh
# Random-init Qwen3-4B (bench/qwen3-4b-config.json, no download), 2,000 synthetic conversations (mean
# ~1.1k tokens, long tail), 20 optimizer steps of 8 sequences, evaluation every 10 steps on 200 rows,
# max length 2048.  The fulltune variants are the job's own trainer (trainer.job.build_trainer) and plan
# for an 80 GB H100 (FT_GPU_MEMORY_GB=80) even on an H200, and warn instead of stopping if the estimate
# says it does not fit, so the peak is measured.  Two interleaved rounds (literal fulltune padded
# bf16-sr, twice): ratios are reported only between variants that finished both rounds, so the order
# puts literal and fulltune first in each round.
# Missing Python packages (trl, datasets, mlflow-skinny, environs, ...) may lie as wheels in .whl/
# (see docs/performance.md, "Running the benchmark").  Results: bench/RESULTS.md, and $OUT if set.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
python3 -c "import mlflow" 2>/dev/null && NO_MLFLOW="" || NO_MLFLOW="--no-mlflow"
python3 bench/run.py --gpu --dry-run --work /tmp/bench-gpu
# literal (seed), fulltune defaults, fulltune with padded passes (the measurement FT_PADDING_FREE=auto
# waits for), and fulltune with FT_PRECISION=bf16-sr (opt-in until measured: 12 B/param, fuller passes).
# bf16-sr planned for the whole H200 (recomputing every 2nd layer only) is one more variant when time
# allows: `bash bench/gpu_check.sh --variant bf16-sr-selective:FT_PRECISION=bf16-sr,FT_GPU_MEMORY_GB=139`.
# On timeout run.py stops the run in progress and still writes the table of the finished ones.
status=0
timeout 540 python3 bench/run.py --gpu --rounds 2 --work /tmp/bench-gpu $NO_MLFLOW \
  --set FT_GPU_MEMORY_GB=80 --set FT_PREFLIGHT=warn \
  --variant padded:FT_PADDING_FREE=off --variant bf16-sr:FT_PRECISION=bf16-sr "$@" || status=$?
if [ -n "${OUT:-}" ]; then cp bench/RESULTS.md "$OUT/RESULTS.md"; cp /tmp/bench-gpu/*.log "$OUT/" 2>/dev/null || true; fi
exit "$status"
