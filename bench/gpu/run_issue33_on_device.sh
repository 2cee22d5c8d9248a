#!/usr/bin/env bash
# Device-side driver for bench/gpu/issue33_check.py (issue 33: decode vs roofline with the
# GQA-native attention, update MFU by honest accounting, the GRPO step vs TRL, LoRA/full peak with
# gradient checkpointing). Installs geartrain core + the fsdp engine from this tree into /tmp/site
# over the device image's torch/transformers, plus the wheels it finds in:
#   .whl/       pydantic, pydantic-core, annotated-types, typing-inspection, tensordict, pyvers (cp312),
#               as for bench/gpu/run_on_device.sh (required);
#   .whl-trl/   trl==1.16.0 and what the image lacks of its dependencies (optional: without it the TRL
#               side of the GRPO comparison is reported as skipped);
#   .whl-peft/  peft and accelerate (optional: without it the LoRA memory section fails alone);
#   .whl-fa4/   flash-attn-4 and its dependencies, split as for run_issue20_on_device.sh (optional).
# Usage (device tool, one call of at most 8 minutes, so a rerun fits in 15 minutes of device time):
#   bash bench/gpu/run_issue33_on_device.sh [extra args for issue33_check.py]
set -u
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
if [ -d .whl-fa4 ]; then
  for whl in .whl-fa4/*.whl.part-aa; do
    [ -e "$whl" ] || continue
    cat "${whl%.part-aa}".part-* > "${whl%.part-aa}" && rm -f "${whl%.part-aa}".part-*
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-fa4/*.whl \
    && echo "flash-attn-4 installed" || echo "flash-attn-4 install failed: attention falls back to flex_attention"
fi
for extra in .whl-trl .whl-peft; do
  if [ -d "$extra" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$extra"/*.whl \
      && echo "$extra installed" || echo "$extra install failed"
  fi
done
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site ./core ./plugins/fsdp_engine >/tmp/pipinst.log 2>&1 || { tail -20 /tmp/pipinst.log; exit 4; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 470 python3 bench/gpu/issue33_check.py --budget 420 "$@" 2>&1 | tee ${OUT:-/tmp}/issue33_check.log
