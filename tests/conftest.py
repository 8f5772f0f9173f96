"""Test set-up: Triton runs through its interpreter when no GPU is present.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
so this runs before graphalloc is imported by any test module.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
# The core suite runs its allocators on the CPU by default; on a GPU machine
# GRAPHALLOC_TEST_DEVICE=cuda runs the same tests with every allocator the suite builds on
# the CPU redirected to CUDA (same backend, same expected values), and every allocator
# operation that touches the device (planning, launching, admitting) runs under
# torch.cuda.set_sync_debug_mode("error"): a host/device sync anywhere on the allocator's
# path fails the test, while the tests' own reads of results stay allowed.
CORE_DEVICE = os.environ.get("GRAPHALLOC_TEST_DEVICE", "cpu")

if CORE_DEVICE == "cuda":
    import functools

    import graphalloc.allocator as _allocator
    import graphalloc.config as _config

    _post_init = _config.AllocatorConfig.__post_init__

    def _on_cuda(self):
        if torch.device(self.device).type == "cpu":
            object.__setattr__(self, "device", "cuda")
        _post_init(self)

    _config.AllocatorConfig.__post_init__ = _on_cuda

    def _no_sync(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            old = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(old)
        return wrapper

    for _name in ("_plan", "run", "launch", "admit"):
        setattr(_allocator.HybridAllocator, _name,
                _no_sync(getattr(_allocator.HybridAllocator, _name)))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE



def assert_same_snapshot(before: dict, after: dict) -> None:
    """Two ``HybridAllocator.snapshot()`` dicts are equal, array by array."""
    import numpy as np

    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, after[key]), f"{key} changed"
        else:
            assert value == after[key], f"{key} changed"
