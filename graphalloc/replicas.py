"""Tensor-parallel replicas: the same allocator state on every rank, over ``torch.distributed``.

In a tensor-parallel engine every GPU rank holds its own KV cache and so its own
:class:`~graphalloc.HybridAllocator`; all ranks must make exactly the same decisions
every step or their caches diverge silently. :class:`ReplicatedAllocator` wraps one
rank's allocator and keeps the ranks equal in one of two modes (gloo for CPU
allocators, NCCL for CUDA ones, one process per GPU; no other transport):

``mode="replicated"`` (SGLang style)
    Every rank runs the same deterministic scheduler and plans every step itself.
    Host planning is a pure function of its inputs and the ledger: numpy only,
    nothing iterates a dict or set, hashes a string or reads a clock to decide
    anything (``tests/test_replicas.py`` proves it byte for byte across
    ``PYTHONHASHSEED`` values). No collective per step.

``mode="broadcast"`` (vLLM style)
    One planner rank (``src``) plans; each device step's *payload* is broadcast
    and the followers only replay it. The payload is one fixed-shape int64 tensor
    on the allocator's device::

        rows [0, max_release_rows)                  release rows   (the step descriptor,
        rows [max_release_rows, + max_alloc_rows)   allocation rows  see graphalloc.kernels.abi)
        row  n_desc                                 meta: step, ledger digest, ring heads/counts
        rows (n_desc, n_desc + n_ledger_rows)       the planner's ledger: live, seq_len,
                                                    frontier, protected (max_reqs each)

    On every rank, the planner included, the step kernels read the descriptor from
    this device tensor (the kernels take any tensor), so a follower never copies it
    to the host: its per-step work is the collective plus one graph replay, and its
    host never waits on anything but the collective call itself.

Per device step, for the planner and a follower (broadcast mode)::

    planner                                       follower
    plan() -> descriptor buffer i (pinned)
    ledger -> header buffer i (pinned)
    payload[:n_desc] <- buffer i  (async H2D)
    payload[n_desc:] <- header i  (async H2D)
    broadcast(payload) -------------------------> broadcast(payload)   the only collective
    replay: kernels read payload                  replay: kernels read payload
    digest -> history row                         digest -> history row

The planner's header buffer ``i`` is guarded by descriptor buffer ``i``'s ring event
(``DescriptorRing``): the ring never hands buffer ``i`` out again before the copies
reading it have run, so the planner does not wait either.

**Followers' host ledger.** A follower never plans, so its ``alloc.ledger`` is a
copy: :meth:`ReplicatedAllocator.sync_ledger` unpacks the ledger of the latest
payload (a device read) and verifies its digest. It runs at every consistency check,
so a follower's ledger is the planner's as of the last checked step; call it before
promoting a follower to planner or reading its ``stats()``.

**Consistency check.** Every ``digest_every`` steps each rank records a digest row of
its ledger and device tables; every ``check_every`` steps the rows are all-gathered and
compared, and every rank raises the same
:class:`~graphalloc.errors.ReplicaDivergenceError` naming the first differing step, rank
and fields. The digest row, its history and the verdict: :mod:`graphalloc.replica_checks`.

**Lockstep rule.** Collectives must pair up, so every rank issues the same sequence
of device steps: each :meth:`~ReplicatedAllocator.step` is exactly one device step,
and so is :meth:`~ReplicatedAllocator.admit` in SWA ring mode (pool-mode admits are
host-only). A call refused with a :class:`~graphalloc.errors.ContractError` still
runs an empty step, then re-raises, so a refusal on one rank never leaves the
others waiting in a collective; the divergence, if any, is reported by the check.
Followers call the same wrapper methods as the planner, without arguments (given
ones are ignored: the planner's decisions are the only ones). A planner that calls
the wrapped allocator directly (``release``, ``evict_window``, ``free_group``...)
issues one collective per device step it runs; its followers call :meth:`follow`
once for each.

Costs (per step): replicated: one digest (one read of every table, plus a write of
an int64 scratch of the largest table) and a BLAKE2b of ``4 * max_reqs`` int64;
broadcast: two async H2D copies on the planner and one broadcast of
``(n_desc + 1 + ceil(max_reqs / 2)) * 64`` bytes, plus the digest. ``check_every=0``
turns digests off (``check()`` then compares the current state only). Construction
synchronises (it captures graphs and runs an initial check, inside ``sync_allowed``).

**How the layer stacks.** The wrapper builds its rank's allocator itself, with an
executor of its own (:class:`ReplicaExecutor`): replicated mode wraps the eager or graph
executor and records a digest after every step; a broadcast planner's executor
broadcasts the step's payload and replays it; a broadcast follower's executor plans
nothing (``plans_locally = False``), so a follower's direct ``alloc.step()`` is refused
before anything changes. Nothing is patched into an allocator after it was built.

Limits: broadcast mode refuses shared pages (``max_handles > 0``, ``admit(handle=)``): the
payload carries the ledger but not the page mirror or the handles yet, so a follower could
not audit or plan them (use replicated mode for prefix sharing). The broadcast
is eager (not captured): the planner's H2D copies would otherwise become copy nodes.
The digest and the ledger wire format live in :mod:`graphalloc.state_digest`.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist

from .allocator import AllocResult, HybridAllocator
from .config import AllocatorConfig
from .errors import ConfigError, ContractError, ReplicaDivergenceError
from .executor import Executor, make_executor
from .graph import capture_graph
from .kernels.abi import ROW_WIDTH
from .replica_checks import COL_STEP, DigestHistory, check_same_setup, first_divergence
from .state_digest import (
    META_MAGIC,
    META_STEP,
    META_STEPS_RUN,
    ledger_digest,
    n_ledger_rows,
    pack_ledger,
    unpack_ledger,
)
from .sync_points import sync_allowed

__all__ = ["ReplicatedAllocator", "ReplicaExecutor"]


# ---- the executor ------------------------------------------------------------------------
class ReplicaExecutor(Executor):
    """The executor of a replicated rank's allocator (built by :class:`ReplicatedAllocator`).

    ``role``: ``"replicated"`` (run the step through ``inner``, the eager or graph
    executor, then record the step's digest), ``"planner"`` (broadcast the step's payload
    and replay it from the payload) or ``"follower"`` (plans nothing: ``plan()`` is refused
    before anything changes; steps arrive through :meth:`ReplicatedAllocator.follow`).
    """

    name = "replica"

    def __init__(self, layer: ReplicatedAllocator, role: str, inner: Executor | None = None):
        super().__init__()
        # The layer holds its allocator, which holds this executor: the layer is held
        # weakly, so nothing cyclic keeps the wrapper (and its process group) alive.
        self.layer, self.role, self.inner = weakref.proxy(layer), role, inner
        self.plans_locally = role != "follower"

    def bind(self, alloc) -> None:
        super().bind(alloc)
        if self.inner is not None:
            self.inner.bind(alloc)

    def execute(self, planned) -> None:
        if self.role == "replicated":
            self.inner.execute(planned)
            self.count(planned.fusable and self.alloc.kernels.fused)
        elif self.role == "planner":
            self.layer._broadcast_planned(planned)  # the payload runs as two launches
            self.count(False)
        else:  # unreachable: the allocator refuses plan() first
            raise ContractError("a broadcast follower never plans its own steps")
        self.layer._after_step()


# ---- the wrapper -------------------------------------------------------------------------
class ReplicatedAllocator:
    """One rank's :class:`~graphalloc.HybridAllocator`, kept identical to the other ranks'.

    Example (every rank, one process per GPU)::

        dist.init_process_group("nccl", ...); torch.cuda.set_device(local_rank)
        cfg = AllocatorConfig(..., device="cuda", backend="triton")
        rep = ReplicatedAllocator(cfg, mode="broadcast", check_every=64)  # collective
        alloc = rep.alloc                              # this rank's allocator
        for batch in scheduler_steps:                  # every rank, same sequence
            for _ in batch.new_requests:
                row = rep.admit()                      # planner: the row; followers: None
            out = rep.step(release=..., evict=True, decode=..., extend=...)  # followers: step()

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

    Construction is collective (it compares configurations and the initial state of all
    ranks) and synchronises. Every method that may run a device step is collective too.
    """

    def __init__(self, config: AllocatorConfig, group=None, *, mode: str = "replicated",
                 src: int | None = None, check_every: int = 64, digest_every: int = 1,
                 use_graph: bool | None = None, fused_step: bool = True,
                 n_descriptor_bufs: int = 2):
        if not isinstance(config, AllocatorConfig):
            raise ConfigError(f"ReplicatedAllocator takes this rank's AllocatorConfig (it builds "
                              f"the allocator itself), got {type(config).__name__}")
        cfg = config
        if mode not in ("replicated", "broadcast"):
            raise ConfigError(f"mode must be 'replicated' or 'broadcast', got {mode!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call "
                              "init_process_group() on every rank first")
        for name, value in (("check_every", check_every), ("digest_every", digest_every)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if digest_every < 1 or check_every < 0 or (check_every and check_every % digest_every):
            raise ConfigError(f"check_every ({check_every}) must be 0 or a positive multiple of "
                              f"digest_every ({digest_every}, >= 1)")
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
        if mode == "broadcast" and cfg.max_handles:
            raise ConfigError("broadcast mode does not replicate shared pages yet (the payload "
                              "carries no page mirror or handles): build with max_handles=0, "
                              "or use mode='replicated'")
        self.device = cfg.device

        self.n_steps = 0  # device steps run through this wrapper (equal on every rank)
        self.n_checks = 0
        self.n_replays = 0
        self.last_equal_step = -1
        self.first_divergence: ReplicaDivergenceError | None = None
        self._error: ReplicaDivergenceError | None = None
        self._step_graph = self._digest_graph = None

        if mode == "replicated":
            role, inner = "replicated", make_executor("graph" if self.use_graph else "eager")
        else:
            role, inner = ("planner" if self.is_planner else "follower"), None
        self.executor = ReplicaExecutor(self, role, inner)
        self.alloc = HybridAllocator(cfg, executor=self.executor, fused_step=fused_step,
                                     n_descriptor_bufs=n_descriptor_bufs)
        with sync_allowed():  # construction may copy weights to the device and capture graphs
            self._check_same_config()
            self._allocate_buffers()
            if self.use_graph:
                self._capture_graphs()
            self._record_digest(host_ledger=True)
            self._compare()
        self._raise_divergence()

    # ---- collective operations ---------------------------------------------------------
    def step(self, **step_args) -> AllocResult | None:
        """One scheduler step on every rank: :meth:`HybridAllocator.step` with the same
        keyword arguments on a planner; a follower replays the planner's step (its
        arguments are ignored) and returns ``None`` (its slots are in
        ``alloc.state.out_full_buf`` / ``out_swa_buf``, in the planner's lane order).
        A step refused on this rank runs an empty step, then raises."""
        if not self.is_planner:
            self.follow()
            return None
        try:
            result = self.alloc.step(**step_args)
        except ContractError:
            self._empty_step()
            raise
        self._raise_divergence()
        return result

    def admit(self, handle=None) -> int | None:
        """:meth:`HybridAllocator.admit` on every rank. Host-only in pool mode without a
        handle; one device step in ring mode or on a handle (then collective). Followers
        return ``None``. Broadcast mode refuses handles (the payload does not carry the
        page mirror and the handles yet: use mode='replicated' for prefix sharing)."""
        # A refused call keeps lockstep with an empty step where every rank expected one:
        # ring-mode admits, and (replicated mode, every rank passing it) admits on a handle.
        device_step = self.alloc.config.ring_mode or (
            handle is not None and self.mode == "replicated")
        if not self.is_planner:
            if self.alloc.config.ring_mode:
                self.follow()
            return None
        try:
            if self.mode == "broadcast" and handle is not None:
                raise ContractError(
                    "broadcast mode does not replicate shared pages yet: the followers' ledger "
                    "(from the payload) carries no page mirror and no handles. Use "
                    "mode='replicated' for prefix sharing")
            row = self.alloc.admit(handle)
        except ContractError:
            if device_step:
                self._empty_step()
            raise
        self._raise_divergence()
        return row

    def follow(self) -> None:
        """Follower: receive and replay one planner device step. Never synchronises the
        host beyond the broadcast call itself (except at a periodic check)."""
        if self.is_planner:
            raise ContractError(f"rank {self.rank} plans; follow() is for broadcast followers")
        self._broadcast_and_launch()
        self._after_step()
        self._raise_divergence()

    def check(self) -> None:
        """Compare all ranks' digests now (collective; synchronises). Records the current
        state first if the latest step has no digest. Raises
        :class:`~graphalloc.errors.ReplicaDivergenceError` naming the first differing step."""
        with sync_allowed():
            if not self.history.covers(self.n_steps):
                self._record_digest(host_ledger=self.mode == "replicated")
            self._compare()
        self._raise_divergence()

    # ---- local operations --------------------------------------------------------------
    def sync_ledger(self) -> None:
        """Follower: replace ``alloc.ledger`` by the ledger of the latest payload (reads the
        device; verifies its digest). A no-op on planners and before the first step."""
        if self.is_planner or self.n_steps == 0:
            return
        with sync_allowed():
            header = self._payload_header.cpu().numpy()  # sync ok: check point / explicit
        if header[0, META_MAGIC] == 0:  # nothing but empty steps were received
            return
        self.alloc.install_ledger(unpack_ledger(self.alloc.config, header),
                                  steps_run=int(header[0, META_STEPS_RUN]))

    def current_digest(self) -> dict[str, int]:
        """This rank's digest of its current state (reads the device; not collective). A
        follower syncs its ledger first."""
        self.sync_ledger()
        with sync_allowed():
            return self.history.current(self.n_steps, ledger_digest(self.alloc.ledger))

    def close(self) -> None:
        """Drop the wrapper's captured graphs (not collective). The allocator keeps its
        executor: a closed wrapper's allocator is not used again."""
        self._step_graph = self._digest_graph = None

    # ---- the executor's work (ReplicaExecutor.execute) ---------------------------------
    def _broadcast_planned(self, planned) -> None:
        """Planner, broadcast mode: pack the ledger beside descriptor buffer ``i`` (free: the
        ring waited for buffer i's event), stage both into the payload, broadcast, replay."""
        alloc, index = self.alloc, planned.buffer_index
        header = self._header_np[index]
        pack_ledger(alloc.ledger, header)
        header[0, META_STEP] = self.n_steps + 1
        header[0, META_STEPS_RUN] = alloc.steps_run + 1  # mark_submitted counts it next
        self._payload_desc.copy_(alloc.ring.bufs[index], non_blocking=True)
        self._payload_header.copy_(self._header_bufs[index], non_blocking=True)
        self._broadcast_and_launch()

    def _broadcast_and_launch(self) -> None:
        dist.broadcast(self.payload_buf, src=self.src, group=self.group)
        if self._step_graph is not None:
            self._step_graph.replay()
            self.n_replays += 1
        else:
            self.alloc.kernels(self._payload_release, self._payload_alloc)

    def _empty_step(self) -> None:
        """Keep lockstep after a refused call: one device step that changes nothing."""
        if self.mode == "broadcast":
            self._payload_desc.zero_()
            self._payload_meta[META_STEP].fill_(self.n_steps + 1)  # a device fill: no sync
            self._broadcast_and_launch()
        self._after_step()

    # ---- digests and checks ------------------------------------------------------------
    def _after_step(self) -> None:
        self.n_steps += 1
        if not self.check_every:
            return
        if self.n_steps % self.digest_every == 0:
            self._record_digest(host_ledger=self.mode == "replicated")
        if self.n_steps % self.check_every == 0:
            with sync_allowed():
                self._compare()

    def _record_digest(self, host_ledger: bool) -> None:
        ledger = ledger_digest(self.alloc.ledger) if host_ledger else None
        self.history.record(self.n_steps, ledger, self._digest_graph)
        if self._digest_graph is not None:
            self.n_replays += 1

    def _compare(self) -> None:
        """All-gather the history rows and compare them (collective; call under
        sync_allowed). Stores the error; a follower then refreshes its ledger."""
        table = self.history.gather(self.group, self.world_size)
        self.n_checks += 1
        error = self._first_divergence(table)
        if error is None:
            if table.shape[1]:
                self.last_equal_step = int(table[0, -1, COL_STEP])
        else:
            self._error = error
            self.first_divergence = self.first_divergence or error
        if self.mode == "broadcast" and not self.is_planner:
            self.sync_ledger()

    def _first_divergence(self, table: np.ndarray) -> ReplicaDivergenceError | None:
        """:func:`~graphalloc.replica_checks.first_divergence` with this wrapper's ranks."""
        return first_divergence(table, self.columns, self.global_ranks, self.src,
                                self.last_equal_step)

    def _raise_divergence(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # ---- construction helpers ----------------------------------------------------------
    def _check_same_config(self) -> None:
        check_same_setup(self.alloc.config, (self.mode, self.src, self.check_every,
                                             self.digest_every, len(self.alloc.ring)),
                         self.group, self.global_ranks, self.device)

    def _allocate_buffers(self) -> None:
        """Allocated once, updated in place only (graphs hold their addresses)::

            history       DigestHistory, n_hist rows     device  digest rows since the check
            payload_buf   int64 [n_desc + 1 + n_ledger_rows(cfg), 8]
                                                         device  broadcast mode: the payload
            _header_bufs  int64 [1 + n_ledger_rows(cfg), 8] x len(alloc.ring)
                                                         pinned  planner staging, one per
                                                                 descriptor buffer

        ``n_hist = check_every // digest_every + 1`` (the extra row for ``check()``).
        """
        cfg, alloc, mode = self.alloc.config, self.alloc, self.mode
        check_every, digest_every = self.check_every, self.digest_every

        # Broadcast payload (fixed shape, allocated once; views made once).
        n_desc = cfg.max_release_rows + cfg.max_alloc_rows
        self.n_desc_rows = n_desc
        if mode == "broadcast":
            n_rows = n_desc + 1 + n_ledger_rows(cfg)
            self.payload_buf = torch.zeros(n_rows, ROW_WIDTH, dtype=torch.int64,
                                           device=self.device)
            self._payload_desc = self.payload_buf[:n_desc]
            self._payload_release = self.payload_buf[:cfg.max_release_rows]
            self._payload_alloc = self.payload_buf[cfg.max_release_rows:n_desc]
            self._payload_header = self.payload_buf[n_desc:]
            self._payload_meta = self.payload_buf[n_desc]
            pinned = self.device.type == "cuda"
            # Planner staging: header buffer i travels with descriptor buffer i.
            self._header_bufs = [torch.zeros(n_rows - n_desc, ROW_WIDTH, dtype=torch.int64,
                                             pin_memory=pinned)
                                 for _ in range(len(alloc.ring) if self.is_planner else 0)]
            self._header_np = [b.numpy() for b in self._header_bufs]

        n_hist = (check_every // digest_every if check_every else 0) + 1
        self.history = DigestHistory(alloc.state.tables(), self.device, n_hist,
                                     self._payload_meta if mode == "broadcast" else None)
        self.columns = self.history.columns

    def _capture_graphs(self) -> None:
        """Warm up on a side stream (compiles the kernels; the zero payload is all padding,
        so nothing changes), then capture. Runs once, under sync_allowed."""
        fns = [self.history.compute]
        if self.mode == "broadcast":
            fns.insert(0, lambda: self.alloc.kernels(self._payload_release, self._payload_alloc))
        torch.cuda.synchronize()  # sync ok: one-time construction
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()  # sync ok: one-time construction
        graphs = [capture_graph(fn) for fn in fns]
        torch.cuda.synchronize()  # sync ok: one-time construction
        self._digest_graph = graphs[-1]
        self._step_graph = graphs[0] if self.mode == "broadcast" else None
