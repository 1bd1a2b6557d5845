#!/usr/bin/env bash
# The case that crashed the naive one-request capture: context 2048, buckets up to 8192.
# Captures every legal bucket of each backend under compute-sanitizer (memcheck) on the
# built-in model (or MODEL_DIR's config.json with random bf16 weights, e.g. a head-dim-128 model
# so that FlashInfer serves) and runs the seed's two-prompt prefill; any illegal access fails.
#   [MODEL_DIR=dir] bash benchmarks/sanitize_capture.sh [backends]
set -uo pipefail
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$san" ] || { echo "compute-sanitizer not found"; exit 2; }
p1=$(python3 -c "print(','.join(str(i % 250) for i in range(1301)))")
p2=$(python3 -c "print(','.join(str((7 * i) % 250) for i in range(1301)))")
model=()
[ -n "${MODEL_DIR:-}" ] && model=(--model "$MODEL_DIR" --load-format random --dtype bfloat16)
rc=0
for backend in ${1:-full breakable tc_piecewise}; do
  echo "=== $backend"
  "$san" --tool memcheck --leak-check no --error-exitcode 99 --print-limit 20 \
    python3 -m service generate --device cuda --context-length 2048 --max-running-requests 8 \
      --chunked-prefill-size 8192 --prefill-buckets 512,2048,3072,4096,6144,8192 \
      --prefill-backend "$backend" "${model[@]}" --prompt-ids "$p1" --prompt-ids "$p2" --max-new-tokens 4 --json \
    2>&1 | grep -E "ERROR SUMMARY|Invalid|illegal|\"prefill_batches\"|Capture prefill graphs done|Attention backend|Error" | sed -E 's/^(.{300}).*("attention_backend".*)$/\1 ... \2/' 
  status=${PIPESTATUS[0]}
  echo "=== $backend exit $status"
  [ "$status" -eq 0 ] || rc=$status
done
exit $rc
