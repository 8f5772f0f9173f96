"""SGLang's token-to-KV-pool allocator, on graphalloc's host-counted page rings.

Contract. :class:`GraphallocTokenToKVPoolAllocator` answers the calls SGLang's own
allocation path (``mem_cache/allocation.py``, ``common.py``, its chunk and radix caches)
makes on ``token_to_kv_pool_allocator``, with SGLang's names, arguments and results:
``alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
extend_num_tokens)`` and ``alloc_decode(seq_lens, seq_lens_cpu, last_loc)`` return the new
tokens' full slots as a device tensor, or ``None`` when a pool is short (nothing changed);
``free_segment`` / ``free_swa_segment`` / ``free_full_segment`` (a page-aligned segment of
one request's kv row), ``free`` / ``free_swa`` / ``free_full`` (any slot set),
``free_group_begin`` / ``free_group_end``, ``available_size`` and its FULL / SWA forms,
``translate_loc_from_full_to_swa``, ``set_`` / ``clear_full_to_swa_mapping``, ``alloc``
(whole pages). With ``size_swa`` it is SGLang's SWA pair (two pools paged in step, the
``full_to_swa_index_mapping`` with its trailing ``-1``); without, one paged pool.
:func:`~.sglang_subclass.sglang_classes` subclasses SGLang's own allocators with it when
SGLang is importable, so the scheduler's capacity hooks it does not override are SGLang's.

How calls become steps (docs/sglang.md). SGLang's calls name no request: they carry
device tensors (slots to free, ``last_loc``) and host lengths (``*_cpu``). So the host
keeps what it can know without reading the device: the free rings' head and fill
(:class:`~.page_ring.PageRing`), how many pages each recorded free gives back, how many
each allocation takes. A free only RECORDS: one device copy of the segment's page
representatives into a staging buffer (SGLang's views may be rewritten later), no
deduplication of pages, no host read. The next allocation is the iteration's ONE step, two
launches (:mod:`graphalloc.kernels.page_ring`, Triton on a GPU, the Torch twins
elsewhere): ``ring_frees`` looks the recorded SWA peers up, clears their mappings and
pushes every recorded page; ``ring_alloc`` writes each new token's slot (the rest of the
page after ``last_loc``, read on the device, then the rings' pages from the host-known
heads) and its SWA pair, from a per-token descriptor the host built from the lengths.
A free group is therefore one step by construction.

Invariants: per pool, ring fill + pages held == pages (page 0 is the sink, never free);
``available_size()`` counts recorded frees at once (inside a free group, at its end, as
SGLang); a segment free needs mapped SWA peers where it frees SWA (SGLang's contract: a
violation is counted on the device and raised by :meth:`check`, never silently pushed).
Cost: a free call O(1) host work + one device copy; an allocation O(tokens) vectorised
numpy (a few calls for a decode), one descriptor copy and the two launches; set-shaped
frees read their pages back (one host read, as SGLang's own set free does),
counted in ``n_host_reads``: off the fast path (SGLang's allocation path frees row
segments only; the conformance runs count 0 such reads).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import (
    AlignmentError,
    CapacityError,
    ConfigError,
    ContractError,
    NestedGroupError,
    PositionError,
)
from ..kernels.page_ring import ring_alloc, ring_alloc_torch, ring_frees, ring_frees_torch
from .page_ring import PageRing
from .sglang_views import FullPoolView, SwaPoolView

__all__ = ["GraphallocTokenToKVPoolAllocator", "new_pages"]


def new_pages(prefix_lens: np.ndarray, seq_lens: np.ndarray, page_size: int) -> np.ndarray:
    """Pages each request adds growing from ``prefix_lens`` to ``seq_lens`` tokens."""
    return -(-seq_lens // page_size) + (-prefix_lens // page_size)


def _host_lens(value, what: str) -> np.ndarray:
    """A host length vector (SGLang's ``*_cpu`` tensors; lists and arrays too) as int64."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ContractError(f"{what} must be a host tensor: reading a device one would "
                                "synchronise (SGLang passes its *_cpu copy)")
        return value.numpy().astype(np.int64, copy=False)
    return np.asarray(value, dtype=np.int64)


