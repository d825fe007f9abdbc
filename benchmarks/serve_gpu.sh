#!/bin/bash
# `veloxquant serve --device cuda` under load on the H200: the same load test as on the CPU
# (benchmarks/serve_load.py), at 256 concurrent clients with ~4k-token contexts, fp16 cache
# vs the default compressed method at the same --kv-budget-mib. One device call:
#   benchmarks/serve_gpu.sh PART1 PART2        (the model carried in two parts, as gpu_model_run.sh)
# Needs the cuda build of the binary in $BIN (default .gpur/veloxquant). Results: $OUT/serve-gpu-*.json.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BIN=${BIN:-.gpur}
lib() { find /usr/local /opt /usr/lib /usr/lib64 -name "$1" 2>/dev/null | grep -v stub | head -1; }
export LD_LIBRARY_PATH=$(dirname "$(lib 'libnvrtc.so.13*')"):$(dirname "$(lib 'libcublas.so.13*')"):/usr/local/cuda/lib64:$LD_LIBRARY_PATH
cat "$1" "$2" > /tmp/model.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/model.gguf" | sha256sum -c || exit 3
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
# 4k-token contexts: prompts of 2,000–3,000 tokens and up to 1,024 generated (decode, where the
# cache is read, is most of the work; with 4k prompts and 128 tokens prefill dominated both runs).
# fp16 holds ~23 KB/token here (SmolLM2: 30 layers × 3 KV heads × 64 × 2 × 2 B): a request
# reserves ~3.5k tokens, so BUDGET_MIB=6000 fits ~75 fp16 sequences and 256 clients oversubscribe it.
BUDGET=${BUDGET_MIB:-6000}
MIN_PROMPT=${MIN_PROMPT:-2000}
MAX_PROMPT=${MAX_PROMPT:-3000}
CLIENTS=${CLIENTS:-256}
REQUESTS=${REQUESTS:-256}
# PREFILL_CHUNK: tokens of one sequence's prompt per step (smaller: decode rows wait less;
# larger: fewer passes over the prompt's coded pages).
CHUNK=${PREFILL_CHUNK:-4096}
STEP=${STEP_PREFILL:-8192}  # prompt tokens over all sequences per step
COMMON="--device cuda --model /tmp/model.gguf --kv-budget-mib $BUDGET --max-context 4352 --gpu-slots 320 \
  --max-running $CLIENTS --max-queue 1024 --prefill-chunk $CHUNK --step-prefill-tokens $STEP"
# run TAG METHOD CLIENTS REQUESTS MAX_TOKENS SECONDS: one load run; the server's log always comes back.
run() {
  timeout $6 python3 benchmarks/serve_load.py load --binary $BIN/veloxquant --port 18300 \
    --server-args "$COMMON --method $2" --clients $3 --requests $4 \
    --min-prompt $MIN_PROMPT --max-prompt $MAX_PROMPT --max-tokens $5 --disconnect 0.1 --timeout 250 \
    --json $OUT/serve-gpu-$1.json > $OUT/serve-gpu-$1.log 2>&1
  local rc=$?; echo "$1 ($2): exit $rc"
  tail -c 4000 /tmp/veloxquant-serve-18300-*.log > $OUT/serve-gpu-$1.server.log 2>/dev/null
  rm -f /tmp/veloxquant-serve-18300-*.log
  [ -s $OUT/serve-gpu-$1.json ] || { tail -5 $OUT/serve-gpu-$1.log; return 1; }
  python3 - "$OUT/serve-gpu-$1.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
print({k: r.get(k) for k in ["outcomes", "tokens_per_s", "sequences_running_max", "kv_bytes_max_sampled",
                             "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s", "drained", "pass",
                             "sigterm_exit_code"]})
m = r["metrics_after"]
ds, dm, fm = m.get("decode_steps_total", 0), m.get("decode_micros_total", 0), m.get("forward_micros_total", 0)
if ds:
    print("decode-only steps %d: %.2f ms each, %.1f rows each; prefill-carrying steps %d: %.2f s in all; forward %.2f s of %.2f s wall"
          % (ds, dm / ds / 1e3, m.get("decode_step_rows_total", 0) / ds, m["steps_total"] - ds, (fm - dm) / 1e6, fm / 1e6, r["wall_s"]))
EOF
}
DEFAULT=turboquant_mse:4:eden/turboquant_mse:3@8+4
# A small run first (a few seconds when all is well): a stuck or slow server shows here,
# with its progress lines, before the long runs spend the call.
run smoke $DEFAULT 16 32 32 ${T_SMOKE:-90} || exit 4
rm -f $OUT/serve-gpu-smoke.json
for M in fp16 $DEFAULT; do
  run $(echo "$M" | tr '/:@+' '____') $M $CLIENTS $REQUESTS ${MAX_TOKENS:-1024} ${T_RUN:-200}
done
python3 - "$OUT" <<'EOF'
import glob, json, sys
runs = {p: json.load(open(p))["runs"][0] for p in sorted(glob.glob(sys.argv[1] + "/serve-gpu-*.json"))}
fp = next(r for p, r in runs.items() if p.endswith("fp16.json"))
cq = next(r for p, r in runs.items() if not p.endswith("fp16.json"))
print("sequences held: compressed / fp16 = %.2f× (target ≥ 3×)" % (cq["sequences_running_max"] / fp["sequences_running_max"]))
print("tokens/s:       compressed / fp16 = %.2f× (target ≥ 2×)" % (cq["tokens_per_s"] / fp["tokens_per_s"]))
EOF
