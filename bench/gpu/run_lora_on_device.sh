#!/usr/bin/env bash
# Device-side driver for bench/bench_lora.py (issue 23): peak GPU memory and step time of a
# GRPO-shaped update step, LoRA (rank 16, all-linear, bf16 frozen base) vs full fine-tuning
# (fp32 master weights + AdamW, bf16 compute), on the qwen2.5-1.5b preset. Goal: LoRA peak
# <= 0.4x full fine-tuning's. Installs geartrain core + the fsdp engine from this tree into
# /tmp/site over the device image's torch/transformers, with the wheels of .whl/ (as for
# bench/gpu/run_on_device.sh) plus .whl-peft/ (peft and what the image lacks of its
# dependencies: accelerate, psutil...). Fill it on a machine with network:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl-peft peft accelerate
# Usage (device tool): bash bench/gpu/run_lora_on_device.sh [extra args for bench_lora.py]
set -u
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-peft/*.whl || exit 5
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site ./core ./plugins/fsdp_engine >/tmp/pipinst.log 2>&1 || { tail -20 /tmp/pipinst.log; exit 4; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 bench/bench_lora.py --model qwen2.5-1.5b --device cuda --lora-base-dtype bfloat16 --rows 64 --samples 8 \
  --prompt-tokens 256 --response-tokens 256 --micro-batch-tokens 16384 --steps 3 --json ${OUT:-/tmp}/bench_lora.json "$@" \
  2>&1 | tee ${OUT:-/tmp}/bench_lora.log
