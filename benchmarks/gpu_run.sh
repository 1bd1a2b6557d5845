#!/usr/bin/env bash
# One GPU call's checks and benchmarks, on the device tool's H200 (docs/benchmarks.md lists the
# results). Each step has its own time bound and log under $RES; a failing step does not stop the
# others. Run from the repository root, carrying .fiw (FlashInfer, ../shared/tools/
# device-wheels.sh fi) and .gpuw (fastapi/uvicorn/pydantic/hypothesis wheels; on a fresh checkout:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .gpuw fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn \
#     hypothesis sortedcontainers anyio sniffio h11 click opentelemetry-api importlib-metadata zipp \
#     typing-extensions
# and name .gpuw in .git/info/exclude):
#
#   bash benchmarks/gpu_run.sh tests decode serve      # or: prefill, decode-ab, serveprof, serveprof-uv,
#                                                      # deepseek (V2-Lite shapes; no FlashInfer
#                                                      # needed: warm-up skipped with NO_WARMUP=1),
#                                                      # serve-si (SI=seconds: switch interval),
#                                                      # gemm (linear layers alone),
#                                                      # launch (graph launch cost),
#                                                      # planhost (a ragged plan's host time),
#                                                      # schedab (two schedules, one process),
#                                                      # pad (one process, environments resized),
#                                                      # attn (FA2 against FA3 prefill),
#                                                      # rope (rotary + K/V store kernels),
#                                                      # splitk (split-K GEMM + add-RMSNorm probe),
#                                                      # residual (the add in the GEMM's epilogue),
#                                                      # qkvbias (qkv's bias in the rotary kernel),
#                                                      # handover (graph / eager launch gaps)
#
# SAVE_FICACHE=1 returns FlashInfer's JIT-built modules ($OUT/ficache.tgz.*); joined into
# .ficache/ficache.tgz and carried (.ficache, git-ignored), later calls skip their builds.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
# Every log and result goes to $RES and is packed into $OUT/results.tgz after each step: the
# device tool brings back at most 8 files, and a call cut short keeps what finished.
RES=${RES:-/tmp/gpu-results}
mkdir -p "$OUT" "$RES"
pack() { tar czf "$OUT/partial.tgz" -C "$RES" . && mv "$OUT/partial.tgz" "$OUT/results.tgz"; }
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$HOME/site" .fiw/*.whl .gpuw/*.whl >"$RES/pip.txt" 2>&1 || { cat "$RES/pip.txt"; exit 1; }
export PYTHONPATH="$HOME/site:$PWD"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$RES/gpu.txt"
python3 -c "import torch, flashinfer, triton; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'triton', triton.__version__)" | tee -a "$RES/gpu.txt"
# where `auto` expects FlashInfer's kernels to come from (nvcc or prebuilt; neither: torch kernels)
python3 -c "from service.ranks import flashinfer_toolchain as t; s = t.find(); print('FlashInfer kernels:', t.describe(s), '|', t.blocker(s) or 'auto takes FlashInfer')" | tee -a "$RES/gpu.txt"
# FlashInfer's JIT builds of an earlier call, if carried (.ficache/ficache.tgz: <module>/<module>.so,
# as SAVE_FICACHE=1 returns them): installed where FlashInfer looks for AOT modules, which it
# loads without building; a module not among them is built as usual
if [ -f .ficache/ficache.tgz ]; then
  AOT=$(python3 -c "from flashinfer.jit import env; print(env.FLASHINFER_AOT_DIR)")
  mkdir -p "$AOT" && tar xzf .ficache/ficache.tgz -C "$AOT" && echo "FlashInfer modules from .ficache: $(ls "$AOT" | wc -l)" | tee -a "$RES/gpu.txt"
