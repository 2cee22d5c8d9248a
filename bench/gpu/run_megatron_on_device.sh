#!/usr/bin/env bash
# Device-side driver for bench/gpu/megatron_gpu_check.py: installs core + the megatron plugin and
# the missing wheels (.whl/: pydantic & co., .whl-megatron/: megatron-core 0.16.1 cp312) into
# /tmp/site, then runs the checks. Carry .whl and .whl-megatron. To fill .whl-megatron (ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl-megatron megatron-core==0.16.1
set -u
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-megatron/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site ./core ./plugins/megatron_engine >/tmp/pipinst.log 2>&1 || { tail -20 /tmp/pipinst.log; exit 4; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, megatron.core; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__)"
python3 bench/gpu/megatron_gpu_check.py 2>&1 | tee $OUT/megatron_gpu_check.log
