#!/bin/bash
# One device call on the GPU machine: tests, interleaved benchmark rounds (ours, peer, ours,
# peer), the report, then compute-sanitizer memcheck of the decode parity and graph-replay
# tests. Copy next to this script the release binaries `bench` (veloxquant-cuda-bench),
# `parity` and `cpu_side` (the veloxquant-cuda test executables) and peer_sdpa.py; run as
#   COMMIT=<sha> ITERS=50 ./gpu_run.sh [all|test|bench|memcheck]
# Every timing mode is in the JSON: one synchronized call per event pair ("ours_us"), ten
# back-to-back calls ("stream"), ten calls captured in a CUDA graph and replayed ("graph").
cd "$(dirname "$0")"
L=$(dirname "$(find /usr/local /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)")
export LD_LIBRARY_PATH=$L:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
echo "nvrtc dir: $L"; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
MODE=${1:-all}
IT=${ITERS:-50}
if [ "$MODE" = all ] || [ "$MODE" = test ]; then
  timeout 200 ./cpu_side 2>&1 | tail -3
  timeout 240 ./parity --test-threads=1 --nocapture 2>&1 | tee $OUT/parity.log | grep -v "^$" | tail -12
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout 200 ./bench run --out $OUT/ours1.json --iters $IT 2>&1 | tee $OUT/ours1.log | tail -40
  PYTHONUNBUFFERED=1 timeout 150 python3 peer_sdpa.py --out $OUT/peer1.json --iters $IT 2>&1 | tail -6
  timeout 150 ./bench run --out $OUT/ours2.json --iters $IT --no-encode 2>&1 | tail -3
  PYTHONUNBUFFERED=1 timeout 150 python3 peer_sdpa.py --out $OUT/peer2.json --iters $IT 2>&1 | tail -2
  O=$(ls $OUT/ours*.json | paste -sd,); P=$(ls $OUT/peer*.json | paste -sd,)
  ./bench report --ours $O --peer $P --out $OUT/cuda-decode.json --date "$(date -u +%F)" --commit "$COMMIT" | tee $OUT/table.md
fi
if [ "$MODE" = all ] || [ "$MODE" = memcheck ]; then
  timeout ${MC_T:-240} compute-sanitizer --tool memcheck --error-exitcode 9 ./parity decode_matches decode_graph --test-threads=1 2>&1 | tail -4
fi