class GraphallocTokenToKVPoolAllocator:
    """SGLang's paged (``size_swa=None``) or SWA token-to-KV-pool allocator; see the
    module docstring. ``size`` / ``size_swa`` are tokens (whole pages), ``device`` where
    the rings and the mapping live, ``kvcache`` SGLang's KV pool (its ``register_mapping``
    gets the mapping) or ``None``. ``n_steps``: steps run; ``n_host_reads``: set-shaped
    frees that read their slots back."""

    uses_legacy_real_length_alloc = False  # SGLang's out-of-tree contract: whole pages
    _swa_req_ring = False

    def __init__(self, *, size: int, page_size: int, size_swa: int | None = None,
                 dtype=torch.float16, device="cpu", kvcache=None, need_sort: bool = False,
                 req_to_token_pool=None, backend: str | None = None):
        if page_size < 1 or size < page_size or (size_swa is not None and size_swa < page_size):
            raise ContractError(f"sizes must hold at least one page of {page_size} tokens: "
                                f"size={size}, size_swa={size_swa}")
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self._size_full = size // page_size * page_size
        self._size_swa = None if size_swa is None else size_swa // page_size * page_size
        self.need_sort = need_sort  # accepted for SGLang's signature; the rings are FIFO
        self._kvcache, self._req_to_token_pool = kvcache, req_to_token_pool
        n_full = self._size_full // page_size
        self.full_ring = PageRing(n_full, device)
        self.swa_ring = None if size_swa is None else PageRing(self._size_swa // page_size,
                                                                device)
        self.full_to_swa_index_mapping = None
        if size_swa is not None:  # SGLang's layout: slots of pages 0..n, then one -1
            self.full_to_swa_index_mapping = torch.zeros(self._size_full + page_size + 1,
                                                         dtype=torch.int64, device=device)
            self.full_to_swa_index_mapping[-1] = -1
            if kvcache is not None and hasattr(kvcache, "register_mapping"):
                kvcache.register_mapping(self.full_to_swa_index_mapping)
        backend = backend or ("triton" if self.device.type == "cuda" else "torch")
        if backend not in ("triton", "torch"):
            raise ConfigError(f"backend must be 'triton' or 'torch', got {backend!r}")
        self.backend = backend
        self._frees, self._alloc = ((ring_frees, ring_alloc) if backend == "triton"
                                    else (ring_frees_torch, ring_alloc_torch))
        self._full_reps_buf = torch.zeros(max(n_full, 1), dtype=torch.int64, device=device)
        self._swa_reps_buf = torch.zeros(max(n_full, 1), dtype=torch.int64, device=device)
        self._faults_buf = torch.zeros((), dtype=torch.int64, device=device)
        self.n_steps = self.n_host_reads = 0
        self.clear()

    # ---- sizes and queries (tokens, host only, O(1)) ----------------------------------------
    @property
    def size(self) -> int:
        return self._size_full if self._size_swa is None else min(self._size_full,
                                                                    self._size_swa)

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_swa(self) -> int:
        return self._size_swa or 0

    @property
    def swa_req_ring(self) -> bool:
        return False

    @property
    def swa_ring_cost_tokens(self) -> int:
        return 0

    def full_available_size(self) -> int:
        """Free FULL slots, recorded frees counted (a group's at its end)."""
        return (self.full_ring.fill + self._n_full - self._group_full) * self.page_size

    def swa_available_size(self) -> int:
        if self.swa_ring is None:
            return self.full_available_size()
        return (self.swa_ring.fill + self._n_swa - self._group_swa) * self.page_size

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        ps = self.page_size
        return (num_full_pages <= self.full_available_size() // ps
                and num_swa_pages <= self.swa_available_size() // ps)

    def get_kvcache(self):
        return self._kvcache

    def debug_print(self) -> str:
        return (f"#swa-available-size: {self.swa_available_size()}, "
                f"#full-attn-available-size: {self.full_available_size()}, ")

    def merge_and_sort_free(self) -> None:
        """Nothing to merge: freed pages enter the ring at the step."""

    def get_all_free_pages(self) -> torch.Tensor:
        """Free FULL page ids once the recorded frees ran (runs them: a step)."""
        self.flush()
        return self.full_ring.free_ids()

    # ---- allocation: the iteration's step ---------------------------------------------------
    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens: int, num_new_pages: int | None = None, **_ignored):
        """Slots for growing each request from ``prefix_lens_cpu[i]`` to ``seq_lens_cpu[i]``
        tokens, request by request (SGLang's order): the rest of the page after
        ``last_loc[i]`` first, then fresh pages. ``None`` when either pool is short."""
        pre = _host_lens(prefix_lens_cpu, "prefix_lens_cpu")
        seq = _host_lens(seq_lens_cpu, "seq_lens_cpu")
        return self._allocate(pre, seq, last_loc, extend_num_tokens)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, **_ignored):
        """One slot per request (``seq_lens_cpu`` are the lengths after it): the slot after
        ``last_loc[i]``, or a fresh page's first. ``None`` when a pool is short."""
        seq = _host_lens(seq_lens_cpu, "seq_lens_cpu")
        return self._allocate(seq - 1, seq, last_loc, len(seq), decode=True)

    def alloc(self, need_size: int):
        """``need_size`` tokens of whole fresh pages (SGLang's page-aligned ``alloc``):
        contiguous slots of each page, ``None`` when short."""
        if need_size % self.page_size:
            raise AlignmentError(f"alloc({need_size}): whole pages of {self.page_size} only")
        k = need_size // self.page_size
        if not self.new_pages_available(k, k):
            return None
        full_pages, swa_pages = self._step(k)
        offs = torch.arange(self.page_size, device=self.device)
        out = (full_pages[:, None] * self.page_size + offs).reshape(-1)
        if swa_pages is not None:
            self.full_to_swa_index_mapping[out] = (swa_pages[:, None] * self.page_size
                                                   + offs).reshape(-1)
        return out

    def _allocate(self, pre: np.ndarray, seq: np.ndarray, last_loc, n_tokens: int,
                  decode: bool = False):
        ps = self.page_size
        n = seq - pre
        if len(pre) != len(seq) or (len(n) and n.min() < 0) or int(n.sum()) != n_tokens:
            raise PositionError(f"lengths disagree: {len(pre)} prefixes, {len(seq)} lengths, "
                                f"{int(n.sum())} new tokens, {n_tokens} asked")
        fresh = new_pages(pre, seq, ps)  # pages each request adds
        k = int(fresh.sum())
        if not self.new_pages_available(k, k):
            return None
        # per token: owner request, fresh-page rank (-1: the page after last_loc), offset
        first_rank = np.cumsum(fresh) - fresh
        if decode:  # one token each: a fresh page exactly where the request starts one
            owner = np.arange(len(n))
            rank = np.where(fresh > 0, first_rank, -1)
            offset = np.zeros(len(n), dtype=np.int64)
        else:
            starts = np.cumsum(n) - n
            owner = np.repeat(np.arange(len(n)), n)
            local = np.arange(n_tokens) - starts[owner]
            past = local - (np.minimum(seq, -(-pre // ps) * ps) - pre)[owner]
            rank = np.where(past < 0, -1, first_rank[owner] + past // ps)
            offset = np.where(past < 0, local, past % ps)
        desc = torch.from_numpy(np.stack([owner, rank, offset])).to(self.device,
                                                                      non_blocking=True)
        self._run_frees()
        full_head = self.full_ring.take(k)
        swa_head = self.swa_ring.take(k) if self.swa_ring is not None else 0
        out = torch.empty(n_tokens, dtype=torch.int64, device=self.device)
        self._alloc(desc, last_loc, self.full_to_swa_index_mapping, self.full_ring.ring_buf,
                    None if self.swa_ring is None else self.swa_ring.ring_buf, out, n_tokens,
                    full_head, swa_head, ps)
        return out

    def _run_frees(self) -> None:
        """The recorded frees, one launch (SWA peers looked up, mappings cleared, pages
        pushed onto the rings); the step's first half. Counts as a step."""
        n_swa, n_full = self._n_swa, self._n_full
        self.n_steps += 1
        if not (n_swa or n_full):
            return
        full, swa = self.full_ring, self.swa_ring
        if full.fill + n_full > full.n_pages or (swa is not None and
                                                 swa.fill + n_swa > swa.n_pages):
            self._n_swa = self._n_full = 0
            raise CapacityError("more pages freed than are held: a page was freed twice "
                                "(the recorded frees are dropped; check() audits the rings)")
        self._frees(self._swa_reps_buf, self._full_reps_buf, self.full_to_swa_index_mapping,
                    None if swa is None else swa.ring_buf, full.ring_buf, self._faults_buf,
                    n_swa, n_full, 0 if swa is None else swa.tail, full.tail, self.page_size)
        full.fill += n_full
        if swa is not None:
            swa.fill += n_swa
        self._n_swa = self._n_full = 0

    def _step(self, k: int):
        """The recorded frees, then ``k`` pages of each pool popped (device tensors)."""
        self._run_frees()
        full_pages = self.full_ring.pop(k)
        return full_pages, None if self.swa_ring is None else self.swa_ring.pop(k)

    def flush(self) -> int:
        """Run the recorded frees now (an idle iteration); returns 1 if a step ran."""
        if not (self._n_swa or self._n_full):
            return 0
        self._run_frees()
        return 1

    # ---- frees: recorded, run by the next step ----------------------------------------------
    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free ``kv_row[start_pos:start_pos + n]`` of one request, both pools (SWA peers
        must be mapped): pages ``[start_pos // ps, ceil(end / ps))``. One device copy."""
        self._record(free_index, start_pos, swa=self.swa_ring is not None, full=True)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """The SWA peers of a row segment (the window's eviction); FULL pages stay."""
        if self.swa_ring is not None:
            self._record(free_index, start_pos, swa=True, full=False)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """The FULL pages of a row segment whose SWA peers are already gone."""
        self._record(free_index, start_pos, swa=False, full=True)

    def free_segments(self, segments) -> None:
        for free_index, start_pos in segments:
            self.free_segment(free_index, start_pos=start_pos)

    def free_full_segments(self, segments) -> None:
        for free_index, start_pos in segments:
            self.free_full_segment(free_index, start_pos=start_pos)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these FULL pages (and their SWA peers, mapped by contract)."""
        reps = page_ids.to(torch.int64) * self.page_size
        self._stage(reps, reps.numel(), swa=self.swa_ring is not None, full=True)

    def free_full_page_ids(self, page_ids: torch.Tensor) -> None:
        reps = page_ids.to(torch.int64) * self.page_size
        self._stage(reps, reps.numel(), swa=False, full=True)

    @property
    def full_attn_allocator(self) -> FullPoolView:
        """SGLang's handle on the FULL pool alone (its radix cache frees through it)."""
        return FullPoolView(self)

    @property
    def swa_attn_allocator(self) -> SwaPoolView:
        return SwaPoolView(self)

    def free(self, free_index: torch.Tensor) -> None:
        """Free an arbitrary slot set (each touched page once): one host read of its pages
        and SWA peers, as SGLang's own set free; then recorded like a segment."""
        self._free_set(free_index, swa=self.swa_ring is not None, full=True)

    def free_swa(self, free_index: torch.Tensor) -> None:
        if self.swa_ring is not None:
            self._free_set(free_index, swa=True, full=False)

    def free_full(self, free_index: torch.Tensor) -> None:
        self._free_set(free_index, swa=False, full=True)

    def _free_set(self, free_index: torch.Tensor, *, swa: bool, full: bool) -> None:
        if free_index.numel() == 0:
            return
        ps = self.page_size
        # a set-shaped free reads its pages back (a host read), as SGLang's does
        reps = torch.unique(free_index.to(torch.int64) // ps) * ps  # off the fast path
        self.n_host_reads += 1
        if swa:  # only pages with a live peer give one back (SGLang drops the rest)
            mapped = reps[self.full_to_swa_index_mapping[reps] > 0]
            self._stage(mapped.to(self.device), mapped.numel(), swa=True, full=False)
        if full:
            self._stage(reps.to(self.device), reps.numel(), swa=False, full=True)

    def _record(self, free_index: torch.Tensor, start_pos: int, *, swa: bool,
                full: bool) -> None:
        if start_pos % self.page_size:
            raise AlignmentError(f"segment start {start_pos} is not page-aligned (page_size "
                                 f"{self.page_size})")
        if free_index.numel() == 0:
            return
        reps = free_index[::self.page_size]
        self._stage(reps, reps.numel(), swa=swa, full=full)

    def _stage(self, reps: torch.Tensor, n: int, *, swa: bool, full: bool) -> None:
        cap = self._full_reps_buf.numel()
        if (swa and self._n_swa + n > cap) or (full and self._n_full + n > cap):
            self.flush()  # more frees than pages: the ring's push refuses a double free
            if n > cap:
                raise ContractError(f"a free of {n} pages; the pool has {cap}")
        if swa:
            self._swa_reps_buf[self._n_swa:self._n_swa + n].copy_(reps)
            self._n_swa += n
            self._group_swa += n if self.free_group is not None else 0
        if full:
            self._full_reps_buf[self._n_full:self._n_full + n].copy_(reps)
            self._n_full += n
            self._group_full += n if self.free_group is not None else 0

    def free_group_begin(self) -> None:
        """Open a free group (nesting raises ``NestedGroupError``). The group's frees count
        in the sizes from its end and run with the next step, like every free."""
        if self.free_group is not None:
            raise NestedGroupError("free groups cannot be nested")
        self.free_group = []

    def free_group_end(self) -> None:
        self.free_group = None
        self._group_full = self._group_swa = 0

    # ---- the SWA mapping --------------------------------------------------------------------
    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """SWA slots of full slots (a device gather; ``-1`` -> ``-1``, no peer -> 0)."""
        return self.full_to_swa_index_mapping[kv_indices]

    def translate_swa_indices_for_transfer(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.translate_loc_from_full_to_swa(kv_indices)

    def set_full_to_swa_mapping(self, full_indices, swa_indices) -> None:
        """Pair slots (a cache's load-back). Recorded SWA frees run first: SGLang resolves
        a free's peers when it is made, so a later pairing must not change them."""
        if full_indices.numel():
            self.flush()
            self.full_to_swa_index_mapping[full_indices.to(torch.int64)] = \
                swa_indices.to(torch.int64)

    def clear_full_to_swa_mapping(self, full_indices) -> None:
        if full_indices.numel():
            self.flush()
            self.full_to_swa_index_mapping.index_fill_(0, full_indices.to(torch.int64), 0)

    # ---- whole-pool operations (off the fast path) ------------------------------------------
    def clear(self) -> None:
        """Every page free, no mapping, nothing recorded."""
        self.full_ring.clear()
        if self.swa_ring is not None:
            self.swa_ring.clear()
            self.full_to_swa_index_mapping[:-1].fill_(0)
        self._n_full = self._n_swa = self._group_full = self._group_swa = 0
        self.free_group = None

    def check(self) -> None:
        """Read the device: rings hold distinct pages, no SWA free of an unmapped peer."""
        self.flush()
        faults = int(self._faults_buf)
        if faults:
            raise ContractError(f"{faults} SWA frees named a full page with no SWA peer "
                                "(free_full_segment is the call for those)")
        self.full_ring.check()
        if self.swa_ring is not None:
            self.swa_ring.check()
