#!/usr/bin/env bash
# The GPU at its floor (issue 34 item 4), in one call on one GPU: < 8 minutes, 8 files.
#
#   bash benchmarks/run_floor_gpu.sh OUTDIR        # then: tar czf floor.tgz -C OUTDIR .
#
# Phases (each bounded by coreutils timeout; T_<PHASE> overrides a bound, in seconds; every
# phase runs whatever the one before did):
#   install   30  pip install -e . (no deps: builds the compiled planner and the compiled
#                 input conversion), the machine into run.log
#   tests    170  the kernels this item changed, compiled on the GPU, against their twins:
#                 pytest -m "on_device and not soak" on the page-table blocks (every form x
#                 layer, launch after launch), staging (staged == unstaged, page tables and
#                 state slots), the in-step page tables (2,000 graph-replayed steps under
#                 sync-debug "error", the dense reference), the graph runtime (now 3 and 2
#                 kernel nodes: the rows staged first) and the fused step's graphs
#                 (GRAPHALLOC_GRAPH_STEPS=500) -> tests.log
#   floor    170  benchmarks/bench_floor.py: B = 256 decode + eviction interval against the
#                 pipelined floor (staged / pinned, without and with page tables), the
#                 8,192-token prefill's GPU span (long_programs 64 / 128 / 256)
#                 -> bench_floor.json, bench_floor.md
#   tables    90  benchmarks/bench_page_tables.py: what the in-step page tables add at
#                 B = 256 / 1024, 128k context, against eager torch ops
#                 -> bench_page_tables.json, bench_page_tables.md
# Files in OUTDIR: run.log (every phase's output but the tests'), tests.log, the four
# benchmark files, stamp.json (the source that ran: benchmarks/provenance.py), summary.md
# (phase status and the targets' verdicts). Exit status: 0 when every phase passed.
set -uo pipefail
out=${1:?usage: bash benchmarks/run_floor_gpu.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2  # the repository root
export PYTHONUNBUFFERED=1
rm -f "$out/run.log" "$out/tests.log" "$out/summary.md" "$out/phases.tsv.tmp"
status=0

phase() {  # phase NAME BOUND_S LOG COMMAND...
  local name=$1 bound=$2 log=$3
  shift 3
  local var="T_${name^^}" t0 t1 rc
  bound=${!var:-$bound}
  { printf "== phase %s (bound %s s):" "$name" "$bound"; printf " %q" "$@"; echo; } >> "$log"
  t0=$(date +%s)
  timeout --kill-after=3 "$bound" "$@" >> "$log" 2>&1
  rc=$?
  t1=$(date +%s)
  printf '%s\t%d\t%d\t%d\n' "$name" "$rc" $((t1 - t0)) "$bound" >> "$out/phases.tsv.tmp"
  echo "phase $name: exit $rc after $((t1 - t0)) s (bound $bound s)" | tee -a "$out/run.log"
  [ "$rc" = 0 ] || status=1
}

install() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . || return 1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, graphalloc.plan.compiled as c, graphalloc.plan.step as s
print('torch', torch.__version__, 'triton', triton.__version__)
print('compiled planner', c.AVAILABLE, '| compiled input conversion', s.normalize_fast is not None)"
  git log -1 --format='commit %h %s' 2>/dev/null || true
}
export -f install

phase install 30 "$out/run.log" bash -c install
phase tests 170 "$out/tests.log" env GRAPHALLOC_GRAPH_STEPS=500 \
  python3 -m pytest -q -rfEs -p no:cacheprovider --durations=8 -m "on_device and not soak" \
  tests/device/test_page_table_blocks.py tests/device/test_staging.py \
  tests/device/test_page_tables.py tests/device/test_graph_runtime.py \
  tests/device/test_fused_step.py
phase floor 170 "$out/run.log" python3 benchmarks/bench_floor.py --out "$out"
phase tables 90 "$out/run.log" python3 benchmarks/bench_page_tables.py --out "$out" --no-progress

python3 - "$out" <<'EOF' > "$out/summary.md"
import json, os, sys
out = sys.argv[1]
print("# The GPU at its floor (issue 34 item 4)\n")
print("| phase | exit | seconds | bound |\n|:---|---:|---:|---:|")
for line in open(os.path.join(out, "phases.tsv.tmp")):
    name, rc, sec, bound = line.split()
    print(f"| {name} | {rc} | {sec} | {bound} |")
print("\n## Targets\n\n| what | measured | limit | result |\n|:---|---:|---:|:---|")
try:
    doc = json.load(open(os.path.join(out, "bench_floor.json")))
    for v in doc["verdicts"]:
        ok = "no verdict" if v["ok"] is None else ("PASS" if v["ok"] else "FAIL")
        print(f"| {v['what']} | {v['measured']} | {v['limit']} | {ok} |")
except Exception as exc:
    print(f"| bench_floor | no result ({type(exc).__name__}) | | |")
try:
    doc = json.load(open(os.path.join(out, "bench_page_tables.json")))
    for case in doc["cases"]:
        b, dev = case["b"], case["gpu_us"]
        a, t = dev["step"]["p50"], dev["step_tables"]["p50"]
        res = ("PASS" if t - a <= 5.0 else "FAIL") if b == 256 else "info"
        print(f"| page tables add on the GPU at B = {b}, 128k context (step_tables - step, "
              f"p50 us; tables equal the eager ones: {case.get('outputs_equal')}) | "
              f"{t - a:.1f} | {'5.0' if b == 256 else '-'} | {res} |")
except Exception as exc:
    print(f"| bench_page_tables | no result ({type(exc).__name__}) | | |")
EOF
rm -f "$out/phases.tsv.tmp"
cat "$out/summary.md" | tee -a "$out/run.log"
exit $status
