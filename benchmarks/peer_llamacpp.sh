#!/usr/bin/env bash
# llama.cpp's llama-bench next to `veloxquant bench model` on this CPU, same model, tests,
# depths and threads; merged into benchmarks/results/cpu-model.{json,md}.
#
#   THREADS=2 REPS=2 benchmarks/peer_llamacpp.sh            # build once, run, merge
#   benchmarks/peer_llamacpp.sh --build-only                # only build llama-bench
#
# llama-bench is built once into $LLAMA_DIR (default ~/.cache/veloxquant/llama.cpp-0.3.36)
# from the llama.cpp that the PyPI sdist of llama-cpp-python 0.3.36 vendors: Release,
# native CPU flags, static, only the llama-bench target, under `nice`. The build's seconds
# are kept next to it (build-seconds) and quoted in the table's header.
# Env: THREADS (2), REPS (3), DEPTHS (0,4096,8000), BIN (target/release/veloxquant),
# MODEL (the default SmolLM2 GGUF), N_CTX (8192, the model's context: our pp512 runs only
# at depths where depth + 512 fits; llama.cpp runs past it, so its row there is kept alone).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
CACHE_BASE=${XDG_CACHE_HOME:-$HOME/.cache}/veloxquant
LLAMA_DIR=${LLAMA_DIR:-$CACHE_BASE/llama.cpp-$VERSION}
THREADS=${THREADS:-2}
REPS=${REPS:-3}
DEPTHS=${DEPTHS:-0,4096,8000}
BIN=${BIN:-target/release/veloxquant}
MODEL=${MODEL:-$CACHE_BASE/SmolLM2-135M-Instruct.Q4_1.gguf}
N_CTX=${N_CTX:-8192}
PP=512
TG=32
LLAMA_BENCH=$LLAMA_DIR/bin/llama-bench

build_llama_bench() {
  [ -x "$LLAMA_BENCH" ] && return 0
  mkdir -p "$LLAMA_DIR/dl"
  # PyPI wheels of cmake and ninja when the system has none.
  command -v cmake >/dev/null || python3 -m pip install cmake
  command -v ninja >/dev/null || python3 -m pip install ninja
  # `--no-binary llama-cpp-python`, not `:all:`: with `:all:` pip also builds the sdist's
  # build backend's own dependencies (cmake itself) from source to read its metadata.
  local sdist=$LLAMA_DIR/dl/llama_cpp_python-$VERSION.tar.gz
  [ -f "$sdist" ] || python3 -m pip download "llama-cpp-python==$VERSION" \
    --no-binary llama-cpp-python --no-deps -d "$LLAMA_DIR/dl"
  rm -rf "$LLAMA_DIR/src" && mkdir -p "$LLAMA_DIR/src"
  tar xzf "$sdist" -C "$LLAMA_DIR/src" --strip-components=1
  local t0 t1
  # Native flags, except AMX: where the CPU reports AMX, ggml's AMX matmul segfaults at the
  # first product in this VM (llama.cpp 0c1e570, SmolLM2 Q4_1), so the AVX-512 paths are named
  # explicitly instead of -march=native.
  local ISA_FLAGS=(-DGGML_NATIVE=ON)
  if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  fi
  t0=$(date +%s)
  # The compiler's notes on the AVX-512 intrinsics run to megabytes: kept in build.log.
  local log=$LLAMA_DIR/build.log
  echo "building llama-bench (log: $log)"
  if ! { nice -n 10 cmake -S "$LLAMA_DIR/src/vendor/llama.cpp" -B "$LLAMA_DIR/build" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF &&
    nice -n 10 cmake --build "$LLAMA_DIR/build" --target llama-bench -j2; } > "$log" 2>&1; then
    tail -30 "$log" >&2
    exit 1
  fi
  t1=$(date +%s)
  mkdir -p "$LLAMA_DIR/bin"
  cp "$LLAMA_DIR/build/bin/llama-bench" "$LLAMA_BENCH.tmp" && mv "$LLAMA_BENCH.tmp" "$LLAMA_BENCH"
  echo $((t1 - t0)) > "$LLAMA_DIR/build-seconds"
  echo "built $LLAMA_BENCH in $((t1 - t0)) s"
}

build_llama_bench
[ "${1:-}" = --build-only ] && exit 0

[ -f "$MODEL" ] || { echo "no model at $MODEL (run: $BIN fetch-model)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "no $BIN (run: cargo build --release -p veloxquant-cli)" >&2; exit 1; }
PP_DEPTHS=$(python3 -c "import sys; print(','.join(d for d in sys.argv[1].split(',') if int(d) + $PP <= $N_CTX))" "$DEPTHS")

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
LOAD_BEFORE=$(uptime)
echo "load before: $LOAD_BEFORE"
# f16 also without flash attention (-fa 0): on this CPU its decode at depth is faster than
# -fa 1's; a quantized V cache needs flash attention, so q4_0 runs with -fa 1 only.
# LLAMA_ROWS=FILE reuses the llama.cpp rows of an earlier merged JSON (said in the table).
LLAMA_ARGS=(--llama)
if [ -n "${LLAMA_ROWS:-}" ]; then
  LLAMA_ARGS=(--llama-rows "$LLAMA_ROWS" --llama-rows-note "${LLAMA_ROWS_NOTE:-}" --llama)
else
  for run in "f16 1,0" "q4_0 1"; do
    set -- $run
    echo "llama-bench cache $1/$1, -fa $2"
    "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -fa "$2" -p $PP -n $TG -d "$DEPTHS" \
      -ctk "$1" -ctv "$1" -r "$REPS" -o json > "$TMP/llama-$1.json"
    LLAMA_ARGS+=("$TMP/llama-$1.json")
  done
fi
echo "veloxquant tg$TG at depths $DEPTHS, pp$PP at depths $PP_DEPTHS"
# Depth 0 with batched decode, 16 sequences per step (llama-bench has no such test): the
# reps alternate between B = 1 and B = 16, so their ratio is measured under the same load.
"$BIN" bench model --model "$MODEL" --threads "$THREADS" --reps "$REPS" \
  --tests tg$TG --depths 0 --batch 1,16 --json "$TMP/ours-tg-d0.json"
DEEPER=$(echo "$DEPTHS" | tr ',' '\n' | grep -vx 0 | paste -sd, || true)
if [ -n "$DEEPER" ]; then
  "$BIN" bench model --model "$MODEL" --threads "$THREADS" --reps "$REPS" \
    --tests tg$TG --depths "$DEEPER" --batch 1 --json "$TMP/ours-tg.json"
fi
if [ -n "$PP_DEPTHS" ]; then
  "$BIN" bench model --model "$MODEL" --threads "$THREADS" --reps "$REPS" \
    --tests pp$PP --depths "$PP_DEPTHS" --json "$TMP/ours-pp.json"
fi
LOAD_AFTER=$(uptime)
echo "load after: $LOAD_AFTER"

python3 benchmarks/merge_cpu_model.py \
  "${LLAMA_ARGS[@]}" \
  --ours "$TMP"/ours-*.json \
  --load-before "$LOAD_BEFORE" --load-after "$LOAD_AFTER" \
  --threads "$THREADS" --reps "$REPS" --model "$MODEL" --llama-version "$VERSION" \
  --build-seconds "$(cat "$LLAMA_DIR/build-seconds" 2>/dev/null || echo '?')" \
  --commit "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
  --n-ctx "$N_CTX" \
  --json benchmarks/results/cpu-model.json --md benchmarks/results/cpu-model.md
