#!/usr/bin/env bash
# The next lease's calls, written before it starts (bench/lease/README.md): on the GPU
# machine, `bash bench/lease/calls.sh cN`, each call's output under $OUT (one file per step,
# each step under its own timeout, so a call cut short keeps what it measured).
#   c1  carry .gpu_a                 MLX part 1 to /tmp/keep
#   c2  carry .gpu_b                 MLX, models (.gpu_w does not fit beside .gpu_b: 64 MiB)
#   c4  -                            the suite unpinned, 0.8B and 9B (p3: pinned)
#   c9  -                            speculation's phases, N = 1, 8 (first run in session 15)
#   p1-p4                            session 14's plan (session 15 ran p2-p4; p1 never)
# Calls already run are in git history (session 13: c3-c8; session 14: s1, s2; session 15:
# c1, c2, p2, p4, c9, p3, r1; session 16: c1 and spec_phases runs, see PERFORMANCE.md).
# Next lease (session 18 plan): c1, c2 with LEASE_MODELS=qwen3.5-0.8b:f16; the GDN mixer's
# warps in tokens/s — mlx_env_sweep.py --n 1,8 --setting w8:SLOTSERVE_GDN_WARPS=8,ARGS=--overlap
# --setting w16:SLOTSERVE_GDN_WARPS=16,... --setting w32:... (twice, alternated); the whole
# tests/test_gdn_mixer_cuda.py (its 32-warp cases have not run: give it ~300 s); spec_phases
# at N = 8 on held-out ids (tools/demo_model's ids.npz) for the busy rate on real text.
# Session 17 (~900 s): c1 (model out of the tree, .gpu_w with .gpu_a), then i9 (carry .gpu_b)
# with NS=8 GEN=128 T=560 CONFIGS=plain:off,mtp:auto,mtp:auto:free,ngram:auto,ngram:auto:free
# (the controller's credit against none, in one process), then c9 with NS=1, the same.
# Session 17, second lease (~1,100 s): c1; i9 with NS=8 GEN=128 ROUNDS=3
# CONFIGS=plain:off,mtp:auto,ngram:auto,ngram:on (the host trims, busy rates); p2 with
# LEASE_MODELS=qwen3.5-0.8b:f16 P2_TESTS=0 (carry .gpu_llama .gpu_w); p3 (its wait alone
# first if the build is not done), CPUS=0-7 REPS=1.
# Session 16's plan (~1,200 s): c1 (move models/slotserve-demo.gguf out of the tree for c1 only;
# .gpu_w may ride with .gpu_a there); c2 with LEASE_MODELS="qwen3.5-0.8b:f16" (~60 s); c9
# with NS="1 8" GEN=128, two rounds alternating (session 16: the host changed speed
# between runs; ~560 s for both N: give the call 590 s, or one N per call); p2 with P2_TESTS=0 (llama.cpp's build);
# p3 with REPS=2 (the suite was not run in session 16; session 15's N = 8 read 1.29x of
# llama.cpp, the target 1.3x).
# Next lease (session 19 plan): m1, m2 (its timeline on idle cores this time: after the build,
# for comparable host figures), then several before/after pairs at N = 8 pinned (m3/m5 style)
# of whatever cuts launches next; the suite (m4) twice; the rest of the 1-warp mixer cases;
# tokens/s of 3c71e16 + 83d4416 (gather-free outputs, layer 0's norm: 137 kernels a step);
# the 8-row gate|up product (224 blocks of split 1, 16 us at ~0.9 TB/s): a timeline with
# SLOTSERVE_GEMV_STAGED_SPLIT=2 against auto.
# Session 18, first lease (~12 min): l1 (carry .gpu_a .gpu_w; models/slotserve-demo.gguf moved
# out of the tree for it), then at once l2 (carry .gpu_b): MLX, the 0.8B, timelines with the
# host's CUDA API calls at N = 1, 8 (and at N = 8 with MLX_MAX_OPS_PER_BUFFER=1000); l3: the
# mixer's warps and MLX's commit interval in tokens/s (pinned, N = 1, 8), the 32-warp tests.
# Session 18, second lease (~14 min): m1 (as l1), m2 (carry .gpu_b .gpu_llama): MLX, the
# 0.8B, llama.cpp's build started; beside it the GPU tests of this session's kernels and
# pool store, timelines at N = 8, 64 on 4 cores the build leaves; m3 (carry .gpu_before: a
# `git archive` of 56f9f7b, before the vectorized stack and the K/V store): before / after
# in turn, decode-ahead, pinned, N = 8 and 64, twice; m4: the suite (p3).
# Session 19 ran two leases: l1, q2 (the first kernel: its timelines; tests cut by the limit),
# then l1, q2, q3, q4, q4 again (SNS=1,8 into $OUT/b): PERFORMANCE.md "Session 19".
# Next lease (session 20 plan; ~30 min is more than one lease: take them in this order):
#  1. l1 (carry .gpu_a .gpu_w; models/slotserve-demo.gguf moved out of the tree, ~50 s).
#  2. TL=0 q2 (carry .gpu_b .gpu_llama, ~5 min): MLX, the 0.8B, llama.cpp's build; the GPU
#     tests of everything built after session 19's leases (tensor-core x loads, the
#     one-kernel decode attention, the grouped stacks: TK's default selects them).
#     If the decode attention's and the grouped stacks' tests pass, make both the default.
#     Not yet run on a GPU with the tensor-core products on (the default since session 19):
#     the rest of tests/test_gemv_prologue_cuda.py, test_gemv_cuda.py and the bf16 model tests
#     elsewhere (TK="not tensor_core" on those files, ~4 min, beside step 3 if cores allow).
#  3. Q5="base: u2:SLOTSERVE_GEMV_MMA_UNROLL=2 u8:SLOTSERVE_GEMV_MMA_UNROLL=8
#     s8:SLOTSERVE_GEMV_STAGED_SPLIT=8 s16:SLOTSERVE_GEMV_STAGED_SPLIT=16" AHEAD=0 q5 (~5 min):
#     the tensor-core products' kernel times, registers and occupancy by tuning.
#  4. Q5="staged:SLOTSERVE_GEMV_MMA_DIRECT=0 both:SLOTSERVE_ATTENTION_DECODE=1,SLOTSERVE_STACK_GROUPS=1"
#     q5 (~4 min): staged vs direct x; launches a step 137 -> 128; and the decode-ahead
#     timeline (--ahead) at N = 1, 8, where the GPU waits for the host as served.
#  5. q6 (~4 min): the host's two modes against the CPUs' topology.
#  6. q3 / q4 as time allows (tokens/s A/B with graph-building ms; the suite).
#  7. NS=1 CONFIGS=plain:off,mtp:on,mtp:auto ROUNDS=2 SPEC_ARGS="--dtype bf16 --dense" c9, the
#     demo model back in the tree (no carry): MTP at N = 1 as the daemon runs it on a GPU
#     (bf16; dense: its q8_0 matrices dequantized, so the 5-row verify steps take the
#     tensor-core products). Every earlier spec_phases run computed in float32 with the
#     q8_0 matrices quantized (best so far 1.44x plain; the target 1.6x): run both.
# Session 20 ran one lease: l1, TL=0 q2, q5 (tunings), q5 (staged, both; --ahead), a
# tokens/s sweep of both, c9 three ways, q4 (SNS=1,8): PERFORMANCE.md "Session 20".
# Session 21 ran l1, r2, r3, r4 (bench/results/h200_v28; r2-r4 in git history at 8278ea1,
# their pieces switch removed since): decode-ahead's store 25-30 us a
# launch (not 465), the plain loop's gather still 144 us, pieces moved it into the stack.
# Session 21's second lease: l1, t2 (tests and timelines of launch-parameter inputs), q4
# (SNS=1,8,32 TS=480), t4 and MTP runs by hand (t2-t4 are in git history at 8278ea1; the
# launch-parameter inputs were removed after it: the wait is the step's first kernel's,
# whatever it reads). PERFORMANCE.md "Session 21".
# Next lease (session 22 plan, ~25 min; fire the calls back to back, the machine goes after
# ~30 s idle):
#  1. l1 (carry .gpu_a .gpu_w; models/slotserve-demo.gguf moved out of the tree, ~80 s held).
#  2. u2 (carry .gpu_b .gpu_llama, ~5 min): MLX, the 0.8B, llama.cpp's build started; the GPU
#     tests of SLOTSERVE_GEMV_MMA_BLOCKS (the tensor-core tests, both settings) and of
#     SLOTSERVE_ARGMAX; timelines of the first kernel's wait: ids from launch parameters and
#     read-back arrays pinned (is it recycled managed memory? params_pin should lose it, pin
#     alone should not), and SLOTSERVE_HOST_POOL=1 (ids both ways as 8-byte arrays: the fix
#     it would suggest, built in session 21).
#  3. u2b (~4 min): a wake kernel first; blocks sharing K, plain and decode-ahead (+ argmax).
#  4. u3 (~5 min): tokens/s, decode-ahead, one block vs blocks vs both, N = 1, 8, 32.
#  5. If blocks / argmax won and their tests passed: export them and run q4 (carry .gpu_w;
#     SNS=1,8,32 TS=480) — the suite (N = 8 read 1.26x llama.cpp ahead in session 21; the
#     target is 1.3x); then make them the default after the lease.
#  6. PROMPT=4096 SNS=1,8 q4 (with SLOTSERVE_ATTENTION_SPLIT=128 exported if u2b's long
#     timeline showed it faster): decode beside llama.cpp at a long context, never run yet.
# If params_pin lost the wait: build read-backs and small inputs through MLX's small-block
# pool (8-byte arrays, which the GPU maps where they lie) or otherwise out of the general
# buffer cache, in the engine.
# Session 22 ran l1, u2, u2b (both in git history at 29ce9f2), a tokens/s sweep by hand (u3's
# settings plus the pool), q4 with
# all four switches (SNS=1,8; the 4,096-token suite stopped in mlx-lm's prefill: fixed
# since), another sweep at N = 8: PERFORMANCE.md "Session 22" (bench/results/h200_v29).
# Next lease (session 23 plan, ~25 min; the defaults are now split 128, blocks auto, pool on):
#  1. l1 (carry .gpu_a .gpu_w; models/slotserve-demo.gguf out of the tree).
#  2. v2 (carry .gpu_b .gpu_llama, ~6 min): MLX, the 0.8B, llama.cpp's build; the argmax
#     tests (its NaN fix) and the tensor-core / attention / pool tests under the defaults;
#     timelines at N = 8 of the defaults, plain and decode-ahead.
#  2b. v2b (~5 min): decode-ahead with session 21's defaults (is decode-ahead's copy_v wait,
#     4 x 35 us, gone with the pool?) and with the argmax; sampled rows (--sampled: uniforms
#     and the finite check's flag through 8-byte arrays; and SLOTSERVE_HOST_POOL=0 as before).
#  3. v3 (~5 min): tokens/s, decode-ahead, session 21's defaults (old) against today's
#     (new) and today's + argmax, alternated three times, N = 8, 32 — the host's two speeds
#     need pairs.
#  4. q4 (carry .gpu_w; SNS=1,8,32 TS=480): the suite under the defaults.
#  5. PROMPT=4096 SNS=1,8 q4 (mlx-lm now prefills in pieces of 512): the long context.
#  6. If time is left: the whole GPU test suite under the new defaults (never run with split
#     attention, blocks sharing K and the host pool all on: `taskset -c 11-15 python3 -m
#     pytest -q tests -k "cuda or gpu"`, ~8 min, beside step 4 if cores allow).
# Session 23 ran l1, v2, v2b, v3 (two of three rounds), q4 (SNS=1,8,32 TS=350), q4 with
# PROMPT=4096 SNS=1,8, and 235 s of the GPU tests: PERFORMANCE.md "Session 23" (h200_v30).
# Next lease (session 24 plan, ~25 min): make .gpu_old first (on this machine:
#   mkdir -p .gpu_old && git archive 1fd5c45 engine bench/harness.py | tar -x -C .gpu_old &&
#   cp bench/sampling_speed.py .gpu_old/bench/ — sampling as it was, for w3).
#  1. l1 (carry .gpu_a .gpu_w; the demo model out of the tree).
#  2. w2 (carry .gpu_b .gpu_llama, ~6 min): MLX, the 0.8B, llama.cpp's build; the sampling
#     tests on the GPU (tests/test_sampling.py: every path against the float64 rule, the
#     compiled draws); the --sampled timeline (top-k 40: the candidates path; session 23's
#     2.78 ms of kernels, 199 launches) and the plain one beside it.
#  3. w3 (carry .gpu_old, ~5 min): bench/sampling_speed.py on the GPU, before (.gpu_old) and
#     after, N = 1, 8, 32, twice alternated; then tokens/s at N = 32, SLOTSERVE_HOST_POOL=0
#     and SLOTSERVE_ATTENTION_SPLIT=0 against the defaults, alternated (session 23: the new
#     defaults lost at N = 32 twice; 128-token rows split in two blocks a head).
#     Also: how long a daemon's first sampled step waits on a fresh process (the draws' fused
#     kernels compile; `precompile_draws` runs them at precompile) — a timeline's warm-up.
#  4. w4, w4 again (~9 min each): the GPU tests not yet run under session 22's defaults
#     (422 of 487: TK selects the files; the first 65 passed in session 23, one since fixed).
# Session 24 ran l1, w2, w3, XD=8 w4 (all 485 GPU tests in 426 s), then l1, w5, the --cold
# run alone (w6) and timelines at N = 16 and 8 by hand: PERFORMANCE.md "Session 24"
# (h200_v31). Make .gpu_old with transport/ (its harness imports it):
#   git archive 1fd5c45 engine transport bench/harness.py | tar -x -C .gpu_old
# Next lease (session 25 plan, ~30 min): l1; then y2 (carry .gpu_b, ~6 min): MLX, the 0.8B,
# the GPU tests of the 16-row tensor-core products (db1c29c, SLOTSERVE_GEMV_MMA_ROWS=16, off
# until they pass) and of the radix select (SLOTSERVE_TOPK=1, off), timelines at N = 16
# with and without the first, the sampled one at N = 8 after b245151 (the partition reads
# the logits: the 145 us divide should go) and with the radix select; y3 (~5 min):
# sampling_speed with and without the radix select, tokens/s at 12 and 16 rows both ways,
# twice. Where tests pass and a switch gains: make it the default, then
# XD=8 w4 (~7 min: every GPU test under the new defaults). Then speculation at 8 slots,
# whose verify rows of 2 tokens make 16-row products: NS=8 ROUNDS=2
# CONFIGS=plain:off,mtp:on,ngram:auto SPEC_ARGS="--dtype bf16 --dense" c9, the demo model in
# the tree, with SLOTSERVE_GEMV_MMA_ROWS=16 and without (~5 min each).
# Session 19's plan (~22 min, one lease): q1 (as l1: carry .gpu_a .gpu_w, the demo model out of the
# tree), q2 (carry .gpu_b .gpu_llama): MLX, the 0.8B, llama.cpp's build started; the tensor-core
# staged products' GPU tests (cores 11-15 beside the build), timelines at N = 8 with them on,
# off, and on for the plain products too; q3: tokens/s at N = 8, the three in turn, twice
# (pinned, decode-ahead); q4 (carry .gpu_w): the suite at N = 1, 8, 32 without the 9B.
set -u
M=/tmp/models
L=/tmp/llama/llama.cpp/build/bin/llama-batched-bench
# session 21's defaults, against which session 22's are timed (v2b, v3)
OLD=SLOTSERVE_GEMV_MMA_BLOCKS=1,SLOTSERVE_HOST_POOL=0,SLOTSERVE_ATTENTION_SPLIT=0
export PYTHONPATH=/tmp/site:$PWD

