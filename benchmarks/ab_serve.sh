#!/usr/bin/env bash
# Serving (concurrency 1 and 32) and the decode step, this tree then a reference tree, in one
# call to the device tool's H200: the host speed of that machine varies between calls more than
# most host-side changes, so only figures from one call compare. Prepare the reference here,
# then carry the wheels as for gpu_run.sh:
#
#   mkdir -p abtest/old && git archive <commit> service benchmarks | tar -x -C abtest/old
#   bash benchmarks/ab_serve.sh abtest/old        # DECODE=0 skips the decode step
#
# Results go to $RES and are packed into $OUT/results.tgz as they come (the device tool brings
# back at most 8 files; a call cut short by the device budget keeps what finished):
# decode_<tree>.json, serve_c{1,32}_<tree>.json, server_<tree>.txt, summary.txt.
set -uo pipefail
REF=${1:?usage: ab_serve.sh REFERENCE_TREE_DIR}
OUT=${OUT:-/tmp/gpu-out}; RES=${RES:-/tmp/ab-results}; mkdir -p "$OUT" "$RES"
pack() { tar czf "$OUT/partial.tgz" -C "$RES" . && mv "$OUT/partial.tgz" "$OUT/results.tgz"; }
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$HOME/site" .fiw/*.whl .gpuw/*.whl >"$RES/pip.txt" 2>&1 || { cat "$RES/pip.txt"; exit 1; }
PYTHONPATH="$HOME/site:$PWD" timeout 240 python3 benchmarks/fi_warmup.py >"$RES/warmup.txt" 2>&1
echo "warm-up rc $? at $SECONDS s"
M=/tmp/qwen15b; mkdir -p $M
PYTHONPATH=$PWD python3 -c "import json; from benchmarks.prefill_graphs import QWEN25_15B as c; print(json.dumps(c))" >$M/config.json
for tree in new ref; do
  DIR=$PWD; [ $tree = ref ] && DIR=$(cd "$REF" && pwd)
  export PYTHONPATH="$HOME/site:$DIR"
  if [ "${DECODE:-1}" = 1 ]; then
    (cd "$DIR" && timeout 120 python3 benchmarks/decode_step.py --batches 1,8,32 --context 512 \
      --iters 50 --out "$RES/decode_$tree.json" 2>&1 | grep -A4 "^batch" | sed "s/^/$tree decode: /")
  fi
  (cd "$DIR" && exec python3 -m service serve --executor local --model $M --load-format random \
     --context-length 2048 --max-running-requests 64 --port 31240 >"$RES/server_$tree.txt" 2>&1) &
  SERVER=$!
  for _ in $(seq 180); do curl -sf 127.0.0.1:31240/health >/dev/null && break; sleep 1; done
  for c in 1 32; do
    n=16; [ $c = 32 ] && n=128
    timeout 90 python3 benchmarks/serve.py --url http://127.0.0.1:31240 --num-requests $n \
      --input-len 256 --output-len 128 --concurrency $c --out "$RES/serve_c${c}_$tree.json" >/dev/null 2>&1
    pack
    python3 -c "import json; d=json.load(open('$RES/serve_c${c}_$tree.json')); print('$tree c$c', d['output_tokens_per_s'], 'tok/s; TTFT p50/p99', d['ttft_ms']['p50'], d['ttft_ms']['p99'], 'ms; ITL p50/p99', d['itl_ms']['p50'], d['itl_ms']['p99'], 'ms')" | tee -a "$RES/summary.txt"
  done
  kill $SERVER; wait $SERVER 2>/dev/null
  pack
done
