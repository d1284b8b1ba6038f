#!/usr/bin/env bash
# The whole GPU check of issue 29 in one command, for a lent GPU machine that has nothing but this
# working tree: it installs nothing from the network, runs each part under its own time limit (the
# limits add up to under 8 minutes, so one hang cannot eat the lease), and writes under $OUT
# (default ./gpu_out):
#   gpu_check.jsonl   one JSON line per figure (benchmarks/_common.py), each part's exit status too
#   gpu_check.log     everything every part printed
#   gpu_tests_ops.xml, gpu_tests.xml   the GPU tests' junit reports (the op table's twins; the rest)
# Parts: probe (what the machine has: cupy, torch, nvcc, nccl, MPI, llmkit's requirements), the GPU
# tests (pytest -m gpu: every twin on cupy), the fused kernels against cupy / PyTorch eager /
# torch.compile, training tokens/s and MFU (configs/bench.yaml, and a ~134M model) against PyTorch,
# engine decode at batch 1, 8, 32. Without a GPU (or cupy) it says so and skips the GPU parts.
#
#   bash benchmarks/gpu_check.sh                 the check (exit 0 when every part ran and passed)
#   bash benchmarks/gpu_check.sh --dry-run       the probe only, and what each part would run (exit 0)
#   bash benchmarks/gpu_check.sh kernels decode  the probe and only these parts (a rerun after a fix)
#   bash benchmarks/gpu_check.sh --fetch-wheels  HERE, with PyPI: the Python packages the device
#                                                image lacks (pydantic...) as wheels into .whl/
#                                                (git-ignored), to carry along with the run
# On the lent machine (the device tool's run): command `bash benchmarks/gpu_check.sh`, carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python

# the device image's Python is 3.12 on x86-64; these are what it lacks of llmkit's requirements
WHEELS="pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2"
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p .whl
  # shellcheck disable=SC2086
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl $WHEELS
fi
DRY=0
SKIP_REASON=""
ONLY=" "  # part names given on the command line: run only those (a rerun after a fix)
for arg in "$@"; do
  case $arg in
  --dry-run) DRY=1 SKIP_REASON="dry run" ;;
  -*) echo "gpu_check.sh: unknown option $arg (--dry-run, --fetch-wheels)" >&2 && exit 2 ;;
  *) ONLY+="$arg " ;;
  esac
done

OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
JSONL=$OUT/gpu_check.jsonl
: >"$LOG"
: >"$JSONL"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export LLMKIT_CACHE_DIR=${LLMKIT_CACHE_DIR:-/tmp/llmkit-gpu-check}
export LLMKIT_KERNEL_CACHE=${LLMKIT_KERNEL_CACHE:-$LLMKIT_CACHE_DIR/kernels}  # the tests' kernels serve the benchmarks
FAILED=0
KNOWN=" "

say() { echo "gpu_check: $*" | tee -a "$LOG"; }
line() {  # line METRIC VALUE 'extra JSON fields': one figure of the script itself
  echo "{\"benchmark\": \"gpu_check\", \"metric\": \"$1\", \"value\": $2, \"unit\": \"\"${3:+, $3}}" >>"$JSONL"
}
part() {  # part NAME SECONDS CMD...: CMD under a time limit; its JSON lines kept, all output logged
  local name=$1 limit=$2
  shift 2
  KNOWN+="$name "
  [[ $ONLY == " " || $ONLY == *" $name "* ]] || return 0
  if ((DRY)); then
    say "skipped ($SKIP_REASON): part $name (limit ${limit}s) would run: $*"
    line part_skipped 1 "\"part\": \"$name\", \"reason\": \"$SKIP_REASON\", \"limit_s\": $limit"
    return 0
  fi
  say "part $name (limit ${limit}s): $*"
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG" | grep --line-buffered '^{' >>"$JSONL"
  rc=${PIPESTATUS[0]}
  local timed_out=false
  ((rc == 124 || rc == 137)) && timed_out=true
  ((rc != 0)) && FAILED=$((FAILED + 1))
  line part_exit_code "$rc" "\"part\": \"$name\", \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit, \"timed_out\": $timed_out"
  say "part $name: exit $rc after $((SECONDS - t0))s$([[ $timed_out == true ]] && echo ' (TIMED OUT)')"
}

say "OUT=$OUT python=$(command -v "$PY") $(date -u +%FT%TZ)"
MISSING=$("$PY" benchmarks/gpu_check.py missing 2>>"$LOG" | tr '\n' ' ')
if [[ -n ${MISSING// /} ]] && compgen -G ".whl/*.whl" >/dev/null; then  # from disk, never the network
  say "missing: $MISSING; installing the carried wheels in .whl/ into /tmp/llmkit-site (no index)"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/llmkit-site .whl/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH=$PYTHONPATH:/tmp/llmkit-site
  else
    say "could not install the carried wheels (see the log above)"
  fi
fi
for tool in nvidia-smi nvcc; do
  command -v $tool >/dev/null 2>&1 || say "not found: $tool"
done
command -v nvidia-smi >/dev/null 2>&1 &&
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >>"$LOG" 2>&1

timeout -k 5 30 "$PY" benchmarks/gpu_check.py probe 2>&1 | tee -a "$LOG" | grep '^{' >>"$JSONL"
if ! grep -q '"metric": "gpu_found", "value": 1' "$JSONL"; then
  grep -q '"metric": "gpu_found"' "$JSONL" || line gpu_found 0 "\"note\": \"the probe did not finish\""
  say "NO GPU: cupy found no CUDA device (see the cupy/torch/nccl lines of $JSONL); the GPU parts are skipped"
  DRY=1
  [[ -n $SKIP_REASON ]] || SKIP_REASON="no CUDA device found"
fi

BENCH134M="model.preset=small model.vocab_size=32000 model.hidden_size=768 model.intermediate_size=2048"
BENCH134M+=" model.num_hidden_layers=12 model.num_attention_heads=12 model.num_key_value_heads=12"
PYTEST=("$PY" -m pytest -m gpu -q -rfEs -p no:cacheprovider --timeout 60 --continue-on-collection-errors)
part tests_ops 75 "${PYTEST[@]}" tests/framework/test_op_table.py --junitxml="$OUT/gpu_tests_ops.xml"
part tests_paths 85 "${PYTEST[@]}" tests --ignore=tests/framework/test_op_table.py --junitxml="$OUT/gpu_tests.xml"
if ((!DRY)) && [[ $ONLY == " " || $ONLY == *" tests_"* ]]; then
  for xml in "$OUT/gpu_tests_ops.xml" "$OUT/gpu_tests.xml"; do
    "$PY" benchmarks/gpu_check.py tests "$xml" >>"$JSONL" 2>>"$LOG"
  done
fi
part kernels 90 "$PY" benchmarks/gpu_check.py kernels
part train_bench 50 "$PY" benchmarks/train_throughput.py --device gpu --mode static --steps 8 --warmup 2 \
  --torch-model small --torch-compile
# shellcheck disable=SC2086
part train_134m 95 "$PY" benchmarks/train_throughput.py --device gpu --mode static --steps 4 --warmup 1 \
  --torch-model small --torch-compile --set $BENCH134M
part decode 40 "$PY" benchmarks/decode.py --device gpu --batches 1,8,32 --rounds 2 --new-tokens 32

for name in $ONLY; do
  [[ $KNOWN == *" $name "* ]] || { say "unknown part $name; the parts are:$KNOWN" && FAILED=$((FAILED + 1)); }
done
line parts_failed "$FAILED"
say "done: $FAILED part(s) failed; figures in $JSONL, log in $LOG"
exit $((FAILED > 0))