# mlx_env_sweep.py's --setting flags for NAME:SETTING... in turn, twice (NAME_1, NAME_2):
# the settings compared alternate, against the host's changes of speed
alternated() {
  local s="" i v
  for i in 1 2; do for v in "$@"; do s="$s --setting ${v%%:*}_$i:${v#*:}"; done; done
  echo "$s"
}
# tokens/s of the 0.8B at the rows NS under alternated settings, into $OUT/NAME_sweep.*
sweep() {
  local name=$1 ns=$2; shift 2
  taskset -c 0-7 timeout ${TS:-200} python3 bench/mlx_env_sweep.py --model-dir $M \
    --preset qwen3.5-0.8b --quant f16 --gen 32 --n $ns --json "$OUT/${name}_sweep.json" \
    $(alternated "$@") > "$OUT/${name}_sweep.md" 2>&1
  tail -n 14 "$OUT/${name}_sweep.md"
}
# bench/sampling_speed.py in this tree and in .gpu_old's, alternated, into $OUT/NAME_sampling.md
sampling_before_after() {
  local side dir
  for side in new old new old; do
    if [ $side = old ]; then dir=.gpu_old; else dir=.; fi
    (cd $dir && PYTHONPATH=/tmp/site taskset -c 0-7 timeout 70 python3 bench/sampling_speed.py \
      --vocab 248320 --n 1,8,32 --number 3 --repeat 3) > "/tmp/$1_$side.md" 2>&1
    { echo "== $side"; cat "/tmp/$1_$side.md"; } >> "$OUT/$1_sampling.md"
  done
  grep -E "^==|\| 8 \|" "$OUT/$1_sampling.md" | head -20
}

