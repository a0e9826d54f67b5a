#!/usr/bin/env bash
# The next lease's calls, written before it starts (bench/lease/README.md): on the GPU
# machine, `bash bench/lease/calls.sh cN`, each call's output under $OUT (one file per step,
# each step under its own timeout, so a call cut short keeps what it measured).
#   c1  carry .gpu_a                 MLX part 1 to /tmp/keep
#   c2  carry .gpu_b                 MLX, models (.gpu_w does not fit beside .gpu_b: 64 MiB)
#   c3  carry .gpu_llama .gpu_w      wheels; llama.cpp's build (background); what precompiling
#                                    verify and MTP shapes costs; A/B: step inputs on the
#                                    device vs host, N = 8, 64, two passes
#   c4  -                            the suite, 0.8B and 9B, beside llama.cpp and mlx-lm
#   c5  -                            the GPU tests of unrun changes (MTP pads, step inputs);
#                                    speculation on the demo model, every steady shape
#                                    precompiled (MTP's too)
#   c6  -                            A/B: per-layer recurrent-state writes, N = 64
#   c7, c8 (session 13's second lease) and c9 (speculation's phases) are described where
#   they are defined.
# Session 14 left a plan for the next lease (~1,700 s; move models/slotserve-demo.gguf out of
# the tree for c1, README): c1; c2 with LEASE_MODELS="qwen3.5-0.8b:f16 qwen3.5-9b:q8_0"
# (~260 s); p1 (~170 s, which vCPUs are fast: set CPUS from it; before the build, which
# loads 15 cores); p2 (llama.cpp's build starts, -j15, ~4.5 min, done within the call; the
# staged kernel's GPU tests first, then the MTP chain's: ~450 s); p4 (~450 s, the staged
# loads A/B pinned); p3 (the suite pinned, ~400 s). Drop c9 and the MTP tests first if time
# runs short.
# About 1,800 s of device time in all: c6 is the first to drop. c3 lasts about as long as
# the build (~6 min; bench/lease/README.md): send it with a 600 s limit.
set -u
M=/tmp/models
L=/tmp/llama/llama.cpp/build/bin/llama-batched-bench
export PYTHONPATH=/tmp/site:$PWD
sweep() {  # name timeout args...: bench/mlx_env_sweep.py into $OUT/name.{md,json}
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 bench/mlx_env_sweep.py --model-dir $M --gen 32 --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.md" 2>&1
  tail -n 12 "$OUT/$name.md"
}
case ${1:-} in
c1)
  mkdir -p /tmp/keep && cp -r .gpu_a/. /tmp/keep/ && ls /tmp/keep ;;
c2)
  source .gpu_b/install-mlx-cuda.sh
  T=$(date +%s); source bench/lease/setup.sh > "$OUT/c2_setup.txt" 2>&1
  echo "setup $(( $(date +%s) - T )) s"; ls -la $M ;;
c3)
  source bench/lease/setup.sh > "$OUT/c3_setup.txt" 2>&1  # .gpu_w's wheels too
  timeout 200 python3 bench/precompile_time.py --model $M/qwen3.5-0.8b-f16.gguf --slots 8 \
    --context 4096 --verify 4 --mtp --json "$OUT/c3_precompile.json" > "$OUT/c3_precompile.txt" 2>&1
  tail -n 20 "$OUT/c3_precompile.txt"
  tail -n 2 /tmp/llama/build.log 2>/dev/null
  sweep c3_inputs 300 --n 8,64 --setting host:ARGS=--overlap \
    --setting device:SLOTSERVE_STEP_INPUTS=device,ARGS=--overlap --setting host_b:ARGS=--overlap \
    --setting device_b:SLOTSERVE_STEP_INPUTS=device,ARGS=--overlap
  cat /tmp/llama/rc 2>/dev/null; tail -n 1 /tmp/llama/build.log ;;
c4)
  cat /tmp/llama/rc; mkdir -p "$OUT/suite"
  OUT=$OUT/suite timeout 570 python3 bench/gpu_suite.py --model-dir $M --llama-batched-bench $L \
    --wheels .gpu_w/wheels --budget-s 400 --big-needs-s 150 --reps 1 --steps 32 --ahead \
    > "$OUT/c4_suite.log" 2>&1
  tail -n 30 "$OUT/suite/gpu_suite.md" ;;
