#!/bin/bash
# One device call for the GPU engine: its tests, the end-to-end decode benchmark and the
# Hugging Face peer, in one command on the H200. Binaries come in a carried folder (default
# .gpur: veloxquant, cpu_side, parity, gpu — see README "GPU"); results go to $OUT.
#   benchmarks/gpu_e2e.sh [test|bench|peer|eval|all] ...
# MODEL=path/to/SmolLM2.gguf enables the real-model cases (eval, real-weight bench rows).
set -o pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpur}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
lib() { find /usr/local /opt /usr/lib /usr/lib64 -name "$1" 2>/dev/null | grep -v stub | head -1; }
export LD_LIBRARY_PATH=$(dirname "$(lib 'libnvrtc.so.13*')"):$(dirname "$(lib 'libcublas.so.13*')"):/usr/local/cuda/lib64:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv,noheader
MODE=${1:-all}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
if [ "$MODE" = all ] || [ "$MODE" = test ]; then
  timeout 120 $BIN/cpu_side 2>&1 | tail -3
  timeout 300 $BIN/parity --test-threads=1 --nocapture 2>&1 | tee $OUT/parity.log | grep -E "parity|graph|fork|FAIL|panicked|test result" | tail -20
  timeout 300 $BIN/gpu --test-threads=1 --nocapture 2>&1 | tee $OUT/gpu-tests.log | grep -E "positions|GPU|refused|SKIP|panicked|test result|error" | tail -30
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout ${T_BENCH:-400} $BIN/veloxquant bench e2e --synthetic llama-8b --batch ${B8:-8} --context ${S8:-32768} \
    --methods fp16,turboquant_mse:4 --iters 20 ${FIT:+--fit $FIT} --json $OUT/e2e-llama8b.json --commit "$COMMIT" 2>&1 | tail -12
  timeout ${T_BENCH:-400} $BIN/veloxquant bench e2e --synthetic smollm2-135m --batch ${BS:-1,64} --context ${SS:-512,8192} \
    --methods fp16,turboquant_mse:4 --iters 20 --json $OUT/e2e-smollm2-synthetic.json --commit "$COMMIT" 2>&1 | tail -12
fi
if [ "$MODE" = peer ] || [ "$MODE" = all ]; then
  PYTHONUNBUFFERED=1 timeout ${T_PEER:-400} python3 benchmarks/peer_hf_e2e.py --out $OUT/hf.json \
    --cases "${HF_CASES:-llama-8b:8:32768}" --compiled "${HF_COMPILED:-}" --iters 20 2>&1 | tail -8
fi