case ${1:-} in
c1)
  mkdir -p /tmp/keep && cp -r .gpu_a/. /tmp/keep/ && ls /tmp/keep ;;
l1)
  mkdir -p /tmp/keep && cp -r .gpu_a/. /tmp/keep/ && ls /tmp/keep
  for w in .gpu_w/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; ls /tmp/site | wc -l ;;
l2)  # MLX, the 0.8B; kernel and host timelines (gpu_timeline's API columns are new)
  source .gpu_b/install-mlx-cuda.sh > "$OUT/l2_install.txt" 2>&1; tail -n 2 "$OUT/l2_install.txt"
  export PYTHONPATH=/tmp/site:$PWD
  T=$(date +%s); LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > "$OUT/l2_setup.txt" 2>&1
  echo "setup $(( $(date +%s) - T )) s"
  timeout 150 python3 bench/gpu_timeline.py --model-dir $M --n 1,8 --json "$OUT/tl.json" \
    --trace-dir /tmp/trace > "$OUT/tl.md" 2>&1; grep -v -i warn "$OUT/tl.md" | head -70
  MLX_MAX_OPS_PER_BUFFER=1000 timeout 100 python3 bench/gpu_timeline.py --model-dir $M --n 8 \
    --json "$OUT/tl_ops1k.json" --trace-dir /tmp/trace > "$OUT/tl_ops1k.md" 2>&1
  grep -v -i warn "$OUT/tl_ops1k.md" | head -3 ;;
