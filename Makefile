# Set-up and entry points. `make test` and `make demo` work on a fresh machine:
# they use the python3 on PATH when it already imports torch (for example a CUDA
# environment), and otherwise create .venv with the CPU build of torch.
SHELL := /bin/bash
PY_SYS ?= python3
HAVE_TORCH := $(shell $(PY_SYS) -c "import torch" >/dev/null 2>&1 && echo yes)
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_TORCH),yes)
PY := $(PY_SYS)
else
PY := .venv/bin/python
endif
# CPU wheels, installed before (together with) the project so pip never pulls a CUDA torch.
CPU_TORCH := torch==2.13.0 triton==3.7.1

.PHONY: install reinstall test demo lint bench engines engines-sglang engines-vllm
# pip prints one line per package it collects and installs (about 2.5 minutes on a fresh
# 2-core machine, most of it torch): the progress of a first `make test`.
PIP_PROGRESS := --progress-bar off --disable-pip-version-check
# pip runs once, and again only when what it builds changed (the package metadata or the
# C sources: the planner, the input conversion, the page keys; the Python is installed
# editable): a stamp per interpreter.
# `make reinstall` forces it.
INSTALL_STAMP := $(if $(filter .venv/bin/python,$(PY)),.venv/.graphalloc-installed,build/.graphalloc-installed-$(subst /,_,$(PY)))
INSTALL_DEPS := setup.py pyproject.toml $(wildcard graphalloc/*.c graphalloc/*/*.c graphalloc/*/*.h)
install: $(INSTALL_STAMP)
reinstall:
	rm -f $(INSTALL_STAMP)
	$(MAKE) install
$(INSTALL_STAMP): $(INSTALL_DEPS)
	@if [ "$(PY)" = ".venv/bin/python" ] && [ ! -x .venv/bin/python ]; then \
		echo "make: creating .venv with $(PY_SYS)"; $(PY_SYS) -m venv .venv; fi
	@set -o pipefail; if [ "$(HAVE_TORCH)" != "yes" ] && [ "$(HAVE_GPU)" != "yes" ]; then \
		echo "make: installing $(CPU_TORCH) and graphalloc[test,bench] into $(PY)"; \
		$(PY) -m pip install $(PIP_PROGRESS) $(CPU_TORCH) -e ".[test,bench]" \
			| { grep -E --line-buffered '^(Collecting|Installing|Successfully|Building|ERROR)' || true; }; \
	else \
		echo "make: installing graphalloc[test,bench] into $(PY)"; \
		$(PY) -m pip install $(PIP_PROGRESS) -e ".[test,bench]" \
			| { grep -E --line-buffered '^(Collecting|Installing|Successfully|Building|ERROR)' || true; }; \
	fi
	@mkdir -p $(dir $@) && touch $@

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

# The read-me-first example (examples/first_steps.py): < 20 s on a 2-core CPU once installed.
demo: install
	$(PY) examples/first_steps.py

lint: install
	$(PY) -m ruff check .

bench: install
	$(PY) benchmarks/bench_frees.py

# SGLang conformance: SGLang from the package index in an environment of its own
# (.engines/sglang, never .venv; on a CPU machine a partial install, see the script), then
# SGLang's allocation path run with its own allocator and with graphalloc's, step by step.
ENGINE_ENVS ?= .engines
SGLANG_VERSION ?= 0.5.23
engines-sglang:
	SGLANG_VERSION=$(SGLANG_VERSION) bash tools/engines/install_sglang.sh $(ENGINE_ENVS)/sglang
	$(ENGINE_ENVS)/sglang/bin/python -m pytest -q -p no:cacheprovider \
		tests/engines/test_sglang_engine.py tests/engines/test_sglang_signature.py \
		tests/engines/test_sglang_mamba.py
	$(ENGINE_ENVS)/sglang/bin/python tools/engines/conform_sglang.py \
		--out results/engines/sglang-$(SGLANG_VERSION)

# vLLM conformance: vLLM 0.33.0 without its CUDA dependencies in an environment of its own
# (VLLM_ENV, default .engines/vllm, never .venv; see engines/vllm/install.sh), then vLLM's
# real scheduler run with its own KV-cache manager and with graphalloc's, step by step;
# writes results/engines/vllm-0.33.0/summary.json (exit 1 when a workload differs).
VLLM_ENV ?= $(ENGINE_ENVS)/vllm
engines-vllm:
	VLLM_ENV=$(VLLM_ENV) bash engines/vllm/install.sh
	$(VLLM_ENV)/bin/python engines/vllm/conformance.py --out results/engines/vllm-0.33.0

# Both engines' conformance.
engines: engines-sglang engines-vllm
