"""The allocator surface graphalloc targets in SGLang: the methods SGLang's allocation path,
caches and scheduler call on ``token_to_kv_pool_allocator``, with their parameters as the
installed SGLang declares them. ``python tools/engines/sglang_surface.py`` (in SGLang's
environment) rewrites ``tests/engines/sglang_surface.json``, which the default suite's
signature check reads when SGLang is absent."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SURFACE = HERE.parents[1] / "tests" / "engines" / "sglang_surface.json"

METHODS = {
    "swa": ["__init__", "alloc_extend", "alloc_decode", "alloc", "free", "free_swa",
            "free_full", "free_segment", "free_swa_segment", "free_full_segment",
            "free_segments", "free_full_segments", "free_group_begin", "free_group_end",
            "available_size", "full_available_size", "swa_available_size",
            "new_pages_available", "translate_loc_from_full_to_swa",
            "set_full_to_swa_mapping", "clear_full_to_swa_mapping", "clear", "get_kvcache",
            "debug_print", "merge_and_sort_free"],
    "paged": ["__init__", "alloc_extend", "alloc_decode", "alloc", "free", "free_segment",
              "free_page_ids", "free_group_begin", "free_group_end", "available_size",
              "clear", "merge_and_sort_free", "get_all_free_pages"],
    "mamba": ["__init__", "available_size", "schedulable_available_size",
              "alloc_group_begin", "alloc_group_end", "alloc", "free", "clear"],
}
CLASSES = {"swa": ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator"),
           "paged": ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator"),
           "mamba": ("sglang.srt.mem_cache.allocator.mamba", "MambaSlotAllocator")}


def parameters(func) -> list[str]:
    """Named parameters in order, ``self`` and ``*args`` / ``**kwargs`` left out."""
    return [p.name for p in inspect.signature(func).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def read_installed() -> dict:
    import importlib
    out = {}
    for kind, (module, name) in CLASSES.items():
        cls = getattr(importlib.import_module(module), name)
        out[kind] = {m: parameters(getattr(cls, m)) for m in METHODS[kind]}
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import sglang_import
    if sglang_import.import_sglang() is None:
        sys.exit("SGLang is not installed in this environment")
    import sglang
    SURFACE.write_text(json.dumps({"sglang": sglang.__version__, **read_installed()},
                                  indent=1) + "\n")
    print(f"wrote {SURFACE}")