l3)  # tokens/s: the mixer's warps a block, MLX's ops between commits (decode-ahead, pinned)
  export PYTHONPATH=/tmp/site:$PWD
  taskset -c ${CPUS:-0-7} timeout 330 python3 bench/mlx_env_sweep.py --model-dir $M --gen 32 \
    --n 1,8 --json "$OUT/l3_sweep.json" --setting w16:ARGS=--overlap \
    --setting w8:SLOTSERVE_GDN_WARPS=8,ARGS=--overlap --setting w32:SLOTSERVE_GDN_WARPS=32,ARGS=--overlap \
    --setting ops1k:MLX_MAX_OPS_PER_BUFFER=1000,ARGS=--overlap > "$OUT/l3_sweep.md" 2>&1
  tail -n 10 "$OUT/l3_sweep.md"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gdn_mixer_cuda.py -k 32 \
    > "$OUT/l3_tests.txt" 2>&1; tail -n 4 "$OUT/l3_tests.txt" ;;
f2)  # session 18's last lease (~300 s; after l1): timelines after every change, then the
  # fused-path model tests of the layer-0 fold and the gather-free outputs
  source .gpu_b/install-mlx-cuda.sh > "$OUT/f2_install.txt" 2>&1; tail -n 1 "$OUT/f2_install.txt"
  export PYTHONPATH=/tmp/site:$PWD
  LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > "$OUT/f2_setup.txt" 2>&1
  timeout 95 python3 bench/gpu_timeline.py --model-dir $M --n 1,8 --json "$OUT/f2_tl.json" \
    --trace-dir /tmp/trace > "$OUT/f2_tl.md" 2>&1
  grep -E "^N=|rms_norm|gather|CUDA API|cuLaunch" "$OUT/f2_tl.md" | head -16
  timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_prologue_cuda.py -k model \
    > "$OUT/f2_tests.txt" 2>&1; tail -n 2 "$OUT/f2_tests.txt"
  timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_batching.py -k "gather or padded" \
    > "$OUT/f2_tests_b.txt" 2>&1; tail -n 2 "$OUT/f2_tests_b.txt" ;;
