#!/usr/bin/env bash
# Install SGLang from the package index into an environment of its own (never the
# project's .venv), for the conformance run and the SGLang-path benchmark.
#
#   tools/engines/install_sglang.sh [ENV_DIR]     (default: .engines/sglang)
#
# SGLang's full install (sglang==0.5.23) pins a CUDA build of torch 2.14.1, flashinfer,
# sglang-kernel and other GPU-only wheels: it cannot run on a CPU-only machine. On a CPU
# machine this installs torch (CPU) first, then sglang itself WITHOUT its dependencies,
# then only the packages its mem_cache / managers (allocation path, caches, scheduling)
# import, with torch held at the version already installed (a constraint file), so pip
# never pulls a CUDA torch. On a machine with a GPU pass FULL=1 for the plain install.
set -euo pipefail
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
ENV_DIR=${1:-.engines/sglang}
PY=${PYTHON:-python3}

if [ ! -x "$ENV_DIR/bin/python" ]; then
    "$PY" -m venv "$ENV_DIR"
fi
PIP=("$ENV_DIR/bin/python" -m pip install --progress-bar off --disable-pip-version-check -q)
REPO="$(dirname "$0")/../.."
if [ "${FULL:-0}" = "1" ]; then  # a GPU machine: SGLang as its index entry pins it
    "${PIP[@]}" "sglang==$SGLANG_VERSION" pytest hypothesis
    "${PIP[@]}" --no-deps -e "$REPO"
    exit 0
fi
"${PIP[@]}" "torch==$TORCH_VERSION"
HOLD=$(mktemp)
trap 'rm -f "$HOLD"' EXIT
echo "torch==$TORCH_VERSION" > "$HOLD"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
# What `import sglang.srt.mem_cache.allocation` and the caches' modules import, found by
# importing them until nothing is missing (the list for 0.5.23).
"${PIP[@]}" -c "$HOLD" numpy triton orjson psutil pybase64 requests packaging pillow \
    starlette msgspec pydantic pyzmq tqdm IPython aiohttp transformers dill sentencepiece \
    gguf openai partial_json_parser "compressed-tensors==0.18.0" "apache-tvm-ffi==0.1.11"
# Not installed: torchvision. Its wheels on the index are built against a CUDA torch, and
# only two multimodal modules import it at module level (sglang.srt.configs.deepseek_ocr,
# sglang.srt.multimodal.internvl_utils); tools/engines/sglang_import.py stands in for those
# two modules before importing SGLang, and nothing on the allocation path calls them.
# graphalloc itself (the repository this script is in), without dependencies: the
# environment already has torch and numpy.
"${PIP[@]}" --no-deps -e "$REPO"
"${PIP[@]}" -c "$HOLD" pytest hypothesis  # the tests that need SGLang run here
PYTHONPATH="$(dirname "$0")" "$ENV_DIR/bin/python" -c \
    "import sglang_import; sglang_import.import_sglang(); print('ok')" \
    && echo "sglang $SGLANG_VERSION installed in $ENV_DIR (CPU, partial: mem_cache + managers)"
