#!/usr/bin/env bash
# On the GPU machine, once MLX is installed (source .gpu_b/install-mlx-cuda.sh): with .gpu_w/
# carried, the extra wheels into /tmp/site; with .gpu_llama/ carried, llama.cpp's
# llama-batched-bench built for sm_90 in the background (setsid: it outlives the call; ~6
# minutes; /tmp/llama/rc holds its exit status when done); and the benchmark models written
# to /tmp/models (once). Each part is skipped when its folder is absent or it is done.
# Usage: source bench/lease/setup.sh
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
for w in .gpu_w/wheels/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/site; done
if [ -f .gpu_llama/llama.tgz ] && [ ! -d /tmp/llama/llama.cpp ]; then
  mkdir -p /tmp/llama && tar -xzf .gpu_llama/llama.tgz -C /tmp/llama
  export PATH=/usr/local/cuda/bin:$PATH
  (cd /tmp/llama/llama.cpp && setsid nohup bash -c '
    cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/llama/cmake.log 2>&1 &&
    cmake --build build --target llama-batched-bench -j10 > /tmp/llama/build.log 2>&1
    echo $? > /tmp/llama/rc' > /dev/null 2>&1 < /dev/null &)
fi
mkdir -p /tmp/models
# LEASE_MODELS: which to write (default both; the 9B takes ~3 minutes)
for spec in ${LEASE_MODELS:-qwen3.5-0.8b:f16 qwen3.5-9b:q8_0}; do  # the project's writer, its CLI
  out=/tmp/models/${spec%%:*}-${spec##*:}.gguf
  [ -f "$out" ] || python3 -m transport.cli make-model "$out" --preset "${spec%%:*}" --quant "${spec##*:}"
done