c5)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_step_inputs.py \
    tests/test_spec_shapes.py > "$OUT/c5_tests.txt" 2>&1
  tail -n 5 "$OUT/c5_tests.txt"
  timeout 330 python3 bench/spec_decode.py --model models/slotserve-demo.gguf --k 4 --n 1,8 --gen 64 \
    --repeats 2 --compile --precompile --configs plain,ngram,mtp --json "$OUT/c5_spec.json" \
    > "$OUT/c5_spec.md" 2>&1
  tail -n 30 "$OUT/c5_spec.md" ;;
c6)
  sweep c6_ssm 250 --n 64 --setting stacked:ARGS=--overlap \
    --setting layers:SLOTSERVE_POOL_SSM_WRITE=layers,ARGS=--overlap --setting stacked_b:ARGS=--overlap \
    --setting layers_b:SLOTSERVE_POOL_SSM_WRITE=layers,ARGS=--overlap ;;
c7)  # a second, short lease after c1 (carry .gpu_b): MLX, then speculation again
  source .gpu_b/install-mlx-cuda.sh
  timeout 330 python3 bench/spec_decode.py --model models/slotserve-demo.gguf --k 4 --n 1,8 --gen 64 \
    --repeats 2 --compile --precompile --configs plain,ngram,mtp --json "$OUT/c7_spec.json" \
    > "$OUT/c7_spec.md" 2>&1
  tail -n 30 "$OUT/c7_spec.md" ;;
c8)  # carry .gpu_w: the MTP tests on the GPU; what precompiling MTP's shapes costs now
  LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > "$OUT/c8_setup.txt" 2>&1
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_spec_mtp_chain.py \
    tests/test_spec_shapes.py > "$OUT/c8_tests.txt" 2>&1
  tail -n 5 "$OUT/c8_tests.txt"
  timeout 200 python3 bench/precompile_time.py --model $M/qwen3.5-0.8b-f16.gguf --slots 8 \
    --context 4096 --verify 4 --mtp --json "$OUT/c8_precompile.json" > "$OUT/c8_precompile.txt" 2>&1
  tail -n 20 "$OUT/c8_precompile.txt" ;;
c9)  # where a speculative round's time goes on the GPU, MTP's catch-up and chain apart
  for n in 1 8; do
    timeout 200 python3 bench/spec_phases.py --model models/slotserve-demo.gguf --n $n --gen 64 \
      --compile --precompile --configs plain:off,ngram:auto,mtp:on,mtp:auto \
      --json "$OUT/c9_phases_n$n.json" > "$OUT/c9_phases_n$n.md" 2>&1
    tail -n 6 "$OUT/c9_phases_n$n.md"
  done ;;
s1)  # session 14, lease 1, carry .gpu_b: MLX, the 0.8B f16 and q8_0, kernel timelines
  source .gpu_b/install-mlx-cuda.sh
  LEASE_MODELS="qwen3.5-0.8b:f16 qwen3.5-0.8b:q8_0" source bench/lease/setup.sh \
    > "$OUT/s1_setup.txt" 2>&1
  for split in 1 auto; do
    SLOTSERVE_GEMV_STAGED_SPLIT=$split timeout 100 python3 bench/gpu_timeline.py --model-dir $M \
      --n 1,8 --json "$OUT/s1_timeline_split$split.json" --trace-dir /tmp/trace \
      > "$OUT/s1_timeline_split$split.md" 2>&1
    grep -v Warn "$OUT/s1_timeline_split$split.md" | head -34
  done ;;
s2)  # carry .gpu_w: the GPU tests of this session's kernels; A/B sweeps
  source bench/lease/setup.sh > "$OUT/s2_setup.txt" 2>&1
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_embed_cuda.py \
    tests/test_spec_mtp_chain.py > "$OUT/s2_tests.txt" 2>&1
  tail -n 8 "$OUT/s2_tests.txt"
  sweep s2_split 170 --n 8 --setting split1:ARGS=--overlap \
    --setting auto:SLOTSERVE_GEMV_STAGED_SPLIT=auto,ARGS=--overlap \
    --setting split1_b:ARGS=--overlap --setting auto_b:SLOTSERVE_GEMV_STAGED_SPLIT=auto,ARGS=--overlap
  sweep s2_embed 170 --quant q8_0 --n 1 --setting embed:ARGS=--overlap \
    --setting gathers:SLOTSERVE_FUSED_EMBED=0,ARGS=--overlap --setting embed_b:ARGS=--overlap \
    --setting gathers_b:SLOTSERVE_FUSED_EMBED=0,ARGS=--overlap ;;
