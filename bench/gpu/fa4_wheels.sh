#!/usr/bin/env bash
# Download flash-attn-4 and its dependencies (cp312, x86_64) into .whl-fa4/ for a GPU machine
# without network, splitting any wheel over 40 MB into .part-aa, .part-ab, ... so that each
# device call carries under the 64 MiB limit (bench/gpu/run_issue20_on_device.sh joins them).
# Carry plan printed at the end: the first call carries .whl-fa4 without the big wheel's
# later parts; later calls carry one part each (the warm machine keeps what earlier calls left).
set -eu
CUDA=${CUDA:-cu13}   # the device image's torch 2.11.0+cu130 needs the cu13 libs
mkdir -p .whl-fa4
python3 -m pip download --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl-fa4 flash-attn-4 nvidia-cutlass-dsl "nvidia-cutlass-dsl-libs-base" \
  "nvidia-cutlass-dsl-libs-$CUDA" apache-tvm-ffi torch-c-dlpack-ext quack-kernels einops
for whl in .whl-fa4/*.whl; do
  size=$(stat -c %s "$whl")
  if [ "$size" -gt 40000000 ]; then
    split -b 40000000 "$whl" "$whl.part-" && rm "$whl"
  fi
done
du -ab .whl-fa4 | sort -n | tail -20
