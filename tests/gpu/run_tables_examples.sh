#!/usr/bin/env bash
# The in-step attention page tables on a GPU: their cuda tests and the examples that read
# them, each a phase with its own time bound (coreutils timeout), log and exit code.
#
#   bash tests/gpu/run_tables_examples.sh OUTDIR            # bounds sum to 570 s
#   PHASES="tests decode_tables" bash tests/gpu/run_tables_examples.sh OUTDIR   # a subset
#
# Phases (bound s):
#   tests              140  pytest -m cuda: tests/device/test_page_tables.py (2,000 graph-replayed
#                           steps under sync debug, tables against the dense recomputation,
#                           FlashInfer / Triton against the Torch twin), test_examples_tables,
#                           test_examples_speculative, test_examples_flashinfer_decode
#   decode_tables       60  examples/model_loops/decode_loop.py --device cuda --graph --sync-debug
#                           --negative-control (Triton paged attention over alloc.tables)
#   decode_flashinfer  140  the same with --attention flashinfer --dtype float16 (skipped
#                           when FlashInfer does not import)
#   flashinfer_tables  170  examples/model_loops/flashinfer_tables.py (correctness at page sizes 16, 1;
#                           timing at B = 1, 64, 256)
#   speculative         60  examples/model_loops/speculative_decode.py --device cuda --graph --sync-debug
#
# Each example writes its json / md (/ png) into OUTDIR/<phase>/; every log is
# OUTDIR/<phase>.log; OUTDIR/summary.tsv lists phase, exit code, seconds, bound. Overrides:
# T_<PHASE> (bound in s, upper case, e.g. T_TESTS=300), PHASES (space-separated subset).
# The benchmark is a command of its own (benchmarks/bench_page_tables.py, its docstring).
# Exit status: 0 when every phase run passed.
set -uo pipefail
usage="usage: bash tests/gpu/run_tables_examples.sh OUTDIR"
out=${1:?$usage}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2  # the repository root
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
phases=${PHASES:-tests decode_tables decode_flashinfer flashinfer_tables speculative}
: > "$out/summary.tsv"
status=0

# phase NAME BOUND_S COMMAND...: run, log and record one bounded phase
source tests/gpu/phase.sh

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
} > "$out/machine.txt" 2>&1

phase tests 140 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda \
  tests/device/test_page_tables.py tests/examples/test_examples_tables.py tests/examples/test_examples_speculative.py \
  tests/examples/test_examples_flashinfer_decode.py
phase decode_tables 60 python3 examples/model_loops/decode_loop.py --device cuda --graph --sync-debug \
  --negative-control --no-progress --out "$out/decode_tables"
if [[ " $phases " != *" decode_flashinfer "* ]]; then
  :  # not asked for
elif python3 -c "import flashinfer" > /dev/null 2>&1; then
  phase decode_flashinfer 140 python3 examples/model_loops/decode_loop.py --device cuda --graph \
    --sync-debug --attention flashinfer --dtype float16 --negative-control --no-progress \
    --out "$out/decode_flashinfer"
else
  echo "phase decode_flashinfer: skipped (flashinfer does not import)" | tee "$out/decode_flashinfer.log"
fi
phase flashinfer_tables 170 python3 examples/model_loops/flashinfer_tables.py --no-progress \
  --out "$out/flashinfer_tables"
phase speculative 60 python3 examples/model_loops/speculative_decode.py --device cuda --graph \
  --sync-debug --no-progress --out "$out/speculative"

cat "$out/summary.tsv"
exit $status
