"""Import SGLang's allocation path on a CPU-only machine (the conformance run, the tests
that need SGLang, the SGLang-path benchmark).

SGLang's CPU install here is partial (``tools/engines/install_sglang.sh``): torchvision is
absent because its wheels are built against a CUDA torch, and two multimodal modules of
SGLang import it at module level. :func:`import_sglang` puts a stand-in for those two
modules into ``sys.modules`` (only when torchvision cannot be imported), then imports the
modules the allocation path and the caches live in, and returns them by short name. The
stand-ins answer any attribute with an inert placeholder; nothing on the allocation path
reaches them. Returns ``None`` when SGLang is not installed.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["import_sglang", "STANDINS"]

# SGLang modules importing torchvision at module level, stood in for when it is missing.
STANDINS = ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr")

MODULES = {
    "allocation": "sglang.srt.mem_cache.allocation",
    "common": "sglang.srt.mem_cache.common",
    "paged": "sglang.srt.mem_cache.allocator.paged",
    "base": "sglang.srt.mem_cache.allocator.base",
    "swa": "sglang.srt.mem_cache.allocator.swa",
    "memory_pool": "sglang.srt.mem_cache.memory_pool",
    "swa_memory_pool": "sglang.srt.mem_cache.swa_memory_pool",
}


class _Placeholder(type):
    """A class whose every attribute and call is itself (an inert stand-in value)."""

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return cls

    def __call__(cls, *args, **kwargs):
        return cls


def _standin(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    placeholder = _Placeholder("Placeholder", (), {})

    def attribute(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return placeholder

    module.__getattr__ = attribute
    return module


def import_sglang() -> dict | None:
    """SGLang's allocation-path modules (see ``MODULES``), or ``None`` without SGLang."""
    if importlib.util.find_spec("sglang") is None:
        return None
    if importlib.util.find_spec("torchvision") is None:
        for name in STANDINS:
            sys.modules.setdefault(name, _standin(name))
    return {short: importlib.import_module(full) for short, full in MODULES.items()}
