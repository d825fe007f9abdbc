#!/bin/bash
# The real-model part of a device call (after benchmarks/gpu_e2e.sh's setup): join the model
# carried in two parts, check its SHA-256, then the GPU eval table, the real-weight decode
# benchmark, a generation, passkey retrieval and the demo. Usage: benchmarks/gpu_model_run.sh PART1 PART2 TEXT
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cat "$1" "$2" > /tmp/model.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/model.gguf" | sha256sum -c || exit 3
TEXT=$3
BIN=${BIN:-.gpur}
METHODS=${METHODS:-q8_0:rot@0,q8_0:rot/q4_0:rot@0,q4_0:rot@0,q4_0@0,turboquant_mse:4:eden/turboquant_mse:3@0,turboquant_mse:4:eden/turboquant_mse:3@8+4,turboquant_mse:4:eden/turboquant_mse:4@8+4,turboquant_mse:4:eden/turboquant_mse:2@16+4,turboquant_mse:3:eden/turboquant_mse:2@16+4,turboquant_rvq:2:2@8+4}
/usr/bin/time -f "eval wall %e s" timeout 300 $BIN/veloxquant eval --device cuda --model /tmp/model.gguf --text $TEXT --ctx 512 --windows 80 \
  --methods "$METHODS" --json $OUT/eval-ctx512-cuda.json --md $OUT/eval-ctx512-cuda.md 2>&1 | grep -v "^ *windows" | tail -16
timeout 200 $BIN/veloxquant bench e2e --model /tmp/model.gguf --batch 1,64 --context 512,8192 \
  --methods fp16,turboquant_mse:4,turboquant_mse:4:eden/turboquant_mse:3@8+4 --iters 20 --json $OUT/e2e-smollm2.json --commit "$COMMIT" 2>&1 | tail -13
timeout 60 $BIN/veloxquant generate --device cuda --model /tmp/model.gguf --max-tokens 48 2>&1 | tail -4
timeout 120 $BIN/veloxquant passkey --device cuda --model /tmp/model.gguf --lengths 1024,2048,4096,8000 \
  --methods fp16,turboquant_mse:4:eden/turboquant_mse:3@8+4,q4_0:rot@0 --n 3 --json $OUT/passkey-cuda.json --md $OUT/passkey-cuda.md 2>&1 | tail -6
timeout 120 $BIN/veloxquant demo --device cuda --model /tmp/model.gguf 2>&1 | tail -24
