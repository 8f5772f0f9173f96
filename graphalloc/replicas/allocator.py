"""Tensor-parallel replicas: the same allocator state on every rank, over ``torch.distributed``.

In a tensor-parallel engine every GPU rank holds its own KV cache and so its own
:class:`~graphalloc.HybridAllocator`; all ranks must make exactly the same decisions every
step or their caches diverge silently. :class:`ReplicatedAllocator` wraps one rank's
allocator and keeps the ranks equal (gloo for CPU allocators, NCCL for CUDA ones):

``mode="replicated"`` (SGLang style): every rank plans every step itself; planning is a
    pure function of its inputs and the ledger (proved byte for byte across
    ``PYTHONHASHSEED`` values). No collective per step.
``mode="broadcast"`` (vLLM style): rank ``src`` plans; each device step's payload (the
    descriptor rows and the planner's ledger, one fixed-shape int64 tensor: layout in
    :mod:`graphalloc.replicas.wire`) is broadcast and replayed by the followers, whose
    host ledger is rebuilt from their own device tables at each check.

Lockstep rule: every wrapper operation is a fixed number of device steps on every rank,
whatever its arguments and whether it succeeds (a refusal runs empty steps, then
re-raises), so collectives always pair up. Every ``check_every`` steps the ranks'
digests (host parts and one per device table) are all-gathered and compared; every rank
raises the same :class:`~graphalloc.errors.ReplicaDivergenceError` naming the first
differing step, rank and fields.

Cost per step: replicated: one device digest and the host digests; broadcast: two async
host-to-device copies and the ledger packing on the planner, one broadcast of the payload,
the device digest. Construction is collective and synchronises (it captures graphs). The
design, the wire format's rationale, the measured costs and the limits (an engine's own
graph replays bypass the layer; the cache's own ``evict()`` / ``drop_all()`` are
replicated-mode only) are in ``docs/replicas.md``.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from ..allocator import HybridAllocator
from ..config import AllocatorConfig
from ..device.executor import make_executor
from ..diagnostics.sync_points import sync_allowed
from ..errors import ConfigError, ContractError, IntegrityError, ReplicaDivergenceError
from ..operations import key_hash_of
from .checks import COL_STEP, DigestHistory, check_same_setup, first_divergence
from .digest import META_STEP, META_STEPS_RUN, host_digests
from .executor import ReplicaExecutor, capture_warm
from .ops import ReplicaOps
from .wire import (
    Payload,
    has_ledger,
    pack_ledger,
    planned_digests,
    rebuild_page_refs,
    steps_run_of,
    unpack_ledger,
)

__all__ = ["ReplicatedAllocator", "ReplicaExecutor"]  # (the executor: .executor)

_UNREADABLE = -0x2152_4110_2152_4111  # a follower's digest when its payload was torn
_REBUILT = ("ledger", "spec", "handles", "refs", "pages")  # a follower's own host parts


# ---- the wrapper -------------------------------------------------------------------------
class ReplicatedAllocator:
    """One rank's :class:`~graphalloc.HybridAllocator`, kept identical to the other ranks'.

    Example (every rank, one process per GPU)::

        dist.init_process_group("nccl", ...); torch.cuda.set_device(local_rank)
        cfg = AllocatorConfig(..., device="cuda", backend="triton", max_handles=64)
        rep = ReplicatedAllocator(cfg, mode="broadcast", check_every=64)  # collective
        for batch in scheduler_steps:                  # every rank, the same calls
            with rep.scheduler_step() as it:           # one device step on every rank
                if it is not None:                     # the planner records the step
                    it.release(batch.finished); it.accept(batch.spec_rows, batch.accepted)
                    it.decode(batch.decoding, lookahead=3)
            h = rep.take_handle(row, 64)               # planner: the handle; followers: None

    Args:
        config: this rank's allocator configuration; every rank's must have the same
            geometry (checked at construction). The wrapper builds the allocator
            (``rep.alloc``) with its own executor.
        group: the tensor-parallel process group (``None``: the default group).
        mode: ``"replicated"`` or ``"broadcast"`` (see the module docstring).
        src: global rank of the planner in broadcast mode (default: the group's first rank).
        check_every: steps between consistency checks (a multiple of ``digest_every``);
            0 disables digests and periodic checks.
        digest_every: steps between recorded digests; with 1 a divergence is named to the
            exact step, with k to within k steps (``last_equal_step`` bounds it).
        use_graph: replay the steps (replicated: the allocator's graph executor; broadcast:
            the payload kernels) and the digest from CUDA graphs (default: on CUDA devices).
        fused_step, n_descriptor_bufs: as for :class:`~graphalloc.HybridAllocator`.
        prefix_cache: give the planners (every rank in replicated mode, ``src`` in broadcast
            mode) a :class:`~graphalloc.sharing.prefix_cache.PrefixCache` (pool mode,
            max_handles > 0): ``True`` / ``"siphash"`` or ``"blake2b"``, the page keys'
            hash, as for :class:`~graphalloc.HybridAllocator` (the same on every rank).

    Construction is collective (it compares configurations and the initial state of all
    ranks) and synchronises. Every operation that may run a device step is collective too.
    """

    def __init__(self, config: AllocatorConfig, group=None, *, mode: str = "replicated",
                 src: int | None = None, check_every: int = 64, digest_every: int = 1,
                 use_graph: bool | None = None, fused_step: bool = True,
                 n_descriptor_bufs: int = 2, prefix_cache: bool | str = False):
        if not isinstance(config, AllocatorConfig):
            raise ConfigError(f"ReplicatedAllocator takes this rank's AllocatorConfig (it builds "
                              f"the allocator itself), got {type(config).__name__}")
        cfg = config
        if mode not in ("replicated", "broadcast"):
            raise ConfigError(f"mode must be 'replicated' or 'broadcast', got {mode!r}")
        if cfg.num_state_slots:
            raise ConfigError("recurrent-state slots are not replicated yet: build each rank's "
                              "HybridAllocator with num_state_slots, or replicas without them")
        if cfg.pools.extras:
            raise ConfigError("a model with several window pools is not replicated yet (their "
                              "slices travel in no payload or digest): build each rank's "
                              "HybridAllocator, or replicas of a model with one window pool")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call "
                              "init_process_group() on every rank first")
        for name, value in (("check_every", check_every), ("digest_every", digest_every)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if digest_every < 1 or check_every < 0 or (check_every and check_every % digest_every):
            raise ConfigError(f"check_every ({check_every}) must be 0 or a positive multiple of "
                              f"digest_every ({digest_every}, >= 1)")
        key_hash_of(prefix_cache)  # a bool or a page-key hash, before any collective
        if prefix_cache and (not cfg.pools.window.shares or not cfg.max_handles):  # (no collective)
            raise ConfigError("prefix_cache=True needs pool mode and max_handles > 0 (each "
                              "cache entry is a handle)")
        self.group = group if group is not None else dist.group.WORLD
        backend = str(dist.get_backend(self.group)).lower()
        wanted = "nccl" if cfg.device.type == "cuda" else "gloo"
        if wanted not in backend:
            raise ConfigError(f"an allocator on {cfg.device} needs a process group with the "
                              f"{wanted} backend, this one is {backend!r}")
        self.mode = mode
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank()
        self.global_ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self.src = self.global_ranks[0] if src is None else src
        if self.src not in self.global_ranks:
            raise ConfigError(f"src={self.src} is not a rank of the group {self.global_ranks}")
        self.is_planner = mode == "replicated" or self.rank == self.src
        self.check_every, self.digest_every = check_every, digest_every
        self.use_graph = cfg.device.type == "cuda" if use_graph is None else bool(use_graph)
        if self.use_graph and cfg.device.type != "cuda":
            raise ConfigError("use_graph=True needs a CUDA allocator")
        self.device = cfg.device
        self.prefix_cache_option = prefix_cache

        self.n_steps = 0  # device steps run through this wrapper (equal on every rank)
        self.n_checks = 0
        self.n_replays = 0
        self.n_empty_steps = 0  # steps run to keep lockstep (refusals, padding)
        self.n_ledger_installs = 0  # follower: rebuilt ledgers installed (checks, syncs)
        self.last_rebuild_error: str | None = None  # follower: why a check could not rebuild
        self.last_equal_step = -1
        self.first_divergence: ReplicaDivergenceError | None = None
        self._error: ReplicaDivergenceError | None = None
        self._step_graph = self._digest_graph = None

        if mode == "replicated":
            role, inner = "replicated", make_executor("graph" if self.use_graph else "eager")
        else:
            role, inner = ("planner" if self.is_planner else "follower"), None
        self.ops = ReplicaOps(self)  # the collective operations, composed (step, admit, ...)
        self.executor = ReplicaExecutor(self, role, inner)
        self.alloc = HybridAllocator(cfg, executor=self.executor, fused_step=fused_step,
                                     n_descriptor_bufs=n_descriptor_bufs,
                                     prefix_cache=prefix_cache if self.is_planner else False)
        self.cache_insert_steps = 1 + -(-cfg.request_pages // cfg.max_release_rows)
        with sync_allowed():  # construction may copy weights to the device and capture graphs
            self._check_same_config()
            self._allocate_buffers()
            if self.use_graph:
                self._capture_graphs()
            self._record_digest(host=mode == "replicated")
            self._compare()
        self.raise_divergence()

    # ---- collective operations: each one line over ReplicaOps ---------------------------
    def step(self, step=None, **kinds):
        """One device step on every rank (:meth:`ReplicaOps.step <.ops.ReplicaOps.step>`)."""
        return self.ops.step(step, **kinds)

    def try_step(self, step=None, **kinds):
        """:meth:`step`, ``None`` for lack of room (:meth:`.ops.ReplicaOps.try_step`)."""
        return self.ops.try_step(step, **kinds)

    def admit(self, handle=None, n_tokens=None):
        """One step admitting the lowest free row (:meth:`.ops.ReplicaOps.admit`)."""
        return self.ops.admit(handle, n_tokens)

    def take_handle(self, row=None, n_tokens=None):
        """One step taking the lowest free handle (:meth:`.ops.ReplicaOps.take_handle`)."""
        return self.ops.take_handle(row, n_tokens)

    def scheduler_step(self):
        """One iteration as one step (:meth:`.ops.ReplicaOps.scheduler_step`)."""
        return self.ops.scheduler_step()

    def cache_insert(self, row=None, token_ids=None, *, keys=None, salt=None, extra_keys=None):
        """The planner's cache insert (:meth:`.ops.ReplicaOps.cache_insert`)."""
        return self.ops.cache_insert(row, token_ids, keys=keys, salt=salt,
                                     extra_keys=extra_keys)

    def free_group(self):
        """Replicated mode's free group (:meth:`.ops.ReplicaOps.free_group`)."""
        return self.ops.free_group()

    def follow(self) -> None:
        """Follower: receive and replay one planner device step (the low-level form of the
        operations, for a planner that runs allocator methods directly). Never synchronises
        the host beyond the broadcast call itself (except at a periodic check)."""
        if self.is_planner:
            raise ContractError(f"rank {self.rank} plans; follow() is for broadcast followers")
        self.follow_one()
        self.raise_divergence()

    def check(self) -> None:
        """Compare all ranks' digests now (collective; synchronises). Records the current
        state first if the latest step has no digest. Raises
        :class:`~graphalloc.errors.ReplicaDivergenceError` naming the first differing step."""
        with sync_allowed():
            if not self.history.covers(self.n_steps):
                self._record_digest(host=self.mode == "replicated")
            self._compare()
        self.raise_divergence()

    # ---- local operations --------------------------------------------------------------
    def sync_ledger(self) -> None:
        """Follower: replace ``alloc.ledger`` by the planner's ledger of the latest step, its
        page mirror rebuilt from this rank's device tables (reads the device; not
        collective). Raises :class:`~graphalloc.errors.IntegrityError` -- keeping the
        previous ledger -- when the rebuilt ledger's digests differ from the planner's. A
        no-op on planners and before the first planned step."""
        if self.is_planner:
            return
        rebuilt = self._rebuild_ledger()
        if rebuilt is None:
            return
        ledger, own, planned, steps_run = rebuilt
        bad = [k for k in own if planned[k] and own[k] != planned[k]]
        if bad:
            raise IntegrityError(
                f"rank {self.rank}: the ledger rebuilt from this follower's device tables "
                f"differs from the planner's in {bad} (step {self.n_steps}); the follower kept "
                "its previous ledger. The device tables diverged (see check())")
        self._install(ledger, steps_run)

    def current_digest(self) -> dict[str, int]:
        """This rank's digest of its current state, by column (reads the device; not
        collective). A follower syncs its ledger first."""
        self.sync_ledger()
        with sync_allowed():
            return self.history.current(self.n_steps, self._own_host_digests())

    def close(self) -> None:
        """Drop the wrapper's captured graphs (not collective). The allocator keeps its
        executor: a closed wrapper's allocator is not used again."""
        self._step_graph = self._digest_graph = None

    # ---- the executor's work (ReplicaExecutor.execute) ---------------------------------
    def broadcast_planned(self, planned) -> None:
        """Planner, broadcast mode: pack the ledger beside descriptor buffer ``i`` (free: the
        ring waited for buffer i's event), stage both into the payload, broadcast, replay.
        The full host digests are packed on digest steps, the O(rows) ones every step."""
        alloc, index = self.alloc, planned.buffer_index
        header = self.payload.staging_np[index]
        step = self.n_steps + 1
        full = bool(self.check_every) and step % self.digest_every == 0
        pack_ledger(alloc.ledger, header, alloc.prefix_cache, full)
        header[0, META_STEP] = step
        header[1, META_STEPS_RUN] = alloc.steps_run + 1  # mark_submitted counts it next
        self.payload.desc.copy_(alloc.ring.bufs[index], non_blocking=True)
        self.payload.header.copy_(self.payload.staging[index], non_blocking=True)
        self._broadcast_and_launch()

    def _broadcast_and_launch(self) -> None:
        dist.broadcast(self.payload.buf, src=self.src, group=self.group)
        if self._step_graph is not None:
            self._step_graph.replay()
            self.n_replays += 1
        else:
            self.alloc.kernels(self.payload.release, self.payload.alloc)

    def follow_one(self) -> None:
        """Follower: one step, without raising a stored divergence (the caller raises it
        once every step of its operation ran, so no rank leaves an operation early)."""
        self._broadcast_and_launch()
        self.after_step()

    def empty_step(self) -> None:
        """Keep lockstep: one device step that changes nothing. A planned empty step (the
        payload then carries the current ledger); when the allocator cannot plan (a step
        left pending by a failure), a raw one: an all-padding descriptor."""
        self.n_empty_steps += 1
        try:
            self.alloc.step()
            return
        except ContractError:
            pass
        if self.mode == "broadcast":
            self.payload.desc.zero_()
            self.payload.meta[META_STEP].fill_(self.n_steps + 1)  # a device fill: no sync
            self._broadcast_and_launch()
        self.after_step()

    # ---- digests and checks ------------------------------------------------------------
    def after_step(self) -> None:
        self.n_steps += 1
        if not self.check_every:
            return
        if self.n_steps % self.digest_every == 0:
            self._record_digest(host=self.mode == "replicated")
        if self.n_steps % self.check_every == 0:
            with sync_allowed():
                self._compare()

    def _own_host_digests(self) -> dict[str, int]:
        """Host digests of this rank's ledger (and cache). A broadcast follower's: of its
        ledger rebuilt now, with the planner's cache part (it holds no cache)."""
        if self.is_planner:
            return host_digests(self.alloc.ledger, self.alloc.prefix_cache)
        rebuilt = self._rebuild_ledger()
        if rebuilt is None:
            return host_digests(self.alloc.ledger)
        return {**rebuilt[2], **rebuilt[1]}

    def _record_digest(self, host: bool) -> None:
        digests = host_digests(self.alloc.ledger, self.alloc.prefix_cache) if host else None
        self.history.record(self.n_steps, digests, self._digest_graph)
        if self._digest_graph is not None:
            self.n_replays += 1

    def _compare(self) -> None:
        """All-gather the history rows and compare them (collective; call under
        sync_allowed). Stores the error. A broadcast follower first puts the digests of its
        rebuilt ledger into its latest row, and installs that ledger after the check when
        they equal the planner's."""
        rebuilt = None
        if self.mode == "broadcast" and not self.is_planner and self.n_steps:
            try:
                rebuilt = self._rebuild_ledger()
            except Exception as exc:  # a torn payload: named by the check, never raised
                self.last_rebuild_error = repr(exc)  # here (the others are in the gather)
                self.history.set_host({k: _UNREADABLE for k in _REBUILT})
            if rebuilt is not None:  # the parts the planner computed for this step
                self.history.set_host({k: v for k, v in rebuilt[1].items() if rebuilt[2][k]})
        table = self.history.gather(self.group, self.world_size)
        self.n_checks += 1
        error = self._first_divergence(table)
        if error is None:
            if table.shape[1]:
                self.last_equal_step = int(table[0, -1, COL_STEP])
        else:
            self._error = error
            self.first_divergence = self.first_divergence or error
        if rebuilt is not None:
            ledger, own, planned, steps_run = rebuilt
            if all(own[k] == planned[k] for k in own if planned[k]):
                self._install(ledger, steps_run)

    def _install(self, ledger, steps_run: int) -> None:
        """Follower: take the rebuilt ledger's state (in place) and the planner's step
        count."""
        self.alloc.ledger.assign(ledger.arrays())
        self.alloc.pipeline.steps_run = steps_run
        self.n_ledger_installs += 1

    def _rebuild_ledger(self):
        """Follower: ``(ledger, own digests, planner's digests, steps_run)`` of the latest
        payload, the page mirror rebuilt from this rank's device tables (reads the device;
        O(rows x pages) numpy); ``None`` before the first planned step. Raises
        :class:`IntegrityError` on a torn payload."""
        cfg, state = self.alloc.config, self.alloc.state
        with sync_allowed():
            header = self.payload.header.cpu().numpy()  # sync ok: check point / explicit
            if not has_ledger(header):
                return None
            ledger = unpack_ledger(cfg, header)
            if ledger.refs is not None:  # a page mirror to check the tables against
                ps, n_rows = cfg.page_size, cfg.max_reqs + ledger.n_handles
                # off the fast path: a check point (or sync_ledger()) reads the tables
                tables = (state.req_to_token_buf[:n_rows, ::ps], state.full_to_swa_buf[::ps],
                          state.full_free, state.swa_free)
                host = [t.cpu().numpy() for t in tables]  # off the fast path (a check point)
                rebuild_page_refs(cfg, ledger, *host)
        own = host_digests(ledger)
        return ledger, {k: own[k] for k in _REBUILT}, planned_digests(header), steps_run_of(
            header)

    def _first_divergence(self, table: np.ndarray) -> ReplicaDivergenceError | None:
        """:func:`~graphalloc.replicas.checks.first_divergence` with this wrapper's ranks."""
        return first_divergence(table, self.columns, self.global_ranks, self.src,
                                self.last_equal_step)

    def raise_divergence(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # ---- construction helpers ----------------------------------------------------------
    def _check_same_config(self) -> None:
        check_same_setup(self.alloc.config, (self.mode, self.src, self.check_every,
                                             self.digest_every, len(self.alloc.ring),
                                             self.prefix_cache_option),
                         self.group, self.global_ranks, self.device)

    def _allocate_buffers(self) -> None:
        """Allocated once, updated in place only (graphs hold their addresses): the
        broadcast payload (:class:`~graphalloc.replicas.wire.Payload`, broadcast mode) and
        the digest history (``DigestHistory``, ``check_every // digest_every + 1`` device
        rows: the extra one for ``check()``)."""
        alloc, check_every, digest_every = self.alloc, self.check_every, self.digest_every
        self.payload = None
        if self.mode == "broadcast":
            self.payload = Payload(alloc.ring.layout, alloc.ledger, self.device,
                                   len(alloc.ring) if self.is_planner else 0)
        n_hist = (check_every // digest_every if check_every else 0) + 1
        self.history = DigestHistory(alloc.state.tables(), self.device, n_hist,
                                     None if self.payload is None else self.payload.meta)
        self.columns = self.history.columns

    def _capture_graphs(self) -> None:
        """The payload kernels (broadcast mode) and the digest, warmed up and captured
        (:func:`~graphalloc.replicas.executor.capture_warm`). Runs once, under
        sync_allowed."""
        fns = [self.history.compute]
        if self.mode == "broadcast":
            fns.insert(0, lambda: self.alloc.kernels(self.payload.release, self.payload.alloc))
        graphs = capture_warm(fns)
        self._digest_graph = graphs[-1]
        self._step_graph = graphs[0] if self.mode == "broadcast" else None