tl)  # timelines at N = TN (8) of R2's entries, name:SETTING[,SETTING]:ARGS[,ARG] ("-": the
  # plain loop)
  export PYTHONPATH=/tmp/site:$PWD
  for v in $R2; do
    IFS=: read name setting loop <<< "$v"; [ "$loop" = - ] && loop=
    env ${setting//,/ } taskset -c 0-7 timeout ${TR:-90} python3 bench/gpu_timeline.py \
      --model-dir $M --preset qwen3.5-0.8b --quant f16 --n ${TN:-8} ${loop//,/ } --warmup 3 --steps 6 \
      --json "$OUT/tl_$name.json" --trace-dir /tmp/trace > "/tmp/tl_$name.md" 2>&1
    # (a call brings back 8 files at most: the tables go into one)
    { echo "== $name"; grep -v -i warn "/tmp/tl_$name.md"; } >> "$OUT/tl_all.md"
    echo "== $name"; grep -E "^N=|scatter|gather|copy_v|stack|host_values" "/tmp/tl_$name.md" \
      | cut -c1-150
  done ;;
v2)  # carry .gpu_b .gpu_llama, after l1 (session 23 plan, ~6 min): MLX, the 0.8B, llama.cpp's
  # build; the GPU tests of session 22's defaults and the argmax's NaN fix; timelines
  source .gpu_b/install-mlx-cuda.sh > /tmp/v2_install.txt 2>&1; tail -n 1 /tmp/v2_install.txt
  export PYTHONPATH=/tmp/site:$PWD
  LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > /tmp/v2_setup.txt 2>&1
  taskset -c 11-15 timeout ${TT:-200} python3 -m pytest -q -p no:cacheprovider \
    tests/test_argmax_cuda.py tests/test_host_pool_cuda.py tests/test_attention_cuda.py \
    tests/test_gemv_prologue_cuda.py -k "argmax or auto or shared_by_blocks or pieces or both" \
    > "$OUT/v2_tests.txt" 2>&1
  tail -n 3 "$OUT/v2_tests.txt"
  R2=${V2:-new::- new_ahead::--ahead} bash "$0" tl ;;
v2b)  # after v2 (~5 min): the rest of the timelines
  R2=${V2B:-old_ahead:$OLD:--ahead argmax_ahead:SLOTSERVE_ARGMAX=1:--ahead \
      sampled::--sampled sampled_nopool:SLOTSERVE_HOST_POOL=0:--sampled} bash "$0" tl ;;
v3)  # after v2 (~5 min): tokens/s, decode-ahead, session 21's defaults against today's, in turn
  export PYTHONPATH=/tmp/site:$PWD
  S=""; for i in 1 2 3; do
    S="$S --setting old_$i:$OLD,ARGS=--overlap --setting new_$i:ARGS=--overlap"
    S="$S --setting arg_$i:SLOTSERVE_ARGMAX=1,ARGS=--overlap"; done
  taskset -c 0-7 timeout ${TS:-290} python3 bench/mlx_env_sweep.py --model-dir $M \
    --preset qwen3.5-0.8b --quant f16 --gen 32 --n ${TN:-8,32} --json "$OUT/v3_sweep.json" $S \
    > "$OUT/v3_sweep.md" 2>&1; tail -n 18 "$OUT/v3_sweep.md" ;;
q2)  # MLX, the 0.8B, llama.cpp's build; the tensor-core products' tests and timelines
  source .gpu_b/install-mlx-cuda.sh > "$OUT/q2_install.txt" 2>&1; tail -n 1 "$OUT/q2_install.txt"
  export PYTHONPATH=/tmp/site:$PWD
  T=$(date +%s); LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > "$OUT/q2_setup.txt" 2>&1
  echo "setup $(( $(date +%s) - T )) s"
  taskset -c 11-15 timeout ${TT:-230} python3 -m pytest -q -p no:cacheprovider \
    tests/test_gemv_prologue_cuda.py tests/test_attention_cuda.py \
    tests/test_swiglu_stack_cuda.py -k "${TK:-tensor_core or bf16_model or decode or groups}" \
    > "$OUT/q2_tests.txt" 2>&1
  tail -n 12 "$OUT/q2_tests.txt"
  # prepare's source was rebuilt from a snippet it shares with the decode kernel (session
  # 19's review): the whole attention file
  taskset -c 11-15 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_cuda.py \
    > "$OUT/q2_tests_attention.txt" 2>&1; tail -n 3 "$OUT/q2_tests_attention.txt"
  [ "${TL:-1}" = 1 ] || exit 0
  for v in mma:1:0 fma:0:0 mmad:1:mma; do
    IFS=: read name mma dense <<< "$v"
    SLOTSERVE_GEMV_MMA=$mma SLOTSERVE_FUSED_GEMV_DENSE=$dense taskset -c 11-15 timeout 100 \
      python3 bench/gpu_timeline.py --model-dir $M --n 8 --json "$OUT/q2_tl_$name.json" \
      --trace-dir /tmp/trace > "$OUT/q2_tl_$name.md" 2>&1
    echo "== $name"; grep -E "^N=|gemv|nvjet" "$OUT/q2_tl_$name.md" | head -8
  done ;;
