"""A vLLM-v1 ``KVCacheManager``-shaped facade, one graphalloc step per ``schedule()``.

vLLM's scheduler, per ``schedule()``: for each running request
``allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)``, and on ``None``
preempts the lowest-priority running request (``free(request)``) and retries; then for
each waiting request ``get_computed_blocks(request)`` (the prefix-cache lookup) and
``allocate_slots(...)``, stopping at the first ``None``. After the forward,
``update_from_output`` frees each finished request with ``free(request)``. With a
hybrid model its KV cache has one group per attention type (here FULL = 0 and
SWA = 1); the sliding-window manager replaces the blocks that fell out of the window
by the null block (id 0) and frees them, before it allocates.

:class:`GraphallocKVCacheManager` answers the same calls, per call and O(1) on the
host (pages accounted as :mod:`.iteration` explains), and records them;
:meth:`GraphallocKVCacheManager.run_step` -- one line the engine adds at the end of
``schedule()`` -- runs everything recorded since the last one (the previous
iteration's frees, this one's preemptions, window removals and allocations) as ONE
:meth:`HybridAllocator.step`.

Request ids are any hashable (dict keys, so ids equal under ``==`` -- ``1``, ``1.0``,
``True`` -- are ONE request); each live id maps to a request row.

Lookahead (speculative tokens): a call makes the request's allocation cover
``min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, max_model_len)``
positions and only allocates what is missing. Slots of rejected speculative tokens
stay with the request (allocation never shrinks) and are reused by its next tokens.
vLLM's scheduler lowers ``request.num_computed_tokens`` by the rejected tokens: pass
it as ``num_computed_tokens=`` (without it the facade assumes every scheduled token
was computed).

Block ids: graphalloc's page ids live in device tables (its public host queries give
counts and positions, not ids), so :meth:`GraphallocKVCacheManager.get_block_ids`
READS THE DEVICE: one device-to-host copy per group, which waits for every queued
step (a synchronisation). It is the inspection and debugging path (a public host
query of a row's page ids would make it sync-free). The hot path never needs
ids on the host: the model writes KV to :meth:`~GraphallocKVCacheManager.token_slots`
(device views) and reads block tables from :class:`graphalloc.page_tables.PageTables`
(``block_table[B, max_pages]`` in vLLM's layout, null block 0 outside the window,
written on the device in the step). ``allocate_slots`` returns block *positions*
(which block indices are new, known on the host); ``GraphallocBlocks.get_block_ids``
reads their ids the same way.

Launches per iteration. vLLM's ``KVCacheManager`` is host Python (block objects and
lists, O(blocks touched) per call); the device work is the worker's upload of the
changed block-table rows (one host-to-device copy per group) and the slot-mapping
computation. Here: ONE graphalloc step writes ``req_to_token``/``full_to_swa`` (one
fused kernel, or one graph replay with ``executor="graph"``), no host/device
synchronisation; page tables add one kernel (or ride in the engine's graph).

Covers: ``allocate_slots`` (chunked prefill, decode, lookahead, sliding-window removal
before allocation, ``None`` = back-pressure with nothing changed), ``free``,
``get_block_ids`` per group, ``get_computed_blocks`` answering as vLLM does with
prefix caching disabled, hashable request ids, free-block and usage queries.

Does not cover: the prefix cache (``enable_caching=True`` is refused;
``get_computed_blocks`` always returns no hit; the prefix cache being built on the
allocator's handles is NOT wired yet), KV connectors / external computed tokens, encoder
(cross-attention) tokens, ``delay_cache_blocks``, watermarks, cascade attention's
common-prefix query, KV events, more than two groups or per-group block sizes,
ring mode. Unlike vLLM, a call that returns ``None`` does not free the request's
out-of-window blocks either (nothing changes); the next successful call does.

What an engine must still write: the ``run_step()`` call after the scheduling loop;
the slot mapping and attention metadata from :meth:`token_slots` /
:meth:`row_of` + ``PageTables`` instead of block ids; ``num_computed_tokens=`` under
speculative decoding; ``alloc.check()`` where it synchronises anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

from ..allocator import AllocResult, HybridAllocator
from ..errors import ConfigError, ContractError, PendingStepError, PositionError
from ..sync_points import sync_allowed
from .iteration import IterationStep

__all__ = ["GraphallocKVCacheManager", "GraphallocBlocks", "FULL_GROUP", "SWA_GROUP",
           "NULL_BLOCK_ID"]

FULL_GROUP = 0  # index of the full-attention KV-cache group in block-id tuples
SWA_GROUP = 1  # index of the sliding-window group
NULL_BLOCK_ID = 0  # the null block: graphalloc's sink page 0, never allocated


def _count(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or (
            value < 0):
        raise ContractError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


@dataclasses.dataclass(eq=False)
class GraphallocBlocks:
    """``KVCacheBlocks``-shaped answer of ``allocate_slots``: the request's new blocks
    are block indices ``[first_block, first_block + num_blocks)`` of its table, in each
    group (FULL and SWA allocate the same count). Host ints; the ids need a device read
    (:meth:`get_block_ids`)."""

    request_id: Hashable
    first_block: int
    num_blocks: int
    manager: GraphallocKVCacheManager = dataclasses.field(repr=False)

    def get_block_ids(self) -> tuple[list[int], list[int]]:
        """The new blocks' ids per group, ``(FULL, SWA)``: a DEVICE READ (synchronises),
        after :meth:`GraphallocKVCacheManager.run_step`. For inspection and tests."""
        if not self.num_blocks:
            return [], []
        full, swa = self.manager.get_block_ids(self.request_id)
        end = self.first_block + self.num_blocks
        return full[self.first_block:end], swa[self.first_block:end]


class GraphallocKVCacheManager:
    """vLLM ``KVCacheManager`` calls over a pool-mode :class:`HybridAllocator`.

    Args:
        alloc: the allocator (pool mode). ``sliding_window`` is the allocator's window,
            ``W_model - 1`` (``AllocatorConfig.for_engine`` converts the model's); the
            blocks wholly below ``num_computed_tokens - sliding_window`` are removed,
            vLLM's ``max(0, num_computed_tokens - W_model + 1)`` skipped tokens.
            ``max_reqs`` must cover the running requests plus one iteration's frees.
        enable_caching: only ``False``: the prefix cache is not wired yet.

    Invariants: each live request id owns one row; recorded work belongs to the next
    :meth:`run_step`; a ``None`` answer changed nothing. Cost: ``allocate_slots`` and
    ``free`` are O(1) host work, no plan, no device work (measured on a CPU at 256
    requests: about 7 us per running request's call, 2 us per ``free``; a new request
    adds ``alloc.admit()``, host only, about 35 us); ``run_step`` is one step.
    """

    def __init__(self, alloc: HybridAllocator, *, enable_caching: bool = False):
        self.pending = IterationStep(alloc, "GraphallocKVCacheManager")
        if enable_caching is not False:
            raise ConfigError("enable_caching=True: the prefix cache is not wired into "
                              "graphalloc.integrations.vllm yet; build with "
                              "enable_caching=False")
        self.alloc = alloc
        self.block_size = alloc.config.page_size
        self.sliding_window = alloc.config.sliding_window
        self.max_model_len = alloc.config.max_context_len
        self.enable_caching = False
        self.steps_last_run = 0
        self._rows: dict[Hashable, int] = {}
        self._computed: dict[Hashable, int] = {}

    # ---- the scheduler's calls ---------------------------------------------------------
    def get_computed_blocks(self, request_id: Hashable) -> tuple[GraphallocBlocks, int]:
        """``(no blocks, 0 computed tokens)``: vLLM's answer with prefix caching disabled.
        The prefix cache is NOT wired yet; this never reports a hit."""
        return GraphallocBlocks(request_id, 0, 0, self), 0

    def allocate_slots(self, request_id: Hashable, num_new_tokens: int,
                       num_lookahead_tokens: int = 0, *, num_computed_tokens: int | None = None,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: GraphallocBlocks | None = None
                       ) -> GraphallocBlocks | None:
        """Make ``request_id`` hold ``computed + num_new_tokens + num_lookahead_tokens``
        positions (at most ``max_model_len``), after removing its blocks below the window
        of ``computed``; recorded for :meth:`run_step`.

        ``num_computed_tokens``: the request's ``num_computed_tokens`` (default: what this
        facade granted so far; 0 for a new request). Returns the new blocks' positions,
        or ``None`` when either pool or the request rows are short: back-pressure,
        nothing changed. A second call for the same request in one iteration replaces
        the first. Raises (nothing changed) on ``num_new_tokens < 1`` (as vLLM), on a
        prefix-cache hit passed in (not wired), and on a batch over the frozen shape.
        """
        n_new = _count(num_new_tokens, "num_new_tokens")
        lookahead = _count(num_lookahead_tokens, "num_lookahead_tokens")
        if n_new < 1:
            raise ContractError("num_new_tokens must be greater than 0")
        if _count(num_new_computed_tokens, "num_new_computed_tokens") or (
                new_computed_blocks is not None and new_computed_blocks.num_blocks):
            raise ContractError("prefix-cache hits (num_new_computed_tokens, "
                                "new_computed_blocks) are not wired into this facade yet")
        row = self._rows.get(request_id)
        computed = _count(self._computed.get(request_id, 0) if num_computed_tokens is None
                          else num_computed_tokens, "num_computed_tokens")
        length = 0 if row is None else self.alloc.seq_len(row)
        if computed > length:
            raise PositionError(f"request {request_id!r}: {computed} computed tokens but "
                                f"{length} allocated; computed tokens must have slots")
        if computed + n_new > self.max_model_len:
            raise PositionError(f"request {request_id!r}: {computed} + {n_new} tokens exceed "
                                f"max_model_len {self.max_model_len}")
        target = min(computed + n_new + lookahead, self.max_model_len)
        floor = max(computed - self.sliding_window, 0) // self.block_size * self.block_size
        rows = self.pending.reserve([(row, target, None if row is None else floor)])
        if rows is None:
            return None
        self._rows[request_id] = rows[0]
        self._computed[request_id] = computed + n_new
        ps = self.block_size
        first = -(-length // ps)
        return GraphallocBlocks(request_id, first, -(-max(target, length) // ps) - first, self)

    def free(self, request_id: Hashable) -> None:
        """Free everything the request holds (finished or preempted); recorded for the
        next step, its pages count as free at once. An unknown id is a no-op (as vLLM).
        A request freed in the same iteration as its ``allocate_slots`` loses that
        allocation."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return
        self._computed.pop(request_id, None)
        self.pending.release(row)

    def run_step(self) -> AllocResult | None:
        """Run everything recorded as ONE step (more only when the recorded frees exceed
        the frozen release shape; ``steps_last_run`` says). Call once per ``schedule()``,
        after its loop, before the forward. Returns the new slots (lanes: the requests in
        the order they were allocated; ``None`` when nothing was allocated). Never
        synchronises."""
        result, self.steps_last_run = self.pending.run()
        return result

    # ---- queries -----------------------------------------------------------------------
    def get_block_ids(self, request_id: Hashable) -> tuple[list[int], list[int]]:
        """The request's block ids per group, ``(FULL, SWA)``, ``ceil(L / block_size)``
        each; SWA ids of removed blocks are ``NULL_BLOCK_ID``. A DEVICE READ (one copy per
        group, synchronises): inspection and debugging only. ``([], [])`` for an unknown
        id. Refused while the request has recorded work (call :meth:`run_step`)."""
        row = self._rows.get(request_id)
        if row is None:
            return [], []
        if row in self.pending.extends or row in self.pending.advances:
            raise PendingStepError(f"get_block_ids({request_id!r}): the request has work "
                                   "recorded for the next step; call run_step() first")
        ps = self.block_size
        n_blocks = -(-self.alloc.seq_len(row) // ps)
        with sync_allowed():  # the documented debug read
            first_slots = self.alloc.req_to_token[row, 0:n_blocks * ps:ps]
            full = (first_slots // ps).tolist()  # sync ok: the documented inspection read
            swa_slots = self.alloc.full_to_swa[first_slots]
            swa = (swa_slots // ps).tolist()  # sync ok: the documented inspection read
        return full, swa

    def token_slots(self, request_id: Hashable, start_pos: int, n_tokens: int):
        """``(full_slots, swa_slots)`` of positions ``[start_pos, start_pos + n_tokens)``:
        a view of ``alloc.req_to_token`` and a gather of ``alloc.full_to_swa``, on the
        device, no synchronisation (the model's slot mapping). Positions must be
        allocated by a step that ran."""
        row = self._row(request_id)
        start, n = _count(start_pos, "start_pos"), _count(n_tokens, "n_tokens")
        if start + n > self.alloc.seq_len(row):
            raise PositionError(f"token_slots({request_id!r}): positions [{start}, "
                                f"{start + n}) but {self.alloc.seq_len(row)} are allocated "
                                "by the steps run so far (run_step() first)")
        full = self.alloc.req_to_token[row, start:start + n]
        return full, self.alloc.full_to_swa[full]

    def row_of(self, request_id: Hashable) -> int:
        """The request's row (for ``PageTables.plan`` and ``alloc``'s queries)."""
        return self._row(request_id)

    def num_computed_tokens(self, request_id: Hashable) -> int:
        """Computed tokens as this facade last recorded them."""
        self._row(request_id)
        return self._computed[request_id]

    def num_allocated_tokens(self, request_id: Hashable) -> int:
        """Positions the request holds once the recorded step has run."""
        return self.pending.length(self._row(request_id))

    def get_num_free_blocks(self) -> int:
        """Free blocks in the scarcer group once the recorded step has run. O(1)."""
        return min(self.pending.free_pages("full"), self.pending.free_pages("swa"))

    @property
    def usage(self) -> float:
        """KV-cache usage in [0, 1], of the fuller group, counting recorded work."""
        cfg = self.alloc.config
        return max(1 - self.pending.free_pages("full") / cfg.num_full_pages,
                   1 - self.pending.free_pages("swa") / cfg.num_swa_pages)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, request_id: Hashable) -> int:
        try:
            return self._rows[request_id]
        except KeyError:
            raise ContractError(f"request {request_id!r} holds no KV cache here (never "
                                "allocated, or freed)") from None
