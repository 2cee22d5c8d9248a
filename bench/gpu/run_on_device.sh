#!/usr/bin/env bash
# Device-side driver: install geartrain (core + fsdp) and missing pure-Python deps into /tmp/site, run the checks.
# Wheels of the pure-Python needs missing from the device image (tensordict, pyvers, pydantic,
# pydantic-core, annotated-types, typing-inspection, cp312) are expected in .whl/ (pip download --python-version 3.12 ...).
set -u
rm -rf /tmp/site /tmp/run
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site ./core ./plugins/fsdp_engine >/tmp/pipinst.log 2>&1 || { tail -20 /tmp/pipinst.log; exit 4; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 bench/gpu/gpu_check.py 2>&1 | tee $OUT/gpu_check.log
echo "== main job on the GPU (inline placement, device cuda), limited to 240 s"
start=$(date +%s)
timeout 240 python3 -m geartrain.cli train examples/arithmetic/grpo.toml trainer.output_dir=/tmp/run > $OUT/main_job.log 2>&1; echo "main job rc=$? after $(( $(date +%s) - start )) s"
tail -25 $OUT/main_job.log
cp /tmp/run/metrics.jsonl $OUT/ 2>/dev/null; true