q5)  # the tensor-core products' tunings: kernel times, registers, occupancy at N = 8
  export PYTHONPATH=/tmp/site:$PWD
  # (each timeline ~40-60 s with its kernels' builds: nine overrun one call — pass Q5 subsets)
  for v in ${Q5:-base: u2:SLOTSERVE_GEMV_MMA_UNROLL=2 u8:SLOTSERVE_GEMV_MMA_UNROLL=8 \
      s8:SLOTSERVE_GEMV_STAGED_SPLIT=8 s16:SLOTSERVE_GEMV_STAGED_SPLIT=16 staged:SLOTSERVE_GEMV_MMA_DIRECT=0 \
      attn0:SLOTSERVE_ATTENTION_DECODE=0}; do
    name=${v%%:*}; setting=${v#*:}
    env ${setting//,/ } timeout 90 python3 bench/gpu_timeline.py --model-dir $M --n 8 \
      --json "$OUT/q5_tl_$name.json" --trace-dir /tmp/trace > "$OUT/q5_tl_$name.md" 2>&1
    echo "== $name"; grep -E "^N=|gemv" "$OUT/q5_tl_$name.md" | head -5
  done
  [ "${AHEAD:-1}" = 1 ] || exit 0
  # decode-ahead, as served: where the GPU waits for the host (pinned like the tokens/s runs)
  taskset -c ${CPUS:-0-7} timeout 120 python3 bench/gpu_timeline.py --model-dir $M --n 1,8 --ahead \
    --json "$OUT/q5_tl_ahead.json" --trace-dir /tmp/trace > "$OUT/q5_tl_ahead.md" 2>&1
  grep -E "^N=" "$OUT/q5_tl_ahead.md" ;;
q6)  # the host's two modes: are they two threads on one physical core? (~4 min)
  export PYTHONPATH=/tmp/site:$PWD
  lscpu -e > "$OUT/q6_lscpu.txt" 2>&1; cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list \
    > "$OUT/q6_siblings.txt" 2>&1; head -n 20 "$OUT/q6_lscpu.txt"
  # one logical CPU of each of the first 8 physical cores, from the sibling lists
  ONE=$(for f in /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list; do cat $f; done \
    | sort -u -t, -k1,1n | cut -d, -f1 | cut -d- -f1 | sort -n | head -n 8 | paste -sd, -)
  echo "one a core: $ONE"
  for r in 1 2 3; do
    for cpus in 0-7 "$ONE"; do
      taskset -c $cpus timeout 80 python3 bench/mlx_env_sweep.py --model-dir $M --gen 32 --n 8 \
        --json "$OUT/q6_${r}_${cpus//,/_}.json" --setting "cpus${cpus//,/_}_$r:ARGS=--overlap" 2>/dev/null \
        | grep "^| cpus" | tee -a "$OUT/q6_pins.md"
    done
  done ;;
q3)  # tokens/s at N = 8: tensor cores on, off, on for the plain products too; in turn, 3x
  for i in $(seq 40); do [ -f /tmp/llama/rc ] && break; sleep 5; done; cat /tmp/llama/rc
  taskset -c ${CPUS:-0-7} timeout 560 python3 bench/mlx_env_sweep.py --model-dir $M --gen 32 \
    --n ${NS:-8} --json "$OUT/q3_sweep.json" \
    --setting mma_1:ARGS=--overlap --setting fma_1:SLOTSERVE_GEMV_MMA=0,ARGS=--overlap \
    --setting mmad_1:SLOTSERVE_FUSED_GEMV_DENSE=mma,ARGS=--overlap \
    --setting fma_2:SLOTSERVE_GEMV_MMA=0,ARGS=--overlap --setting mma_2:ARGS=--overlap \
    --setting mmad_2:SLOTSERVE_FUSED_GEMV_DENSE=mma,ARGS=--overlap \
    > "$OUT/q3_sweep.md" 2>&1; tail -n 14 "$OUT/q3_sweep.md" ;;
q4)  # carry .gpu_w: the suite at N = 1, 8, 32 (0.8B only), pinned, one sample
  for i in $(seq 60); do [ -f /tmp/llama/rc ] && break; sleep 5; done; cat /tmp/llama/rc
  mkdir -p "$OUT/suite"
  OUT=$OUT/suite taskset -c ${CPUS:-0-7} timeout ${TS:-500} python3 bench/gpu_suite.py --model-dir $M \
    --llama-batched-bench $L --wheels .gpu_w/wheels --ns ${SNS:-1,8,32} --budget-s 1 \
    --big-needs-s 1000 --reps 1 --steps 32 --ahead --prompt ${PROMPT:-128} > "$OUT/q4_suite.log" 2>&1
  tail -n 30 "$OUT/suite/gpu_suite.md" ;;
m1)
  bash "$0" l1 ;;
