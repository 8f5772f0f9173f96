#!/usr/bin/env bash
# The recurrent-state decode loop on a GPU (examples/model_loops/recurrent_decode.py): the tiny Mamba-2 +
# attention hybrid with its state in graphalloc's state slots, every step one CUDA graph
# (allocator step with its state-table writes and state copies + model + argmax) replayed
# under torch.cuda.set_sync_debug_mode("error"); every request's tokens checked against
# transformers' BambaForCausalLM (float32, CPU). Each phase has its own time bound.
#
#   bash tests/gpu/run_recurrent_decode.sh OUTDIR            # bounds sum to 570 s
#   PHASES="graph" bash tests/gpu/run_recurrent_decode.sh OUTDIR     # a subset
#
# Phases (bound s):
#   graph     150  --graph --sync-debug --negative-control, page sizes 1 4 16, plain and
#                  speculative (k = 3): main runs must match, every control must differ
#   eager      90  the same loop without graphs (eager launches, sync debug on): tells a
#                  capture problem from a loop problem if `graph` fails
#   eager_torch 90 the eager loop with the allocator's Torch twins (no Triton kernel):
#                  tells the model's GPU math from the Triton state kernels if `eager` fails
#   larger    150  --graph --sync-debug, 24 requests, 8 lanes, a 45-token system prompt,
#                  outputs 16-40, k = 4, page size 16
#   cpu_test   90  not a GPU phase: the CPU test (tests/examples/test_examples_recurrent_decode.py)
#                  on this machine's torch, for comparison when a GPU phase fails
#
# Each phase writes recurrent_decode.json / .md into OUTDIR/<phase>/ (the test: nothing);
# every log is OUTDIR/<phase>.log; OUTDIR/summary.tsv lists phase, exit code, seconds,
# bound; OUTDIR/machine.txt the GPU, driver, torch, triton and transformers versions.
# Overrides: T_<PHASE> (bound in s, upper case, e.g. T_GRAPH=300), PHASES.
# Exit status: 0 when every phase run passed (an example exits 1 when any main run's tokens
# differ from transformers', any audit finds something, or a control fails to differ).
set -uo pipefail
usage="usage: bash tests/gpu/run_recurrent_decode.sh OUTDIR"
out=${1:?$usage}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2  # the repository root
# the folder's stamp.json: benchmarks/provenance.py (ALLOW_DIRTY=1: uncommitted source allowed)
python3 benchmarks/provenance.py stamp "$out" \
  --command "PHASES='${PHASES:-}' bash tests/gpu/run_recurrent_decode.sh OUTDIR" \
  ${ALLOW_DIRTY:+--allow-dirty} > /dev/null || exit 2
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
phases=${PHASES:-graph eager eager_torch larger cpu_test}
: > "$out/summary.tsv"
status=0

# phase NAME BOUND_S COMMAND...: run, log and record one bounded phase
source tests/gpu/phase.sh

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import transformers; print('transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null
} > "$out/machine.txt" 2>&1

ex=examples/model_loops/recurrent_decode.py
phase graph 150 python3 "$ex" --device cuda --graph --sync-debug --negative-control \
  --page-sizes 1 4 16 --no-progress --out "$out/graph"
phase eager 90 python3 "$ex" --device cuda --sync-debug --negative-control \
  --page-sizes 4 --no-progress --out "$out/eager"
# the Torch twins on the GPU (no Triton kernel): tells the model's GPU math from the Triton
# state kernels when `eager` fails
phase eager_torch 90 python3 "$ex" --device cuda --backend torch --sync-debug \
  --page-sizes 4 --modes plain --no-progress --out "$out/eager_torch"
phase larger 150 python3 "$ex" --device cuda --graph --sync-debug --requests 24 \
  --max-batch 8 --shared-prompt 45 --user-len 4 24 --output-len 16 40 --lookahead 4 \
  --page-sizes 16 --no-progress --out "$out/larger"
phase cpu_test 90 env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -rfEs -p no:cacheprovider \
  tests/examples/test_examples_recurrent_decode.py

cat "$out/summary.tsv"
exit $status