fi
save_ficache() {  # the built JIT modules, for later calls to carry (16 MiB a returned file)
  local jit list=$RES/ficache.list
  jit=$(python3 -c "from flashinfer.jit import env; print(env.FLASHINFER_JIT_DIR)")
  (cd "$jit" && for d in */; do n=${d%/}; [ -f "$n/$n.so" ] && echo "$n/$n.so"; done) >"$list"
  tar czf - -C "$jit" -T "$list" | split -b 15m - "$OUT/ficache.tgz."
  echo "saved $(wc -l <"$list") FlashInfer modules: $(du -cb "$OUT"/ficache.tgz.* | tail -1)"
}

step() {  # step NAME SECONDS COMMAND...: run with a bound, log to $OUT/NAME.txt, show the tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$RES/$name.txt" 2>&1
  local rc=$?
  echo "=== $name: rc $rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-25}" "$RES/$name.txt"
  pack
}

model_dir() {  # Qwen2.5-1.5B shapes from config.json alone (random bf16 weights)
  local d=/tmp/qwen15b
  mkdir -p $d
  python3 -c "import json; from benchmarks.prefill_graphs import QWEN25_15B as c; print(json.dumps(c))" >$d/config.json
  echo $d
}

[ -z "${NO_WARMUP:-}" ] && step warmup 240 python3 benchmarks/fi_warmup.py
for what in "$@"; do
  case $what in
    tests)
      # GPU_TESTS: these test files instead of all of them
      step gpu_tests 420 python3 -m pytest -q -p no:cacheprovider -m gpu --deselect \
        "tests/test_api.py::test_seed_scenario_on_cuda[breakable]" ${GPU_TESTS:-tests/test_kernels.py \
        tests/test_gate_up.py tests/test_rope_store.py tests/test_honest_replay.py \
        tests/test_decode_graphs.py tests/test_flashinfer.py tests/test_graph_runners.py \
        tests/test_api.py tests/test_deepseek.py tests/test_sm90_schedule.py \
        tests/test_splitk_norm.py tests/test_mlp_chunks.py} ;;
    decode)
      # DECODE_ARGS: more arguments, e.g. "--gate-up-kernel torch" for the other arm of an A/B
      step decode 240 python3 benchmarks/decode_step.py --batches 1,2,4,8,16,32,64 \
        --context 512 --iters 50 --profile 1 ${DECODE_ARGS:-} --out "$RES/decode.json" ;;
    decode-ab)
      # decode steps with each arm's arguments, one process each (DECODE_OLD_ARGS /
      # DECODE_NEW_ARGS, e.g. DECODE_OLD_ARGS="--splitk-norm-kernel torch": the split-K norm's
      # decode A/B); DECODE_BATCHES: the batch sizes
      for arm in old new; do
        ARGS=${DECODE_NEW_ARGS:-}; [ $arm = old ] && ARGS=${DECODE_OLD_ARGS:-}
        TAIL=14 step decode_$arm 240 python3 benchmarks/decode_step.py \
          --batches "${DECODE_BATCHES:-1,8,16,32,64}" --context 512 --iters 50 $ARGS \
          --out "$RES/decode_$arm.json"
      done ;;
    serve|serve-si|serveprof|serveprof-uv)
      # serveprof: concurrency 32 only, the server under benchmarks/host_profile.py; serveprof-uv:
      # the same with uvloop and httptools (wheels carried in .uvw) importable, so uvicorn's
      # "auto" picks them; serve-si: concurrency 32 only, the interpreter switch interval at
      # $SI seconds (default 0.0002) instead of the server's 0.001
      M=$(model_dir); PORT=31234; CLI=(python3 -m service); SUFFIX=${what#serve}; PYPATH=$PYTHONPATH
      SI_ENV=(); [ "$what" = serve-si ] && SI_ENV=(CAPTURE_SERVICE_SWITCH_INTERVAL_S=${SI:-0.0002})
      [[ $what == serveprof* ]] && CLI=(python3 benchmarks/host_profile.py --on-signal \
        --out "$RES/host_profile$SUFFIX.json" --)
      if [ "$what" = serveprof-uv ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site-uv" .uvw/*.whl
        PYPATH="$HOME/site-uv:$PYTHONPATH"
      fi
      env "${SI_ENV[@]}" PYTHONPATH=$PYPATH "${CLI[@]}" serve --executor local --model $M --load-format random \
        --context-length 2048 --max-running-requests 64 --port $PORT >"$RES/server$SUFFIX.txt" 2>&1 &
      SERVER=$!
      for _ in $(seq 240); do
        curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1
      done
      grep -E "Engine ready|Capture (prefill|decode) graphs done" "$RES/server$SUFFIX.txt"
      [ "$what" = serve ] && step serve_c1 150 python3 benchmarks/serve.py --url http://127.0.0.1:$PORT \
        --num-requests 16 --input-len 256 --output-len 128 --concurrency 1 --out "$RES/serve_c1.json"
      [[ $what == serveprof* ]] && kill -USR1 $SERVER  # record the concurrency-32 window only
      step serve_c32$SUFFIX 150 python3 benchmarks/serve.py --url http://127.0.0.1:$PORT \
        --num-requests 128 --input-len 256 --output-len 128 --concurrency 32 \
        --out "$RES/serve_c32$SUFFIX.json"
      [[ $what == serveprof* ]] && kill -USR2 $SERVER
      kill $SERVER; wait $SERVER 2>/dev/null
      [[ $what == serveprof* ]] && grep -A25 "== thread" "$RES/server$SUFFIX.txt" | head -80 ;;
    deepseek)
      # DeepSeek-V2-Lite shapes, random bf16 weights: graph vs eager prefill per bucket, then
      # the seed's scenario through `serve` (breakable, ctx 2048, pool 8, chunked 4096, the
      # 4,096-token bucket as [2048, 2048], two 1,301-token prompts together)
      D=/tmp/dsv2lite; mkdir -p $D
      python3 -c "import json; from benchmarks.prefill_graphs import DEEPSEEK_V2_LITE as c; print(json.dumps(c))" >$D/config.json
      TAIL=12 step deepseek_prefill 300 python3 benchmarks/prefill_graphs.py --model deepseek-v2-lite \
        --backends ${DS_BACKENDS:-breakable} --buckets ${DS_BUCKETS:-256,1024,2048,4096} --context-length 2048 \
        --chunked-prefill-size 4096 --iters 10 --kernel-count-buckets "" \
        --out "$RES/deepseek_prefill.json"
      for att in torch auto; do  # decode graphs: torch decode attention vs FlashInfer's MLA
        step deepseek_decode_$att 240 python3 benchmarks/decode_step.py --model deepseek-v2-lite \
          --batches 1,8,32 --context 512 --iters 30 --attention $att \
          --out "$RES/deepseek_decode_$att.json"
      done
      PORT=31235
      python3 -m service serve --executor local --model $D --load-format random \
        --prefill-backend breakable --prefill-buckets 4096 --context-length 2048 \
        --max-running-requests 8 --chunked-prefill-size 4096 --port $PORT >"$RES/server_deepseek.txt" 2>&1 &
      SERVER=$!
      for _ in $(seq 240); do
        curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1
      done
      grep -E "Attention backend|Fused kernels|Capture|Engine ready" "$RES/server_deepseek.txt"
      step deepseek_seed 120 python3 benchmarks/seed_scenario.py --url http://127.0.0.1:$PORT \
        --out "$RES/deepseek_seed.json"
      kill $SERVER; wait $SERVER 2>/dev/null ;;
    prefill)
      # BUCKETS: a subset of the default buckets; COUNT: buckets with kernel counts, device
      # busy and host issue times; PROFILE / HOSTPROF: the bucket whose kernels / host
      # functions are printed; HF: token counts for HF transformers compiled; KDIFF: the bucket
      # whose kernels are compared eager against graph, one by one; TIMELINE: buckets whose
      # calls are placed on the profiler's clock (host work before the device starts, launch);
      # PROFILE_ROWS: kernels listed per profile; HOST_STEPS: buckets whose segment-runner
      # replays are timed step by step on the host, unprofiled (benchmarks/host_steps.py);
      # PREFILL_ARGS: more arguments, as they are
      TAIL=40 step prefill ${PREFILL_LIMIT:-560} python3 benchmarks/prefill_graphs.py --iters 20 \
        ${BUCKETS:+--buckets $BUCKETS} --kernel-count-buckets "${COUNT:-16,256,2048,8192}" \
        --profile "${PROFILE:-256}" --profile-rows "${PROFILE_ROWS:-12}" ${PREFILL_ARGS:-} \
        ${HOSTPROF:+--host-profile $HOSTPROF} --hf-compiled "${HF:-}" \
        ${KDIFF:+--kernel-diff $KDIFF} ${TIMELINE:+--timeline $TIMELINE} \
        ${HOST_STEPS:+--host-steps $HOST_STEPS} --out "$RES/prefill.json" ;;
    ab)
      # the segment backends before and after a change, in one call: abtest/old holds the
      # older tree's service/ (git archive <commit> service | tar x -C abtest/old; carry it);
      # AB_TIMELINE: buckets placed on the profiler's clock in both arms
      # AB_ROUNDS (default 1): old, new, old, new, ... so that a drifting host falls on both;
      # AB_OLD_ARGS / AB_NEW_ARGS: more arguments for one arm (with abtest/old holding the same
      # tree, an A/B of a flag: AB_OLD_ARGS="--gate-up-kernel torch"); AB_OLD_TREE: the old arm's
      # tree instead of abtest/old ("." : this tree, an A/B of a flag alone)
      for round in $(seq "${AB_ROUNDS:-1}"); do
        for tree in old new; do
          PP=$PYTHONPATH; [ $tree = old ] && PP="$PWD/${AB_OLD_TREE:-abtest/old}:$PYTHONPATH"
          EXTRA=${AB_NEW_ARGS:-}; [ $tree = old ] && EXTRA=${AB_OLD_ARGS:-}
          TAIL=14 step ab_${tree}_$round 240 env PYTHONPATH="$PP" python3 benchmarks/prefill_graphs.py \
            --iters 20 --backends "${AB_BACKENDS:-breakable,tc_piecewise}" \
            --buckets "${AB_BUCKETS:-16,64,256}" --kernel-count-buckets "${AB_BUCKETS:-16,64,256}" \
            ${AB_TIMELINE:+--timeline $AB_TIMELINE} $EXTRA --out "$RES/ab_${tree}_$round.json"
          # each process's host speed beside its times: the arms' hosts differ by process
          python3 benchmarks/loop_summary.py "$tree $round" "$RES/ab_${tree}_$round.json"
        done
      done ;;
    pad)
      # the same process again and again with only the size of its environment changed
      # (PAD_BYTES: the lengths of a PAD variable, "none": unset; PAD_ARGS: prefill_graphs'
      # arguments): whether host speed follows where the stack and heap happen to fall, not
      # the code (session 49: the Python loop 40 against 70-80 us between arms)
      for n in ${PAD_BYTES:-none 5 16 21 37 64}; do
        PADENV=(); [ "$n" != none ] && PADENV=(PAD=$(printf 'x%.0s' $(seq "$n")))
        for arm in ${PAD_ARMS:-own}; do
          env "${PADENV[@]}" timeout 120 python3 benchmarks/prefill_graphs.py --iters 20 \
            --backends breakable --buckets "${PAD_BUCKETS:-16,256}" --kernel-count-buckets "" \
            --prefill-schedule $arm ${PAD_ARGS:-} --out "$RES/pad_${n}_$arm.json" >"$RES/pad_${n}_$arm.txt" 2>&1
          python3 benchmarks/loop_summary.py "$arm pad $n" "$RES/pad_${n}_$arm.json"
        done
      done
      pack ;;
    schedab)
      # two schedules in one process, alternating (benchmarks/schedule_ab.py): SAB_ARMS (default
      # own,balanced), SAB_BUCKETS, SAB_BACKENDS (default breakable; a comma list runs one
      # process each); SAB_ARGS: more arguments (SAB_ARGS="--field gate_up_kernel"
      # SAB_ARMS=triton,torch: a kernel flag instead of the schedule)
      for be in $(echo "${SAB_BACKENDS:-breakable}" | tr , ' '); do
        TAIL=12 step schedule_ab_$be 300 python3 benchmarks/schedule_ab.py --arms "${SAB_ARMS:-own,balanced}" \
          --backend "$be" --buckets "${SAB_BUCKETS:-16,64,256,1024,2048,4096}" \
          ${SAB_ARGS:-} --out "$RES/schedule_ab_$be.json"
      done ;;
    planhost)  # one ragged plan's host time: FlashInfer's module, the deal, the device planner
      TAIL=30 step plan_host 200 python3 benchmarks/plan_host.py --iters 300 --out "$RES/plan_host.json" ;;
    launch)  # what a graph launch costs the host, and when the device starts it
      TAIL=20 step graph_launch 120 python3 benchmarks/graph_launch.py --out "$RES/graph_launch.json" ;;
    attn)  # FlashInfer's ragged prefill kernels, FA2 against FA3: device us per call, host plan us;
      # ATTN_ARGS: more arguments, e.g. "--kernels fa3 --replan" (the service's replan and its parts)
      TAIL=12 step attention_kernels 240 python3 benchmarks/attention_kernels.py \
        --buckets "${ATTN_BUCKETS:-16,64,256,1024,2048,4096,8192}" ${ATTN_ARGS:-} \
        --out "$RES/attention_kernels.json" ;;
    gemm)  # the linear layers alone: cuBLAS, cuBLASLt, TunableOp, a Triton split-K prototype
      TAIL=12 step gemm 300 python3 benchmarks/gemm_shapes.py --m "${GEMM_M:-1,16,64,256,2048}" --out "$RES/gemm.json" ;;
    splitk)  # o_proj / down split over K into fp32 partials, summed by the add-RMSNorm
      TAIL=20 step splitk 150 python3 benchmarks/splitk_norm.py --m "${SPLITK_M:-16,64,128,256,512,1024,2048}" \
        --out "$RES/splitk.json" ;;
    rope)  # rotary + K/V store: FlashInfer's rotary then the store against one Triton kernel
      TAIL=14 step rope_store 180 python3 benchmarks/rope_store.py --m "${ROPE_M:-16,64,256,1024,2048,4096,8192}" \
        --host --out "$RES/rope_store.json" ;;
    residual)  # the residual add in o_proj / down's GEMM (cuBLAS beta = 1), then a plain RMSNorm
      TAIL=14 step residual_gemm 180 python3 benchmarks/residual_gemm.py --m "${RESIDUAL_M:-512,1024,2048,4096,8192}" \
        --rounds "${RESIDUAL_ROUNDS:-2}" --out "$RES/residual_gemm.json" ;;
    qkvbias)  # qkv's bias in cuBLAS's epilogue against the rotary + K/V store kernel's
      TAIL=12 step qkv_bias 150 python3 benchmarks/qkv_bias.py --m "${QKV_M:-1,4,16,64,128,256,512,1024,2048,8192}" \
        --out "$RES/qkv_bias.json" ;;
    handover)  # the device's gap at a hand-over between a graph replay and an eager launch
      TAIL=10 step handover_gap 120 python3 benchmarks/handover_gap.py --out "$RES/handover_gap.json" ;;
    swiglu)  # gate_up GEMM + SiLU-and-mul: cuBLAS + FlashInfer against a fused Triton kernel
      TAIL=14 step swiglu 360 python3 benchmarks/swiglu_gemm.py --m "${SWIGLU_M:-16,32,64,128,256,512,1024,2048,4096,8192}" \
        --variants "${SWIGLU_VARIANTS:-tma,tmap,tmaws}" ${SWIGLU_CONFIGS:+--configs "$SWIGLU_CONFIGS"} \
        ${SWIGLU_ARGS:-} --out "$RES/swiglu.json" ;;
  esac
done
[ -n "${SAVE_FICACHE:-}" ] && save_ficache
pack
