#!/usr/bin/env bash
# One device call, several GPU runs: each NAME=COMMAND phase runs under its own bound, its
# outputs go to WORK/NAME/ and are packed into OUT/NAME.tgz when it ends (a device call
# returns at most 8 files, so each phase is one archive), its exit code and seconds into
# OUT/phases.tsv. A phase is skipped once the call's own budget (BUDGET_S, default 560)
# would be overrun by its bound.
#
#   bash tests/gpu/run_phases.sh OUT "suite:480:bash tests/gpu/run_gpu_suite.sh {dir}" ...
#
# In each COMMAND, {dir} is the phase's output folder. The editable install runs first.
set -uo pipefail
out=${1:?usage: bash tests/gpu/run_phases.sh OUT NAME:BOUND_S:COMMAND ...}
shift
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
work=${WORK:-/tmp/phases}
mkdir -p "$work"
budget=${BUDGET_S:-560}
start=$(date +%s)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; } >> "$out/install.log" 2>&1
status=0
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; bound=${rest%%:*}; cmd=${rest#*:}
  used=$(( $(date +%s) - start ))
  if (( used + bound > budget )); then
    printf '%s\tskipped\t0\t%s\n' "$name" "$bound" >> "$out/phases.tsv"; continue
  fi
  dir="$work/$name"; mkdir -p "$dir"
  t0=$(date +%s)
  timeout -k 3 "$bound" bash -c "${cmd//\{dir\}/$dir}" > "$dir/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$bound" >> "$out/phases.tsv"
  tar -czf "$out/$name.tgz" -C "$work" "$name"
  (( rc == 0 )) || status=1
done
cat "$out/phases.tsv"
exit $status
