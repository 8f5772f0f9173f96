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

.PHONY: install test demo lint bench
install:
	@if [ "$(PY)" = ".venv/bin/python" ] && [ ! -x .venv/bin/python ]; then $(PY_SYS) -m venv .venv; fi
	@if [ "$(HAVE_TORCH)" != "yes" ] && [ "$(HAVE_GPU)" != "yes" ]; then \
		$(PY) -m pip install -q $(CPU_TORCH) -e ".[test,bench]"; \
	else \
		$(PY) -m pip install -q -e ".[test,bench]"; \
	fi

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

# The read-me-first example (examples/first_steps.py): < 1 min on a 2-core CPU.
demo: install
	$(PY) examples/first_steps.py

lint: install
	$(PY) -m ruff check .

bench: install
	$(PY) benchmarks/bench_frees.py
