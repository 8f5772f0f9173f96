#!/usr/bin/env bash
# The GPU run, in phases. Each phase has its own time bound (coreutils timeout) and log,
# OUTDIR/<phase>.log; after every phase OUTDIR/summary.md and summary.json list each
# phase's status (pass / FAIL / TIMEOUT / NO TESTS), exit code, pass/fail/error/skip
# counts (per test, as they happen: tests/gpu/outcome_log.py), wall time and bound.
#
#   bash tests/gpu/run_gpu_suite.sh OUTDIR           # default run: < 8 min on one H200
#   bash tests/gpu/run_gpu_suite.sh OUTDIR --soak    # the soaks and the long variants
#
# Default run. Bounds (s) sum to 555 (one device call allows 600; run8 on an H100: memcheck
# of the script with its state section took 91 s warm and over 100 s cold, so its bound
# went from 100 to 150). The run of the one-step round took 309 s with the cuda phase cut
# off at 210 s (the 150-allocator stress alone took 77 s: 24 per backend now), memcheck
# 63 s, racecheck 19 s. cuda grew for the
# recurrent-state graph-vs-eager loop (5,000 operations, GRAPHALLOC_STATE_STEPS_GPU), the
# in-step page tables' 2,000-step test and the round-3 contract tests.
# Re-sized from results/gpu-suite/run6 (cuda 128 s, core_cuda 28 s, memcheck over 40 s
# with the work-sized grid's kernel variants, racecheck 23 s). First sized from run4
# (H200): a 4000-op graph-vs-eager loop 22 s, 10,000 sharing ops 52 s, the tables example
# 19 s, the fused graph tests 29 s, the GPU soak 22 s, memcheck 10 s, racecheck 18 s.
#   install     20  pip install -e . (no deps), machine.txt
#   cuda       270  every test that runs on the GPU, natively (real Triton, no redirect):
#                   pytest -m "on_device and not soak" tests  (on_device, set by conftest:
#                   marked cuda, or uses the device fixture); the graph-vs-eager loops
#                   at GRAPHALLOC_GRAPH_STEPS=1000 and GRAPHALLOC_SHARING_STEPS_GPU=1000,
#                   the allocator stress at GRAPHALLOC_STRESS_ALLOCATORS=24 per backend
#                   (--soak: 150; 150 took 77 s of the phase on the H200)
#   core_cuda   70  the core suite with every allocator it builds moved to CUDA and every
#                   allocator operation under sync-debug "error" (tests/conftest.py):
#                   GRAPHALLOC_TEST_DEVICE=cuda pytest -m "not cuda and not soak" CORE_FILES,
#                   hypothesis capped at GRAPHALLOC_HYPOTHESIS_MAX_EXAMPLES=8 per test
#   memcheck   150  compute-sanitizer --tool memcheck python3 tests/gpu/sanitize_kernels.py 20
#   racecheck   45  compute-sanitizer --tool racecheck, the same script
#
# --soak. Bounds sum to 2540 s.
#   install     20
#   soak       600  pytest -m soak tests: the 100,000-step graph-replayed GPU soak
#                   (GRAPHALLOC_SOAK_STEPS_GPU) and the CPU soaks
#   soak_cuda  600  GRAPHALLOC_TEST_DEVICE=cuda pytest -m "soak and not cuda" tests: the
#                   CPU soaks with their allocators on CUDA, under sync-debug
#   graph_long 420  the CUDA graph tests at their full length (GRAPHALLOC_GRAPH_STEPS and
#                   GRAPHALLOC_SHARING_STEPS_GPU 10000): pytest -m "cuda and not soak"
#                   tests/device/test_graph_runtime.py tests/gpu/test_gpu_contracts.py
#   hypothesis_cuda 900  GRAPHALLOC_TEST_DEVICE=cuda GRAPHALLOC_HYPOTHESIS_MAX_EXAMPLES=0
#                   pytest tests/planning/test_model_vs_allocator.py: the file's own example counts
#
# Overrides: T_<PHASE> (bound in s, e.g. T_CORE_CUDA=200), PYTEST_ARGS (added to every
# pytest phase, split on whitespace, e.g. "-x"), PYTEST_K (a -k expression for every pytest
# phase), CORE_FILES (space-separated; missing files are skipped), SAN_STEPS, and the
# GRAPHALLOC_* knobs above. Exit status: 0 when every phase passed.
set -uo pipefail
usage="usage: bash tests/gpu/run_gpu_suite.sh OUTDIR [--soak]"
out=${1:?$usage}
mode=${2:-default}
case "$mode" in
  default | --soak) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2  # the repository root
# the folder's stamp.json (commit, source digest, machine, command): benchmarks/provenance.py;
# ALLOW_DIRTY=1 lets a run into results/ from uncommitted source
python3 benchmarks/provenance.py stamp "$out" --command "bash tests/gpu/run_gpu_suite.sh OUTDIR ${2:-}" \
  ${ALLOW_DIRTY:+--allow-dirty} > /dev/null || exit 2
