"""The vLLM plug-in's iteration: ONE graphalloc step planned at the first block-id read.

Contract. A mixin of :class:`~graphalloc.integrations.vllm_manager.GraphallocKVCacheManager`
(its state is the manager's). :meth:`IterationPlan.flush` turns what the scheduler's calls
recorded -- cache-entry takes and the drops they supersede, releases, window moves (SWA
frontiers), admits (plain or on a hit), extends -- into one ``Step`` and runs it
(``alloc.plan`` + ``alloc.run``); block ids are then read from the host page mirror
(``ledger.refs.page_of``, ``swa_of``, ``state_slot``), the pages the step writes. A step
refused for pages vLLM's count calls free is run again without a released row's takes, or
as admits then allocations (:meth:`IterationPlan._run_short`).

The step is assembled in the one Step accumulator (``_acc``, a
:class:`~graphalloc.plan.accumulator.StepAccumulator`: one vectorised append per kind of the
per-row records, which vLLM's calls replace and remove row by row); a new request's row is
the accumulator's lowest free row (not live, not admitted by the recorded step), a cache
entry's handle its lowest free handle (``_take_acc``: not held, not reserved by a take of
the same step).

Invariants: nothing recorded survives a flush; rows released by a flush return to the free
rows only after it ran (they are live until then); the row holder counts follow every
admitted, extended and released row. Cost: ``flush`` O(rows) numpy + one plan; an id read
O(blocks) numpy.
"""

from __future__ import annotations

import numpy as np

from ..errors import CapacityError, ContractError
from .vllm_blocks import LazyBlocks

__all__ = ["IterationPlan"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class IterationPlan:
    """The step half of the plug-in (see the module docstring)."""

    # ---- block ids: the step ----------------------------------------------------------------
    def get_blocks(self, request_id) -> LazyBlocks:
        row = self._row.get(request_id)
        if row is None:
            return self.empty_kv_cache_blocks
        return LazyBlocks(self, request_id, 0, _cdiv(self._len[row], self.block_size))

    def get_block_ids(self, request_id) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def resolve_block_ids(self, blocks: LazyBlocks) -> tuple[list[int], ...]:
        """Ids of ``blocks`` from the page mirror (the step planned first if records are
        pending). O(blocks) numpy."""
        if self._pending():
            self.flush()
        row = self._row.get(blocks.request_id)
        if row is None:
            raise ContractError(f"block ids of {blocks.request_id!r}: the request holds "
                                "no blocks here")
        full = self._refs.page_of[row, blocks.first_block:blocks.end_block]
        out = [full.tolist()]
        if self.swa_group > 0:
            skip = self._skip[row] - blocks.first_block
            if self.mamba:  # one state slot per request: the live blocks name it
                n = blocks.end_block - blocks.first_block
                slot = int(self.alloc.ledger.state_slot[row])
                k = min(max(skip, 0), n)
                out.append([0] * k + [slot] * (n - k))
                return tuple(out)
            swa = self._refs.swa_of[full]
            if skip > 0:
                swa = swa.copy()
                swa[:skip] = 0
            out.append(swa.tolist())
        return tuple(out)

    def _pending(self) -> bool:
        return self._dirty

    def flush(self):
        """Run everything recorded as ONE graphalloc step (``alloc.plan`` +
        ``alloc.run``): cache entries of blocks filled since the last step (takes),
        releases, window moves, admits (plain or on a hit), extends. O(rows) numpy + one
        plan. Returns the step's ``AllocResult`` (``None``: nothing to run)."""
        from ..plan.step import Step

        acc, inserts = self._acc, []
        acc.clear()
        if self.enable_caching:
            inserts = self._takes()
            if inserts:
                acc.put_kinds(self._take_kw(inserts))
        acc.put_kinds({  # (the per-row records as arrays: one vectorised append per kind)
            "release": np.array(self._rel, dtype=np.int64) if self._rel else None,
            "advance": (np.fromiter(self._adv.keys(), np.int64, len(self._adv)),
                        np.fromiter(self._adv.values(), np.int64, len(self._adv)))
            if self._adv else None,
            "admit": np.array(self._admit, dtype=np.int64) if self._admit else None,
            "admit_on": tuple(np.ascontiguousarray(np.array(self._on, dtype=np.int64).T))
            if self._on else None,
            "extend": (np.fromiter(self._ext.keys(), np.int64, len(self._ext)),
                       np.fromiter(self._ext.values(), np.int64, len(self._ext)))
            if self._ext else None})
        kw = acc.to_kinds()
        if not kw:
            self._dirty = False
            return None
        alloc = self.alloc
        refs = self._row_refs
        if refs is not None:  # the extended rows' pages before the step (new rows: none)
            ext_rows = kw["extend"][0] if "extend" in kw else np.zeros(0, np.int64)
            bs = self.block_size
            before = (alloc.ledger.seq_len[ext_rows] + bs - 1) // bs
            if self._new_rows:
                before[np.isin(ext_rows, list(self._new_rows))] = 0
        try:
            result = alloc.run(alloc.plan(Step(**kw)))
        except CapacityError:
            result, inserts = self._run_short(kw, inserts)
        self.steps += 1
        if refs is not None:  # the new pages (and the hits) gain a holder
            after = (alloc.ledger.seq_len[ext_rows] + bs - 1) // bs
            grown = np.flatnonzero(after > before)  # rows with new pages: one add for all
            if len(grown):
                page_of = self._refs.page_of
                pages = [page_of[r, b:a] for r, b, a in zip(
                    ext_rows[grown].tolist(), before[grown].tolist(), after[grown].tolist(),
                    strict=True)]
                np.add.at(refs, np.concatenate(pages), 1)
            for row, _, n in self._on:
                if row not in self._ext:
                    np.add.at(refs, self._refs.page_of[row, :n // self.block_size], 1)
            self._register(inserts)
        for handle in self._locked:
            self.cache.unlock(handle)
        for row in self._rel:
            self._req[row] = None
            self._cached[row] = self._cache_to[row] = 0
            self._entry_of[row] = -1
            self._due.discard(row)  # (its row is free once the step ran: not live)
        if self._rel and self._filling:  # blocks of released rows never taken: forgotten
            released = set(self._rel)
            self._filling = {k: r for k, r in self._filling.items() if r not in released}
        self._recs()
        return result

    def _run_short(self, kw: dict, inserts: list):
        """The step was refused for pages that vLLM's count calls free: cache pages an
        entry made in the step pins (a released row's), or the tail of an entry a request
        is admitted on (graphalloc keeps the whole entry until the admit ran; vLLM holds
        only the hit's blocks). Plan without the released rows' takes; if still short,
        run the admits first and the allocations as a second step, when the entries
        admitted on can be evicted. Returns ``(result, inserts run)``."""
        from ..plan.step import Step

        alloc = self.alloc
        keep = [t for t in inserts if t[1] not in self._rel]
        if len(keep) < len(inserts):
            self.takes_dropped += len(inserts) - len(keep)
            inserts = keep
            kw.pop("take")
            kw.pop("drop", None)
            if keep:
                kw.update(self._take_kw(keep))
            try:
                return alloc.run(alloc.plan(Step(**kw))), inserts
            except CapacityError:
                if "admit_on" not in kw:
                    raise
        elif "admit_on" not in kw or "extend" not in kw:
            raise
        extend = kw.pop("extend")
        alloc.run(alloc.plan(Step(**kw)))  # frees, takes, admits: nothing allocated
        for handle in self._locked:
            self.cache.unlock(handle)
        self._locked = []
        self.split_steps += 1
        return alloc.run(alloc.plan(Step(extend=extend))), inserts
