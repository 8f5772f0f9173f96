"""The old names graphalloc still accepts, each with its replacement, and the one warning.

One meaning per word (``docs/glossary.md``), counts as the engines count them. The forms
below were renamed for that; each still works for one release and warns with a
``DeprecationWarning`` naming its replacement, attributed to the caller's line (the first
frame outside graphalloc), so ``-W error::DeprecationWarning`` finds every old use.

==========================================  ===============================================
old form                                    replacement
==========================================  ===============================================
``AllocatorConfig(sliding_window=W - 1)``   ``AllocatorConfig(model_window=W)``
``AllocatorConfig(max_spec_tokens=1 + k)``  ``AllocatorConfig(num_lookahead_tokens=k)``
``for_engine(model_sliding_window=W)``      ``for_engine(model_window=W)``
``step(commit=(rows, n_kept))``             ``step(accept=(rows, n_kept - 1))``
``alloc.commit`` / ``it.commit(rows, n)``   ``alloc.accept`` / ``it.accept(rows, n - 1)``
``PrefixCache.evict(n_full, n_swa)``        ``PrefixCache.reclaim(n_full, n_swa)``
``PrefixCache.evicted_pages``               ``PrefixCache.dropped_pages``
``stats()["cache_evicted_pages"]``          ``stats()["cache_dropped_pages"]`` (no warning)
==========================================  ===============================================

Why: ``num_lookahead_tokens`` and ``accept`` count k and the accepted drafts, as vLLM's
``num_speculative_tokens`` and ``num_accepted_tokens`` do (the step keeps the verified
token and the accepted drafts: ``1 + n_accepted``); ``model_window`` is the constructor's
and ``for_engine``'s one name for the model's window; "evict" is the window sliding only,
and a prefix cache's entries are reclaimed (dropped, or tombstoned). Cost: O(stack depth)
per warning, nothing otherwise.
"""

from __future__ import annotations

import inspect
import warnings

__all__ = ["warn_renamed"]


def warn_renamed(message: str) -> None:
    """Warn once per call site that an old form was used; ``message`` names the old form and
    its replacement. The warning points at the first frame outside graphalloc."""
    level, frame = 2, inspect.currentframe().f_back
    while frame is not None and _ours(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _ours(frame) -> bool:
    """A frame of graphalloc's code (a dataclass's generated ``__init__`` included: it runs
    in its module's globals)."""
    name = frame.f_globals.get("__name__") or ""
    return name == "graphalloc" or name.startswith("graphalloc.")