m2)
  source .gpu_b/install-mlx-cuda.sh > "$OUT/m2_install.txt" 2>&1; tail -n 1 "$OUT/m2_install.txt"
  export PYTHONPATH=/tmp/site:$PWD
  T=$(date +%s); LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > "$OUT/m2_setup.txt" 2>&1
  echo "setup $(( $(date +%s) - T )) s"
  ids=$(timeout 60 python3 -m pytest --co -q -p no:cacheprovider tests/test_gdn_mixer_cuda.py \
    | grep '\[1-' | head -24)
  taskset -c 11-15 timeout 150 python3 -m pytest -q -p no:cacheprovider \
    "tests/test_swiglu_stack_cuda.py" tests/test_pool.py -k "stack or scatter_per_pool or recurrent" \
    > "$OUT/m2_tests.txt" 2>&1; tail -n 3 "$OUT/m2_tests.txt"
  taskset -c 11-15 timeout 120 python3 -m pytest -q -p no:cacheprovider $ids \
    > "$OUT/m2_tests_w1.txt" 2>&1; tail -n 3 "$OUT/m2_tests_w1.txt"
  taskset -c 11-15 timeout 150 python3 bench/gpu_timeline.py --model-dir $M --n 8,64 \
    --json "$OUT/m2_tl.json" --trace-dir /tmp/trace > "$OUT/m2_tl.md" 2>&1
  grep -E "^N=|stack|scatter|copy_v|arange|CUDA API|cuLaunch" "$OUT/m2_tl.md" | head -30 ;;
m3)  # before / after, decode-ahead, pinned, N = 8 and 64, in turn, twice
  export PYTHONPATH=/tmp/site:$PWD
  for r in 1 2; do
    for v in before after; do
      dir=.; [ $v = before ] && dir=.gpu_before
      (cd $dir && taskset -c ${CPUS:-0-7} timeout 140 python3 bench/mlx_env_sweep.py --model-dir $M \
        --gen 32 --n 8,64 --json "$OUT/m3_${v}_$r.json" --setting "${v}_$r:ARGS=--overlap" \
        2>/dev/null | grep "^| ${v}" | tee -a "$OUT/m3_ab.md")
    done
  done ;;
m4)
  bash "$0" p3 ;;
c2)
  source .gpu_b/install-mlx-cuda.sh
  T=$(date +%s); source bench/lease/setup.sh > "$OUT/c2_setup.txt" 2>&1
  echo "setup $(( $(date +%s) - T )) s"; ls -la $M ;;
c4)
  cat /tmp/llama/rc; mkdir -p "$OUT/suite"
  OUT=$OUT/suite timeout 570 python3 bench/gpu_suite.py --model-dir $M --llama-batched-bench $L \
    --wheels .gpu_w/wheels --budget-s 400 --big-needs-s 150 --reps 1 --steps 32 --ahead \
    > "$OUT/c4_suite.log" 2>&1
  tail -n 30 "$OUT/suite/gpu_suite.md" ;;
i9)  # session 17, after c1 (carry .gpu_b): MLX installed, then c9 in the same call
  source .gpu_b/install-mlx-cuda.sh > "$OUT/i9_install.txt" 2>&1; tail -n 2 "$OUT/i9_install.txt"
  bash "$0" c9 ;;
c9)  # where a speculative round's time goes on the GPU, MTP's catch-up and chain apart
  for n in ${NS:-1 8}; do
    timeout ${T:-280} python3 bench/spec_phases.py --model models/slotserve-demo.gguf --n $n --gen ${GEN:-64} \
      --compile --precompile --configs ${CONFIGS:-plain:off,ngram:auto,mtp:on,mtp:auto} --rounds ${ROUNDS:-2} --trace \
      ${SPEC_ARGS:-} \
      --json "$OUT/c9_phases_n$n.json" > "$OUT/c9_phases_n$n.md" 2>&1
    tail -n 6 "$OUT/c9_phases_n$n.md"
  done ;;
p1)  # next lease, after c1 and c2:
  # which vCPUs are the fast ones (session 14: a bimodal host; pinned to 0-7, fast 3 of 3)
  for cpus in 0-7 8-15 0-7 8-15; do
    taskset -c $cpus timeout 60 python3 bench/mlx_env_sweep.py --model-dir $M --gen 32 --n 8,32 \
      --json "$OUT/p1_cpus_$cpus.$RANDOM.json" --setting "cpus$cpus:ARGS=--overlap" \
      | grep "^| cpus" | tee -a "$OUT/p1_cpus.md"
  done ;;
p2)  # carry .gpu_llama .gpu_w: llama.cpp's build (-j15, ~4.5 min), the GPU tests left over
  source bench/lease/setup.sh > "$OUT/p2_setup.txt" 2>&1
  [ "${P2_TESTS:-1}" = 0 ] && exit 0
  # first the staged kernel's (its staging loop was rewritten in session 14; 38 passed in
  # session 15 before the limit), then the MTP chain's with the 1e-5 tolerance (7 passed)
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
    --llama-batched-bench $L --wheels .gpu_w/wheels --budget-s 400 --big-needs-s 150 --reps ${REPS:-1} \
    --steps 32 --ahead > "$OUT/p3_suite.log" 2>&1
  tail -n 30 "$OUT/suite/gpu_suite.md" ;;
