#!/usr/bin/env bash
# On this (CPU) machine, before a lease of the GPU machine: everything the GPU benchmarks
# need that its image lacks, beside what ../shared/gpu/prepare-mlx-cuda.sh makes (MLX's CUDA
# build in .gpu_a/ + .gpu_b/). Writes, git-ignored, two folders, each small enough to travel
# beside the tree and one of the MLX parts (64 MiB a call):
#   .gpu_w/wheels/        pytest (+ its dependencies, hypothesis, pytest-xdist for the GPU
#                         tests in parallel) and mlx-lm 0.32.2 (~2.5 MB)
#   .gpu_llama/llama.tgz  llama.cpp as vendored by llama-cpp-python 0.3.36, without models/
#                         and docs/ (~13 MB)
# Usage, from the repository root:  bash bench/lease/prepare.sh
# Then the calls in bench/lease/README.md.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .gpu_w .gpu_llama && mkdir -p .gpu_w/wheels .gpu_llama
tmp=$(mktemp -d)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .gpu_w/wheels pytest pluggy iniconfig packaging hypothesis sortedcontainers attrs pytest-xdist execnet \
  mlx-lm==0.32.2
pip download -q --no-deps --no-binary=:all: -d "$tmp" llama-cpp-python==0.3.36
tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
tar -C "$tmp"/llama_cpp_python-0.3.36/vendor --exclude=llama.cpp/models --exclude=llama.cpp/docs \
  -czf .gpu_llama/llama.tgz llama.cpp
rm -rf "$tmp"
du -sh .gpu_w .gpu_llama
