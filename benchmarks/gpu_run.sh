#!/bin/bash
# One device call on the GPU machine: tests, interleaved benchmark rounds (ours, peer, ours,
# peer), the report, then compute-sanitizer memcheck of the decode parity and graph-replay
# tests. Copy next to this script the release binaries `bench` (veloxquant-cuda-bench),
# `parity` and `cpu_side` (the veloxquant-cuda test executables) and peer_sdpa.py; run as
#   COMMIT=<sha> ITERS=50 ./gpu_run.sh [all|test|bench|memcheck]
# Every timing mode is in the JSON: one synchronized call per event pair ("ours_us"), ten
# back-to-back calls ("stream"), ten calls captured in a CUDA graph and replayed ("graph").
# The device returns only a few files from $OUT (2026-12-06: the first 8, by name), so every
# output is written to $W and packed into $OUT/results.tar after each stage (a call cut by its
# time limit still returns what finished). The parity suite takes ~5 min on one thread of an
# H100: it runs on 4 threads here.
cd "$(dirname "$0")"
L=$(dirname "$(find /usr/local /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)")
export LD_LIBRARY_PATH=$L:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
echo "nvrtc dir: $L"; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
MODE=${1:-all}
IT=${ITERS:-50}
W=${W:-/tmp/gpu_run}
mkdir -p "$W"
pack() { tar cf "$OUT/results.tar" -C "$W" .; }
if [ "$MODE" = all ] || [ "$MODE" = test ]; then
  timeout 200 ./cpu_side 2>&1 | tail -3
  timeout ${PARITY_T:-400} ./parity --test-threads=4 --nocapture 2>&1 | tee $W/parity.log | grep -v "^$" | tail -12
  pack
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout 200 ./bench run --out $W/ours1.json --iters $IT 2>&1 | tee $W/ours1.log | tail -40
  PYTHONUNBUFFERED=1 timeout 150 python3 peer_sdpa.py --out $W/peer1.json --iters $IT 2>&1 | tail -6
  pack
  timeout 150 ./bench run --out $W/ours2.json --iters $IT --no-encode 2>&1 | tail -3
  PYTHONUNBUFFERED=1 timeout 150 python3 peer_sdpa.py --out $W/peer2.json --iters $IT 2>&1 | tail -2
  O=$(ls $W/ours*.json | paste -sd,); P=$(ls $W/peer*.json | paste -sd,)
  ./bench report --ours $O --peer $P --out $W/cuda-decode.json --date "$(date -u +%F)" --commit "$COMMIT" | tee $W/table.md
  pack
fi
if [ "$MODE" = all ] || [ "$MODE" = memcheck ]; then
  timeout ${MC_T:-240} compute-sanitizer --tool memcheck --error-exitcode 9 ./parity decode_matches decode_graph --test-threads=1 2>&1 | tee $W/memcheck.log | tail -4
  pack
fi
