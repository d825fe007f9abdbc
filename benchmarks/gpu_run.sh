#!/bin/bash
# Copy the release binaries (bench, parity, cpu_side) and peer_sdpa.py next to this script
# as in the report; run on the GPU machine as: COMMIT=<sha> ROUND2=1 ITERS=60 ./gpu_run.sh all
# One device call: tests, memcheck, then interleaved benchmark rounds (ours, peer, ours, peer).
cd "$(dirname "$0")"
L=$(dirname "$(find /usr/local /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)")
export LD_LIBRARY_PATH=$L:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
echo "nvrtc dir: $L"; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
MODE=${1:-all}
if [ "$MODE" = all ] || [ "$MODE" = test ]; then
  timeout 200 ./cpu_side 2>&1 | tail -3
  timeout 240 ./parity --test-threads=1 --nocapture 2>&1 | tee $OUT/parity.log | grep -v "^$" | tail -25
fi
if [ "$MODE" = all ] || [ "$MODE" = memcheck ]; then
  timeout ${MC_T:-150} compute-sanitizer --tool memcheck --error-exitcode 9 ./parity encode --test-threads=1 2>&1 | tail -6
  timeout ${MC_T:-150} compute-sanitizer --tool memcheck --error-exitcode 9 ./parity decode --test-threads=1 2>&1 | tail -6
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout 200 ./bench run --out $OUT/ours1.json --iters ${ITERS:-60} $BENCH_ARGS 2>&1 | tee $OUT/ours1.log | tail -40
  timeout 150 python3 peer_sdpa.py --out $OUT/peer1.json --iters ${ITERS:-60} 2>&1 | tail -8
  if [ -n "$ROUND2" ]; then
    timeout 150 ./bench run --out $OUT/ours2.json --iters ${ITERS:-60} --no-encode $BENCH_ARGS 2>&1 | tail -3
    timeout 150 python3 peer_sdpa.py --out $OUT/peer2.json --iters ${ITERS:-60} 2>&1 | tail -2
  fi
  O=$(ls $OUT/ours*.json | paste -sd,); P=$(ls $OUT/peer*.json | paste -sd,)
  ./bench report --ours $O --peer $P --out $OUT/cuda-decode.json --md $OUT/table.md --date "$(date -u +%F)" --commit "$COMMIT" | tee $OUT/table.md
fi
