#!/usr/bin/env bash
# The GPU run: install, the whole suite on CUDA (sync-debug checks inside the CUDA tests),
# compute-sanitizer memcheck and racecheck over every kernel. Writes logs under $1.
#   bash tests/gpu/run_gpu_suite.sh OUTDIR
set -uo pipefail
out=${1:?usage: run_gpu_suite.sh OUTDIR}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$out/machine.txt" 2>&1
PYTHONUNBUFFERED=1 timeout "${SUITE_TIMEOUT:-400}" python3 -m pytest -q -rs -s tests -p no:cacheprovider ${PYTEST_ARGS:-} -k "${PYTEST_K:-}" \
  > "$out/pytest_cuda.log" 2>&1
echo "pytest exit $?" >> "$out/pytest_cuda.log"
for tool in memcheck racecheck; do
  timeout "${SAN_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 3 python3 tests/gpu/sanitize_kernels.py 20 \
    > "$out/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool exit $?" >> "$out/sanitizer_$tool.log"
done
tail -n 3 "$out"/*.log
