#!/usr/bin/env bash
# Wheels for benchmarks/gpu_check.py on the lent GPU machine (no network there): only what its image lacks.
#
# The lent GPU machine's image (its package list, as documented where the machine is lent) has torch 2.11+cu130,
# transformers 5.17, accelerate 1.15, peft, tokenizers, huggingface-hub, numpy, pandas, pyarrow, fsspec, xxhash,
# psutil, jinja2, pyyaml, tqdm, requests, httpx, filelock, packaging. Missing: TRL and datasets, and datasets' dill and
# multiprocess. Carry nothing the image has: `pip install --target /tmp/site` puts /tmp/site first on PYTHONPATH,
# so a carried torch/transformers/numpy would shadow the image's own. Versions: those the CPU suite runs with.
#
#   bash benchmarks/gpu_wheels.sh        # -> .whl/*.whl (git-ignored), < 40 MiB
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -l .whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total: $total bytes"
if [ "$total" -ge $((40 * 1024 * 1024)) ]; then echo "over 40 MiB" >&2; exit 1; fi