p4)  # the staged kernel's loads moved earlier (SLOTSERVE_GEMV_STAGE_AHEAD, _STAGED_UNROLL;
  # session 14; p2 runs its GPU tests): N = 8 pinned, two passes, and a timeline
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
w2)  # carry .gpu_b .gpu_llama, after l1 (session 24 plan): MLX, the 0.8B, llama.cpp's build;
  # the sampling tests on the GPU; timelines of a sampled and a plain step
  source .gpu_b/install-mlx-cuda.sh > /tmp/w2_install.txt 2>&1; tail -n 1 /tmp/w2_install.txt
  export PYTHONPATH=/tmp/site:$PWD
  LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > /tmp/w2_setup.txt 2>&1
  taskset -c 11-15 timeout ${TT:-150} python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_sampling.py > "$OUT/w2_tests.txt" 2>&1
  tail -n 4 "$OUT/w2_tests.txt"
  R2=${W2:-sampled::--sampled plain::-} bash "$0" tl ;;
w3)  # carry .gpu_old, after w2: sampling before / after on the GPU; the pool at 32 rows
  sampling_before_after w3
  sweep w3 32 pool:ARGS=--overlap nopool:SLOTSERVE_HOST_POOL=0,ARGS=--overlap \
    nosplit:SLOTSERVE_ATTENTION_SPLIT=0,ARGS=--overlap
  # a fresh process's first sampled draws, with and without precompile_draws
  taskset -c 0-7 timeout 90 python3 bench/sampling_speed.py --vocab 248320 --cold \
    > "$OUT/w3_cold.md" 2>&1; cat "$OUT/w3_cold.md" ;;
w5)  # carry .gpu_b .gpu_old, after l1 on a fresh machine (session 24's second call set):
  # the sampling tests that w2's limit cut (a per-test traceback past 60 s), the two test
  # fixes, the cold draws after the precompile fix; sampling before/after; the host pool's
  # count limit (16) against no pool at 8, 16 and 32 rows
  source .gpu_b/install-mlx-cuda.sh > /tmp/w5_install.txt 2>&1; tail -n 1 /tmp/w5_install.txt
  export PYTHONPATH=/tmp/site:$PWD
  LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > /tmp/w5_setup.txt 2>&1
  (taskset -c 11-15 timeout 300 python3 -m pytest -q -p no:cacheprovider -rf --durations=12 \
    -o faulthandler_timeout=60 tests/test_sampling.py tests/test_host_pool_cuda.py \
    tests/test_step_inputs.py tests/test_gemv_prologue_cuda.py -k "not prologue_cuda or loads_ahead" \
    > "$OUT/w5_tests.txt" 2>&1) &
  taskset -c 0-7 timeout 90 python3 bench/sampling_speed.py --vocab 248320 --cold \
    > "$OUT/w5_cold.md" 2>&1; cat "$OUT/w5_cold.md"
  sampling_before_after w5
  sweep w5 8,16,32 pool16:ARGS=--overlap nopool:SLOTSERVE_HOST_POOL=0,ARGS=--overlap
  wait; tail -n 16 "$OUT/w5_tests.txt" ;;
y2)  # carry .gpu_b, after l1 (session 25 plan): the 16-row tensor-core products
  source .gpu_b/install-mlx-cuda.sh > /tmp/y2_install.txt 2>&1; tail -n 1 /tmp/y2_install.txt
  export PYTHONPATH=/tmp/site:$PWD
  LEASE_MODELS=qwen3.5-0.8b:f16 source bench/lease/setup.sh > /tmp/y2_setup.txt 2>&1
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rf -n 8 --durations=6 \
    tests/test_gemv_prologue_cuda.py tests/test_topk_cuda.py -k "tensor_core or sixteen or topk" \
    > "$OUT/y2_tests.txt" 2>&1
  tail -n 6 "$OUT/y2_tests.txt"
  TN=16 R2="r8::- r16:SLOTSERVE_GEMV_MMA_ROWS=16:-" bash "$0" tl
  R2="sampled::--sampled topk:SLOTSERVE_TOPK=1:--sampled" bash "$0" tl ;;
y3)  # after y2: sampling with and without the radix select; tokens/s at 12 and 16 rows
  for t in 0 1 0 1; do
    { echo "== SLOTSERVE_TOPK=$t"; SLOTSERVE_TOPK=$t taskset -c 0-7 timeout 60 python3 \
      bench/sampling_speed.py --vocab 248320 --n 1,8,32 --number 3 --repeat 3; } \
      >> "$OUT/y3_sampling.md" 2>&1
  done
  grep -E "^==|Qwen" "$OUT/y3_sampling.md"
  sweep y3 12,16 r8:ARGS=--overlap r16:SLOTSERVE_GEMV_MMA_ROWS=16,ARGS=--overlap ;;
w4)  # the GPU tests, TK selecting the files; XD workers (pytest-xdist: NVRTC's compiles are
  # the host's, one core each — a serial run held about half of them in 9 minutes)
  export PYTHONPATH=/tmp/site:$PWD
  timeout ${TT:-540} python3 -m pytest -q -p no:cacheprovider -rf ${XD:+-n $XD} ${TK:-tests} \
    -k "cuda or gpu" \
    > "$OUT/w4_tests.txt" 2>&1; tail -n 8 "$OUT/w4_tests.txt" ;;
*)
  echo "usage: bash bench/lease/calls.sh c1|...|c9" >&2; exit 2 ;;
esac
