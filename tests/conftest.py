"""Test set-up: Triton runs through its interpreter when no GPU is present.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
so this runs before graphalloc is imported by any test module.
"""

import os
import sys

import torch

# Shared helpers (the reference model, the random workload) live in tests/lib; the tests in
# each room import them by name, and the replica room the self-test command in tools/.
_TESTS = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(os.path.dirname(_TESTS), "tools")
sys.path[:0] = [os.path.join(_TESTS, "lib"), TOOLS]

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

    for _name in ("run", "launch", "admit"):
        setattr(_allocator.HybridAllocator, _name,
                _no_sync(getattr(_allocator.HybridAllocator, _name)))
    import graphalloc.plan.pipeline as _pipeline  # planning (the ring's wait is apart)

    _pipeline.StepPipeline.outcome = _no_sync(_pipeline.StepPipeline.outcome)


# Hypothesis example counts. GRAPHALLOC_HYPOTHESIS_MAX_EXAMPLES=N caps max_examples of every
# hypothesis test at N: a settings profile (loaded below) for tests without their own
# settings, and, since an explicit ``settings(max_examples=...)`` (test_model_vs_allocator
# pins 50 on its TestCase classes, test_contracts pins its own) beats any profile, those
# are capped at collection. Default: no cap on the CPU; 8 when the core suite runs on CUDA
# (GRAPHALLOC_TEST_DEVICE=cuda), where each example costs device round trips. 0: no cap.
HYPOTHESIS_CAP = int(os.environ.get("GRAPHALLOC_HYPOTHESIS_MAX_EXAMPLES")
                     or (8 if CORE_DEVICE == "cuda" else 0))
if HYPOTHESIS_CAP > 0:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("graphalloc-capped", max_examples=HYPOTHESIS_CAP)
    _hypothesis_settings.load_profile("graphalloc-capped")


def _cap_hypothesis(item) -> None:
    from hypothesis import settings

    def capped(current):
        if isinstance(current, settings) and current.max_examples > HYPOTHESIS_CAP:
            return settings(current, max_examples=HYPOTHESIS_CAP)
        return None

    cls = getattr(item, "cls", None)  # a stateful machine's TestCase: read per run
    new = capped(getattr(cls, "settings", None)) if cls is not None else None
    if new is not None:
        cls.settings = new
    fn = getattr(item, "obj", None)  # an @given test: read per call
    new = capped(getattr(fn, "_hypothesis_internal_use_settings", None))
    if new is not None:
        fn._hypothesis_internal_use_settings = new


@pytest.hookimpl(tryfirst=True)  # before -m deselects on the markers added here
def pytest_collection_modifyitems(config, items):
    """Markers the GPU run (tests/gpu/run_gpu_suite.sh) selects on. ``soak``: every test
    whose name contains "soak" (`make test` runs them; the default GPU run deselects them,
    its --soak mode runs them). ``on_device``: marked ``cuda`` or asks for the ``device``
    fixture, i.e. runs on the GPU when there is one."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
        if "soak" in getattr(item, "originalname", item.name) and "soak" not in item.keywords:
            item.add_marker(pytest.mark.soak)
        if "cuda" in item.keywords or "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.on_device)
        if HYPOTHESIS_CAP > 0:
            _cap_hypothesis(item)


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