p1)  # next lease, after c1 and c2 (LEASE_MODELS="qwen3.5-0.8b:f16" unless the 9B is wanted):
  # which vCPUs are the fast ones (session 14: a bimodal host; pinned to 0-7, fast 3 of 3)
  for cpus in 0-7 8-15 0-7 8-15; do
    taskset -c $cpus timeout 60 python3 bench/mlx_env_sweep.py --model-dir $M --gen 32 --n 8,32 \
      --json "$OUT/p1_cpus_$cpus.$RANDOM.json" --setting "cpus$cpus:ARGS=--overlap" \
      | grep "^| cpus" | tee -a "$OUT/p1_cpus.md"
  done ;;
p2)  # carry .gpu_llama .gpu_w: llama.cpp's build (-j15, ~4.5 min), the GPU tests left over
  source bench/lease/setup.sh > "$OUT/p2_setup.txt" 2>&1
  # first the staged kernel's (its staging loop was rewritten in session 14, not yet run on
  # a GPU, default path included), then the MTP chain's with the 1e-5 tolerance
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv_prologue_cuda.py \
    -k "ahead or model or staged" > "$OUT/p2_tests.txt" 2>&1
  tail -n 5 "$OUT/p2_tests.txt"
  timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_spec_mtp_chain.py \
    > "$OUT/p2_tests_mtp.txt" 2>&1
  tail -n 5 "$OUT/p2_tests_mtp.txt" ;;
p3)  # the suite pinned to the fast half (edit CPUS after p1)
  for i in $(seq 60); do [ -f /tmp/llama/rc ] && break; sleep 5; done; cat /tmp/llama/rc
  mkdir -p "$OUT/suite"
  OUT=$OUT/suite taskset -c ${CPUS:-0-7} timeout 570 python3 bench/gpu_suite.py --model-dir $M \
    --llama-batched-bench $L --wheels .gpu_w/wheels --budget-s 400 --big-needs-s 150 --reps 1 \
    --steps 32 --ahead > "$OUT/p3_suite.log" 2>&1
  tail -n 30 "$OUT/suite/gpu_suite.md" ;;
p4)  # the staged kernel's loads moved earlier (SLOTSERVE_GEMV_STAGE_AHEAD, _STAGED_UNROLL;
  # session 14, not run on a GPU): its GPU test, then N = 8 pinned, two passes, and a timeline
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_prologue_cuda.py \
    -k "ahead" > "$OUT/p4_tests.txt" 2>&1; tail -n 3 "$OUT/p4_tests.txt"
  taskset -c ${CPUS:-0-7} timeout 330 python3 bench/mlx_env_sweep.py --model-dir $M --gen 32 \
    --n 8 --json "$OUT/p4_sweep.json" --setting now:ARGS=--overlap \
    --setting ahead:SLOTSERVE_GEMV_STAGE_AHEAD=rows,ARGS=--overlap \
    --setting ahead_u2:SLOTSERVE_GEMV_STAGE_AHEAD=rows,SLOTSERVE_GEMV_STAGED_UNROLL=2,ARGS=--overlap \
    --setting ahead_u4:SLOTSERVE_GEMV_STAGE_AHEAD=rows,SLOTSERVE_GEMV_STAGED_UNROLL=4,ARGS=--overlap \
    --setting now_b:ARGS=--overlap --setting ahead_b:SLOTSERVE_GEMV_STAGE_AHEAD=rows,ARGS=--overlap \
    > "$OUT/p4_sweep.md" 2>&1; tail -n 8 "$OUT/p4_sweep.md"
  SLOTSERVE_GEMV_STAGE_AHEAD=rows SLOTSERVE_GEMV_STAGED_UNROLL=2 timeout 100 python3 \
    bench/gpu_timeline.py --model-dir $M --n 8 --json "$OUT/p4_timeline.json" --trace-dir /tmp/trace \
    > "$OUT/p4_timeline.md" 2>&1; grep -v Warn "$OUT/p4_timeline.md" | head -16 ;;
*)
  echo "usage: bash bench/lease/calls.sh c1|...|c9" >&2; exit 2 ;;
esac
