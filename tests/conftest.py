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
# the CPU redirected to CUDA (same backend, same expected values), with
# torch.cuda.set_sync_debug_mode("error") on for every test, so any host/device sync
# outside the sanctioned check points (graphalloc.sync_points) fails the test.
CORE_DEVICE = os.environ.get("GRAPHALLOC_TEST_DEVICE", "cpu")

if CORE_DEVICE == "cuda":
    import graphalloc.config as _config

    _post_init = _config.AllocatorConfig.__post_init__

    def _on_cuda(self):
        if torch.device(self.device).type == "cpu":
            object.__setattr__(self, "device", "cuda")
        _post_init(self)

    _config.AllocatorConfig.__post_init__ = _on_cuda


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _sync_debug_on_cuda():
    if CORE_DEVICE != "cuda":
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)