rm -f "$out/phases.tsv" "$out"/*.outcomes.jsonl "$out/summary.md" "$out/summary.json"
: > "$out/phases.tsv"

export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}"  # -p outcome_log
read -r -a extra <<< "${PYTEST_ARGS:-}"  # split on whitespace
if [ -n "${PYTEST_K:-}" ]; then extra+=(-k "$PYTEST_K"); fi
pytest_cmd=(python3 -m pytest -q -rfEs -s -p no:cacheprovider -p outcome_log --durations=10
            ${extra[@]+"${extra[@]}"})
if [ "$mode" = --soak ]; then budget=2540; else budget=480; fi

# phase NAME KIND BOUND_S COMMAND...: run COMMAND under its bound, log, record, summarise
phase() {
  local name=$1 kind=$2 bound=$3
  shift 3
  local log="$out/$name.log" t0 t1 ms rc
  { printf "== phase %s (bound %s s):" "$name" "$bound"; printf " %q" "$@"; echo; } > "$log"
  t0=$(date +%s%N)
  GRAPHALLOC_PHASE_LOG="$out/$name.outcomes.jsonl" timeout --kill-after=3 "$bound" "$@" \
    >> "$log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  ms=$(( (t1 - t0) / 1000000 ))
  printf '== phase %s exit %d after %d.%03d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) \
    >> "$log"
  printf '%s\t%d\t%d\t%d.%03d\t%s\n' "$name" "$rc" "$bound" $((ms / 1000)) $((ms % 1000)) \
    "$kind" >> "$out/phases.tsv"
  python3 tests/gpu/summarize.py "$out" "$budget" > /dev/null 2>&1 || true
  echo "phase $name: exit $rc after $((ms / 1000)) s (bound $bound s), log $log"
}

install_and_describe() {
  if [ "${INSTALL:-1}" != 0 ]; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . || return 1
  fi
  {
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  } > "$out/machine.txt" 2>&1
}
export -f install_and_describe
export out

# existing FILE...: the files that exist, into the array "files" (pytest fails a whole
# run on a missing path; the suite's files move while it is being developed)
existing() {
  files=()
  local f
  for f in "$@"; do
    if [ -e "$f" ]; then files+=("$f"); else echo "skipped, does not exist: $f"; fi
  done
}

phase install other "${T_INSTALL:-20}" bash -c install_and_describe

if [ "$mode" = default ]; then
  # shellcheck disable=SC2086  # CORE_FILES is a space-separated list
  existing ${CORE_FILES:-tests/planning/test_scenarios.py tests/planning/test_model_vs_allocator.py \
    tests/contracts/test_bad_input.py tests/contracts/test_reliability.py tests/device/test_graph_runtime.py}
  core=(${files[@]+"${files[@]}"})
  phase cuda pytest "${T_CUDA:-270}" \
    env GRAPHALLOC_GRAPH_STEPS="${GRAPHALLOC_GRAPH_STEPS:-1000}" \
        GRAPHALLOC_SHARING_STEPS_GPU="${GRAPHALLOC_SHARING_STEPS_GPU:-1000}" \
        GRAPHALLOC_STRESS_ALLOCATORS="${GRAPHALLOC_STRESS_ALLOCATORS:-24}" \
    "${pytest_cmd[@]}" -m "on_device and not soak" tests
  phase core_cuda pytest "${T_CORE_CUDA:-70}" \
    env GRAPHALLOC_TEST_DEVICE=cuda \
        GRAPHALLOC_HYPOTHESIS_MAX_EXAMPLES="${GRAPHALLOC_HYPOTHESIS_MAX_EXAMPLES:-8}" \
    "${pytest_cmd[@]}" -m "not cuda and not soak" ${core[@]+"${core[@]}"}
  phase memcheck sanitizer "${T_MEMCHECK:-150}" \
    compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 tests/gpu/sanitize_kernels.py "${SAN_STEPS:-20}"
  phase racecheck sanitizer "${T_RACECHECK:-45}" \
    compute-sanitizer --tool racecheck --error-exitcode 3 \
    python3 tests/gpu/sanitize_kernels.py "${SAN_STEPS:-20}"
else
  existing tests/device/test_graph_runtime.py tests/gpu/test_gpu_contracts.py
  graph_files=(${files[@]+"${files[@]}"})
  phase soak pytest "${T_SOAK:-600}" "${pytest_cmd[@]}" -m soak tests
  phase soak_cuda pytest "${T_SOAK_CUDA:-600}" env GRAPHALLOC_TEST_DEVICE=cuda \
    "${pytest_cmd[@]}" -m "soak and not cuda" tests
  phase graph_long pytest "${T_GRAPH_LONG:-420}" \
    env GRAPHALLOC_GRAPH_STEPS="${GRAPHALLOC_GRAPH_STEPS:-10000}" \
        GRAPHALLOC_SHARING_STEPS_GPU="${GRAPHALLOC_SHARING_STEPS_GPU:-10000}" \
    "${pytest_cmd[@]}" -m "cuda and not soak" ${graph_files[@]+"${graph_files[@]}"}
  phase hypothesis_cuda pytest "${T_HYPOTHESIS_CUDA:-900}" \
    env GRAPHALLOC_TEST_DEVICE=cuda GRAPHALLOC_HYPOTHESIS_MAX_EXAMPLES=0 \
    "${pytest_cmd[@]}" tests/planning/test_model_vs_allocator.py
fi

python3 tests/gpu/summarize.py "$out" "$budget"
status=$?
cat "$out/summary.md"
exit $status
