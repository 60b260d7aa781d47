#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on a GPU machine that cannot reach a package index, built here:
#   bash bench/gpu_wheels.sh        # -> .whl/ (ignored by git; carry it to the GPU machine)
# The lent machine's image (Python 3.12) has torch, transformers 5.17, accelerate, tokenizers,
# huggingface-hub, pandas, xxhash, ... but no trl, datasets or environs; this adds those at the versions CI
# tests, their missing dependencies, and fsspec at a version datasets 5.2 accepts: 15 MB of the 64 MiB a
# call may carry.  Left out: pyarrow (the image has one; datasets asks for >= 24 but checks nothing at
# import, and the cp312 wheel alone is 48 MB) and MLflow (gpu_check.sh then benchmarks with --no-mlflow).
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
rm -rf .whl
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  transformers==5.24.0 trl==1.16.0 datasets==5.2.0 environs==15.2.0 marshmallow==4.4.0 python-dotenv==1.2.4 \
  dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0
ls .whl
du -sh .whl
