#!/usr/bin/env bash
# Device-side driver for bench/gpu/issue20_check.py (issue 20: MFU, decode vs bandwidth, GRPO step
# vs TRL, attention kernels, memory). Installs geartrain core + the fsdp engine from this tree into
# /tmp/site over the device image's torch/transformers, plus the wheels it finds in:
#   .whl/      pydantic, pydantic-core, annotated-types, typing-inspection, tensordict, pyvers (cp312),
#              as for bench/gpu/run_on_device.sh (required);
#   .whl-trl/  trl==1.16.0 and what the image lacks of its dependencies (optional: without it the
#              TRL side of the GRPO comparison is reported as skipped);
#   .whl-fa4/  flash-attn-4 and its dependencies (optional: without it attention runs on
#              flex_attention). nvidia-cutlass-dsl-libs-cu13 (92 MB) does not fit one carry (64 MiB):
#              bench/gpu/fa4_wheels.sh splits it into parts carried by separate calls on the same warm
#              machine (each call keeps the ignored files of the previous one) and joins them here.
# Fill them on a machine with network:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl-trl trl==1.16.0 accelerate datasets ...
# Usage (device tool): bash bench/gpu/run_issue20_on_device.sh [extra args for issue20_check.py]
# Budget: the checks stop starting new sections after 480 s (--budget), so the run ends in < 9 min.
set -u
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
if [ -d .whl-fa4 ]; then
  for whl in .whl-fa4/*.whl.part-aa; do  # parts of a split wheel: join them back
    [ -e "$whl" ] || continue
    cat "${whl%.part-aa}".part-* > "${whl%.part-aa}" && rm -f "${whl%.part-aa}".part-*
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-fa4/*.whl \
    && echo "flash-attn-4 installed" || echo "flash-attn-4 install failed: attention falls back to flex_attention"
fi
if [ -d .whl-trl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-trl/*.whl \
    && echo "trl installed" || echo "trl install failed: the TRL side is skipped"
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site ./core ./plugins/fsdp_engine >/tmp/pipinst.log 2>&1 || { tail -20 /tmp/pipinst.log; exit 4; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 bench/gpu/issue20_check.py --budget 480 "$@" 2>&1 | tee ${OUT:-/tmp}/issue20_check.log
