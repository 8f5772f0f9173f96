"""The replicas' operations: each allocator operation as a fixed number of device steps.

:class:`ReplicaOps` is a part of :class:`graphalloc.replicas.ReplicatedAllocator` (composed:
the layer's methods of the same names delegate here). On a
planner (every rank in replicated mode, ``src`` in broadcast mode) an operation is the
allocator's method of the same name; on a broadcast follower it replays the planner's
steps of that operation and returns ``None`` (arguments are ignored). Whatever happens on
the planner, the operation is the same number of device steps on every rank
(:meth:`ReplicaOps._op`): steps it did not run -- it was refused, it raised, it had
nothing to do -- are run empty, then the exception is re-raised. So collectives always
pair up, and a refusal never leaves another rank waiting.

====================================  ====================================  ===================
operation                             the planner runs                      device steps
====================================  ====================================  ===================
``step(Step | **kinds)``, ``try_step``  ``alloc.step`` / ``alloc.try_step``:  1
                                      every single operation is a Step
``admit(handle, n_tokens)``,          ``alloc.admit`` / ``alloc.take_handle``  1
``take_handle(row, n_tokens)``        (the ids are chosen on the planner)
``with scheduler_step() as it``       ``alloc.scheduler_step()`` (followers  1
                                      get None)
``cache_insert(row, token_ids)``      ``alloc.prefix_cache.insert``: an LRU  ``cache_insert_steps``
                                      drop when every handle is held, then
                                      the take
``free_group()``                      ``alloc.free_group()``                replicated mode only
====================================  ====================================  ===================

Cost: the allocator operation's own, plus one empty step (one replay, and in broadcast
mode one broadcast) per step it did not run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from ..errors import ContractError, IntegrityError
from ..plan.step import Step

__all__ = ["ReplicaOps"]


class ReplicaOps:
    """The collective operations of :class:`~graphalloc.replicas.ReplicatedAllocator` (see
    the module docstring). Every one is collective: every rank calls it, in the same
    order. A part of the layer, not a base class: ``layer`` is the
    :class:`~graphalloc.replicas.ReplicatedAllocator` whose lockstep it keeps (its
    allocator, step count, role, follow and empty steps), held weakly (the layer holds its
    operations)."""

    def __init__(self, layer):
        self.layer = weakref.proxy(layer)

    # ---- one step -------------------------------------------------------------------------
    def step(self, step: Step | None = None, **kinds):
        """One scheduler step on every rank: :meth:`HybridAllocator.step` with this
        :class:`~graphalloc.Step` (or its keywords) on a planner, ``None`` on a follower (its
        slots are the planner's lanes of ``alloc.state.out_full_buf`` / ``out_swa_buf``). A
        step refused on the planner runs an empty step, then raises. Every single operation
        is one such Step: ``rep.step(release=rows)``, ``rep.step(extend=(rows, n))``,
        ``rep.step(load_back=([row], [pos]))``, ... (a free is refused, not split, when it
        exceeds the frozen step shape: how many steps a split takes only the planner knows)."""
        return self._op(1, lambda: self.layer.alloc.step(step, **kinds))

    def try_step(self, step: Step | None = None, **kinds):
        """:meth:`step`, ``None`` (an empty step ran) for lack of room, like
        :meth:`HybridAllocator.try_step`."""
        return self._op(1, lambda: self.layer.alloc.try_step(step, **kinds))

    def admit(self, handle=None, n_tokens=None) -> int | None:
        """One step admitting the lowest free row (optionally on a handle's first
        ``n_tokens``): the row on a planner. Several admits of one iteration fit one step:
        :meth:`scheduler_step`."""
        return self._op(1, lambda: self.layer.alloc.admit(handle, n_tokens))

    def take_handle(self, row=None, n_tokens=None) -> int | None:
        """One step taking the lowest free handle on ``row``'s first ``n_tokens``: the handle
        on a planner."""
        return self._op(1, lambda: self.layer.alloc.take_handle(row, n_tokens))

    @contextlib.contextmanager
    def scheduler_step(self) -> Iterator:
        """One scheduler iteration as one step on every rank: the planner's block records
        calls on :meth:`HybridAllocator.scheduler_step`'s context (yielded); a follower's
        block gets ``None`` (the planner's block decides) and replays the step at its end.
        A block refused or raising on the planner runs an empty step, then raises."""
        if not self.layer.is_planner:
            try:
                yield None
            finally:
                self.layer.follow_one()
            self.layer.raise_divergence()
            return
        target = self.layer.n_steps + 1
        try:
            with self.layer.alloc.scheduler_step() as it:
                yield it
        finally:
            self._pad(target)
        self.layer.raise_divergence()

    # ---- several steps --------------------------------------------------------------------
    def cache_insert(self, row=None, token_ids=None, *, keys=None, salt=None,
                     extra_keys=None) -> int | None:
        """:meth:`PrefixCache.insert` on the planner's cache (``keys`` / ``salt`` /
        ``extra_keys`` as there: the request's namespace enters its page keys, the same
        keys on every rank): exactly ``cache_insert_steps`` steps on every rank (an LRU
        drop when every handle is an entry's, then the handle). Returns the tokens cached
        on a planner. Refused on every rank, before any step, without ``prefix_cache``."""
        if not self.layer.prefix_cache_option:
            raise ContractError("cache_insert: this ReplicatedAllocator was built without "
                                "prefix_cache=True")
        return self._op(self.layer.cache_insert_steps,
                        lambda: self.layer.alloc.prefix_cache.insert(
                            row, token_ids, keys=keys, salt=salt, extra_keys=extra_keys))

    def free_group(self):
        """Replicated mode: :meth:`HybridAllocator.free_group` (inside it, call the
        allocator's own methods, the same on every rank). Refused in broadcast mode, on every
        rank: the block's flush is a number of steps only the planner knows; a
        :meth:`scheduler_step` block is the one-step form."""
        if self.layer.mode == "broadcast":
            raise ContractError("free_group() is not replicated in broadcast mode (its flush "
                                "runs a number of steps only the planner knows); record the "
                                "frees in a scheduler_step() block, one step on every rank")
        return self.layer.alloc.free_group()

    # ---- lockstep -------------------------------------------------------------------------
    def _op(self, n_steps: int, run):
        """``run()`` on a planner, as exactly ``n_steps`` device steps on every rank: a
        follower replays ``n_steps`` steps; a planner runs empty steps for those ``run`` did
        not (also when it raised, then re-raises). A stored divergence is raised once every
        step ran (a rank never leaves an operation early)."""
        if not self.layer.is_planner:
            for _ in range(n_steps):
                self.layer.follow_one()
            self.layer.raise_divergence()
            return None
        target = self.layer.n_steps + n_steps
        try:
            result = run()
        finally:
            self._pad(target)
        self.layer.raise_divergence()
        return result

    def _pad(self, target: int) -> None:
        if self.layer.n_steps > target:
            raise IntegrityError(
                f"lockstep lost: an operation ran {self.layer.n_steps - target} device step(s) "
                "more than the other ranks replay; a planner must call the wrapper's operations "
                "(or the followers follow() once per step it runs)")
        while self.layer.n_steps < target:
            self.layer.empty_step()
