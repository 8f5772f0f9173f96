"""The replicas' operations: each allocator operation as a fixed number of device steps.

:class:`ReplicaOps` is a part of :class:`graphalloc.replicas.ReplicatedAllocator`. On a
planner (every rank in replicated mode, ``src`` in broadcast mode) an operation is the
allocator's method of the same name; on a broadcast follower it replays the planner's
steps of that operation and returns ``None`` (arguments are ignored). Whatever happens on
the planner, the operation is the same number of device steps on every rank
(:meth:`ReplicaOps._op`): steps it did not run -- it was refused, it raised, it had
nothing to do -- are run empty, then the exception is re-raised. So collectives always
pair up, and a refusal never leaves another rank waiting.

==============================  =============================================  ==========
operation                       the planner runs                               steps
==============================  =============================================  ==========
step(**args), try_step(**args)  ``alloc.step`` / ``alloc.try_step`` (release,  1
                                commit, trim, evict, advance, decode with
                                ``lookahead``, extend: one step)
release, evict_window,          ``alloc.step(release= / evict= / advance= /    1
advance_frontier, alloc_extend, extend= / decode=, lookahead= / commit= /
alloc_decode, commit, trim      trim=)``: one step, so a free larger than the
                                frozen shape is refused (BatchTooLargeError)
admit(handle, n_tokens)         a ``scheduler_step()`` holding the admit: one  1
                                step in pool mode too, so its step count does
                                not depend on whether a handle is given
take_handle(row, n_tokens)      ``alloc.take_handle``                          1
drop_handle(h), drop_handle_swa a ``scheduler_step()`` holding the drop        1
load_back(row, pos)             ``alloc.load_back`` (returns the SWA slots)    1
with scheduler_step() as it     ``alloc.scheduler_step()`` (followers: None)   1
cache_insert(row, token_ids)    ``alloc.prefix_cache.insert``: an LRU drop     ``cache_
                                (one holder: at most ``ceil(P /                insert_
                                max_release_rows)`` steps) and a take_handle   steps``
free_group()                    ``alloc.free_group()``: replicated mode only   (its own)
==============================  =============================================  ==========

Cost: the allocator operation's own, plus one empty step (one replay, and in broadcast
mode one broadcast) per step it did not run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..errors import ContractError, IntegrityError

__all__ = ["ReplicaOps"]


class ReplicaOps:
    """The collective operations of :class:`~graphalloc.replicas.ReplicatedAllocator` (see
    the module docstring). Every one is collective: every rank calls it, in the same
    order."""

    # ---- one step -------------------------------------------------------------------------
    def step(self, **step_args):
        """One scheduler step on every rank: :meth:`HybridAllocator.step` with these keyword
        arguments on a planner (``release, commit, trim, evict, evict_all, advance, decode,
        lookahead, extend``); ``None`` on a follower. A step refused on the planner runs an
        empty step, then raises."""
        return self._op(1, lambda: self.alloc.step(**step_args))

    def try_step(self, **step_args):
        """:meth:`step`, ``None`` (an empty step ran) for lack of pages, like
        :meth:`HybridAllocator.try_step`."""
        return self._op(1, lambda: self.alloc.try_step(**step_args))

    def release(self, rows=None) -> None:
        """Free the requests (one step; refused when it exceeds the frozen step shape)."""
        self.step(release=rows)

    def evict_window(self, rows=None) -> None:
        """The window rule for ``rows`` (every live request when ``None``); one step."""
        self.step(**({"evict_all": True} if rows is None else {"evict": rows}))

    def advance_frontier(self, rows=None, new_frontier_pos=None) -> None:
        """Explicit frontier moves (one step)."""
        self.step(advance=(rows, new_frontier_pos))

    def alloc_extend(self, rows=None, extend_lens=None):
        """Prefill chunks (one step); the slots on a planner."""
        return self.step(extend=(rows, extend_lens))

    def alloc_decode(self, rows=None, lookahead=None):
        """One token per row, or ``1 + lookahead`` speculative ones (one step)."""
        return self.step(decode=rows, **({} if lookahead is None else {"lookahead": lookahead}))

    def commit(self, rows=None, n_accepted=None) -> None:
        """Speculative decoding: resolve each row's oldest speculative step (one step)."""
        self.step(commit=(rows, n_accepted))

    def trim(self, rows=None, new_len=None) -> None:
        """Cut requests back to ``new_len`` tokens (one step)."""
        self.step(trim=(rows, new_len))

    def admit(self, handle=None, n_tokens=None) -> int | None:
        """:meth:`HybridAllocator.admit` (optionally on a handle), as one step on every rank
        (also in pool mode without a handle, where the allocator's own admit is host-only:
        followers cannot know whether the planner passed a handle). The row on a planner.
        Several admits of one iteration fit one step: :meth:`scheduler_step`."""
        def run():
            with self.alloc.scheduler_step() as it:
                row = it.admit(handle, n_tokens)
            return row
        return self._op(1, run)

    def take_handle(self, row=None, n_tokens=None) -> int | None:
        """:meth:`HybridAllocator.take_handle` (one step); the handle on a planner."""
        return self._op(1, lambda: self.alloc.take_handle(row, n_tokens))

    def drop_handle(self, handle=None) -> None:
        """:meth:`HybridAllocator.drop_handle` as one step (one holder's drop always fits)."""
        self._one_step_block(lambda it: it.drop_handle(handle))

    def drop_handle_swa(self, handle=None) -> None:
        """:meth:`HybridAllocator.drop_handle_swa` (an SWA tombstone) as one step."""
        self._one_step_block(lambda it: it.drop_handle_swa(handle))

    def load_back(self, row=None, new_frontier_pos=None):
        """:meth:`HybridAllocator.load_back` (one step): the SWA slots to fill on a planner;
        a follower's are lanes ``[0, n)`` of ``alloc.state.out_swa_buf``."""
        return self._op(1, lambda: self.alloc.load_back(row, new_frontier_pos))

    @contextlib.contextmanager
    def scheduler_step(self) -> Iterator:
        """One scheduler iteration as one step on every rank: the planner's block records
        calls on :meth:`HybridAllocator.scheduler_step`'s context (yielded); a follower's
        block gets ``None`` (the planner's block decides) and replays the step at its end.
        A block refused or raising on the planner runs an empty step, then raises."""
        if not self.is_planner:
            try:
                yield None
            finally:
                self._follow_one()
            self._raise_divergence()
            return
        target = self.n_steps + 1
        try:
            with self.alloc.scheduler_step() as it:
                yield it
        finally:
            self._pad(target)
        self._raise_divergence()

    # ---- several steps --------------------------------------------------------------------
    def cache_insert(self, row=None, token_ids=None) -> int | None:
        """:meth:`PrefixCache.insert` on the planner's cache: exactly ``cache_insert_steps``
        steps on every rank (an LRU drop when every handle is an entry's, then the handle).
        Returns the tokens cached on a planner. Refused on every rank, before any step,
        without ``prefix_cache=True``."""
        if not self.prefix_cache_option:
            raise ContractError("cache_insert: this ReplicatedAllocator was built without "
                                "prefix_cache=True")
        return self._op(self.cache_insert_steps,
                        lambda: self.alloc.prefix_cache.insert(row, token_ids))

    def free_group(self):
        """Replicated mode: :meth:`HybridAllocator.free_group` (inside it, call the
        allocator's own methods, the same on every rank). Refused in broadcast mode, on every
        rank: the block's flush is a number of steps only the planner knows; a
        :meth:`scheduler_step` block is the one-step form."""
        if self.mode == "broadcast":
            raise ContractError("free_group() is not replicated in broadcast mode (its flush "
                                "runs a number of steps only the planner knows); record the "
                                "frees in a scheduler_step() block, one step on every rank")
        return self.alloc.free_group()

    # ---- lockstep -------------------------------------------------------------------------
    def _one_step_block(self, record) -> None:
        def run():
            with self.alloc.scheduler_step() as it:
                record(it)
        self._op(1, run)

    def _op(self, n_steps: int, run):
        """``run()`` on a planner, as exactly ``n_steps`` device steps on every rank: a
        follower replays ``n_steps`` steps; a planner runs empty steps for those ``run`` did
        not (also when it raised, then re-raises). A stored divergence is raised once every
        step ran (a rank never leaves an operation early)."""
        if not self.is_planner:
            for _ in range(n_steps):
                self._follow_one()
            self._raise_divergence()
            return None
        target = self.n_steps + n_steps
        try:
            result = run()
        finally:
            self._pad(target)
        self._raise_divergence()
        return result

    def _pad(self, target: int) -> None:
        if self.n_steps > target:
            raise IntegrityError(
                f"lockstep lost: an operation ran {self.n_steps - target} device step(s) more "
                "than the other ranks replay; a planner must call the wrapper's operations "
                "(or the followers follow() once per step it runs)")
        while self.n_steps < target:
            self._empty_step()
