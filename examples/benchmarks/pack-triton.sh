#!/usr/bin/env bash
# Packs a newer Triton for an offline Hopper GPU machine into .whl-tri/ (git-ignored), small enough to
# carry in one call: flash-linear-attention refuses the Triton 3.6 of torch 2.11 on Hopper ("incorrect
# results for gated chunk_bwd_dqkwg") and wants >= 3.7.1, whose wheel (198 MB) exceeds a call's carry.
# The pack is the PyPI wheel's package with libtriton.so stripped of its debug sections and without
# what a run does not load (CUPTI, Blackwell's ptxas, test libraries), as one .tar.xz (about 50 MB).
# On the GPU machine: tar xJf .whl-tri/triton-*.tar.xz -C SITE and put SITE first on PYTHONPATH.
# Usage, from the repository root:  bash examples/benchmarks/pack-triton.sh [VERSION]
set -euo pipefail
ver=${1:-3.7.1}
grep -qx '/.whl-tri/' .git/info/exclude 2>/dev/null || echo '/.whl-tri/' >> "$(git rev-parse --git-common-dir)/info/exclude"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
pip download -q "triton==$ver" --no-deps -d "$tmp/whl" --python-version 3.12 --implementation cp --only-binary=:all: \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
mkdir -p "$tmp/site" && (cd "$tmp/site" && python3 -m zipfile -e "$tmp"/whl/triton-*.whl .)
chmod +x "$tmp"/site/triton/backends/nvidia/bin/*  # zipfile drops the tools' mode bits
strip --strip-unneeded "$tmp/site/triton/_C/libtriton.so"
rm -rf "$tmp/site/triton/backends/nvidia/lib/cupti" "$tmp/site/triton/backends/nvidia/bin/ptxas-blackwell" \
  "$tmp/site/triton/instrumentation/libGPUInstrumentationTestLib.so" "$tmp/site/triton/plugins/libTritonPluginsTestLib.so" \
  "$tmp/site/triton/FileCheck"
mkdir -p .whl-tri && rm -f .whl-tri/*
tar -C "$tmp/site" -cf - . | xz -T0 -6 > ".whl-tri/triton-$ver-hopper.tar.xz"
ls -la .whl-tri
