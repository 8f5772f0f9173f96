#!/usr/bin/env bash
# Install vLLM 0.33.0's scheduler into an environment of its own (never the project's .venv).
#
# vLLM's normal install pulls a CUDA build of torch and the GPU kernels (about 9 GB); its v1
# scheduler and KV-cache manager are plain Python. So: a venv, the CPU build of torch, vLLM
# (with the triton graphalloc imports) itself without dependencies, then only the pinned packages that the scheduler, the KV-cache
# manager and the config import (requirements.txt, found by importing them until nothing was
# missing), again without dependencies so nothing else comes along. graphalloc goes in
# editable, without dependencies (torch and numpy are there already).
#
#   VLLM_ENV   where the environment goes (default: ~/.cache/graphalloc/engines/vllm-0.33.0;
#              make engines-vllm passes .engines/vllm, ignored by git)
#   PY_SYS     the python that creates it (default: python3, 3.10-3.12)
#   TORCH_SPEC the torch requirement (default: torch==2.13.0; on a machine whose pip finds
#              only CUDA builds, point it at a CPU wheel)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
VLLM_ENV="${VLLM_ENV:-$HOME/.cache/graphalloc/engines/vllm-0.33.0}"
PY_SYS="${PY_SYS:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
pip_q=(--disable-pip-version-check --progress-bar off -q)
if [ ! -x "$VLLM_ENV/bin/python" ]; then
    echo "engines/vllm: creating $VLLM_ENV"
    "$PY_SYS" -m venv "$VLLM_ENV"
fi
py="$VLLM_ENV/bin/python"
if ! "$py" -c "import vllm, torch, graphalloc" >/dev/null 2>&1; then
    echo "engines/vllm: installing $TORCH_SPEC, vllm==0.33.0 (no deps) and the scheduler's imports"
    "$py" -m pip install "${pip_q[@]}" "$TORCH_SPEC" triton==3.7.1 numpy
    "$py" -m pip install "${pip_q[@]}" --no-deps vllm==0.33.0
    "$py" -m pip install "${pip_q[@]}" --no-deps -r "$here/requirements.txt"
    "$py" -m pip install "${pip_q[@]}" --no-deps -e "$root"
fi
HF_HUB_OFFLINE=1 "$py" -c "from vllm.v1.core.sched.scheduler import Scheduler; import graphalloc" \
    2>/dev/null && echo "engines/vllm: $VLLM_ENV ready"
