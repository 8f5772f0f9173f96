"""A continuous-batching loop over SGLang's own allocation path, for either allocator.

The loop is the harness's (admission, chunking, retraction follow SGLang's scheduler in
outline: prefill first, chunked to a token budget, admitted while ``available_size()``
covers the chunk plus a page per request and the running requests' next decode; else
one decode of every running request, retracting the newest while the decode does not
fit). Everything that allocates or frees is SGLang's own code from the installed
package: ``ReqToTokenPool``, ``SWAKVPool``, ``ReqKvInfo``, ``get_last_loc_torch``,
``alloc_paged_token_slots_extend`` / ``alloc_paged_token_slots_decode`` (allocation.py),
``free_swa_out_of_window_slots`` (the window's eviction, with SGLang's due rule and the
first-decode skip) and ``free_kv_row_segments`` (a finished or retracted request's row),
the frees of one iteration in one free group. The allocator under it is SGLang's
``SWATokenToKVPoolAllocator`` (``kind="sglang"``) or graphalloc's subclass of it
(``kind="graphalloc"``); the loop cannot tell them apart.

``Loop.iteration()`` runs one scheduler iteration and returns what it decided; with
``observe=True`` it also reads the device to report pages held per request (a
conformance check, off the timed path).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import torch

__all__ = ["Loop", "Workload", "make_requests"]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    page_size: int = 16
    window: int = 128
    eviction_interval: int = 1
    chunk_tokens: int = 512
    n_requests: int = 48
    max_running: int = 16
    prompt_tokens: tuple = (16, 600)
    output_tokens: tuple = (4, 200)
    full_pages: int = 512
    swa_pages: int = 128
    seed: int = 0
    radix: bool = False  # SGLang's radix cache (sglang_radix_loop.py) instead of none
    system_prompts: int = 2  # radix: prompts share one of these ...
    system_tokens: int = 192  # ... of this many tokens
    tenants: int = 2  # radix: requests carry extra_key "tenant-<i>"


@dataclasses.dataclass(eq=False)
class Req:
    rid: int
    prompt_len: int
    max_new: int
    kv: object
    n_out: int = 0
    decode_batch_idx: int = 0

    @property
    def kv_len(self) -> int:
        return self.kv.kv_allocated_len


def make_requests(w: Workload, kv_info) -> list:
    rng = np.random.default_rng(w.seed)
    return [Req(i, int(rng.integers(*w.prompt_tokens)), int(rng.integers(*w.output_tokens)),
                kv_info()) for i in range(w.n_requests)]


class Loop:
    def __init__(self, sg: dict, kind: str, w: Workload, *, device="cpu", max_context=None):
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        from graphalloc.integrations.sglang_subclass import sglang_classes

        self.sg, self.w, self.kind, self.device = sg, w, kind, device
        self.swa_component = ComponentType.SWA
        ps = w.page_size
        max_context = max_context or (w.prompt_tokens[1] + w.output_tokens[1] + 2 * ps)
        self.r2t = sg["memory_pool"].ReqToTokenPool(
            size=w.max_running + 1, max_context_len=max_context, device=device,
            enable_memory_saver=False)
        full, swa = w.full_pages * ps, w.swa_pages * ps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kv = sg["swa_memory_pool"].SWAKVPool(
                size=full, size_swa=swa, page_size=ps, dtype=torch.float16, head_num=1,
                head_dim=8, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                device=device)
        cls = (sg["swa"].SWATokenToKVPoolAllocator if kind == "sglang"
               else sglang_classes()["swa"])
        self.alloc = cls(full, swa, ps, torch.float16, device, kv, False)
        self.tree = _ChunkTree(self.alloc, self.r2t, ps)
        self.waiting = make_requests(w, ReqKvInfo)
        self.running: list = []
        self.chunked = None  # the request whose prefill is split over iterations
        self.n_iter = 0

    # ---- one scheduler iteration ---------------------------------------------------------
    def done(self) -> bool:
        return not (self.waiting or self.running or self.chunked)

    def iteration(self, observe: bool = False) -> dict:
        self.n_iter += 1
        record = {"iter": self.n_iter}
        batch = self._prefill_batch()
        if batch:
            record.update(self._extend(batch))
        elif self.running:
            record.update(self._decode())
        else:
            record["kind"] = "idle"
        if observe:
            record["available"] = [self.alloc.full_available_size(),
                                   self.alloc.swa_available_size()]
            record["held"] = self.held()
        return record

    def _reserve(self) -> int:
        return len(self.running) * self.w.page_size  # the next decode's worst case

    def _prefill_batch(self) -> list:
        """[(req, prefix_len, extend_len)] within the chunk budget and the free pages."""
        ps, budget, batch = self.w.page_size, self.w.chunk_tokens, []
        need = self._reserve()
        queue = ([self.chunked] if self.chunked else []) + list(self.waiting)
        rows = self.r2t.available_size()
        for req in queue:
            if budget <= 0:
                break
            new = not req.kv.holds_kv
            if new and (rows == 0 or len(self.running) + len(batch) >= self.w.max_running):
                break
            pre = req.kv_len
            ext = min(req.prompt_len - pre, budget)
            cost = ext + ps
            if self.alloc.available_size() < need + cost:
                break
            batch.append((req, pre, ext))
            need += cost
            budget -= ext
            rows -= new
        return batch

    def _extend(self, batch: list) -> dict:
        alloc, ps, sg = self.alloc, self.w.page_size, self.sg
        # the window's eviction of requests holding rows (a chunked prefill's next chunk)
        alloc.free_group_begin()
        for req, pre, _ in batch:
            self._evict(req, pre, 1)
        alloc.free_group_end()
        new = [req for req, _, _ in batch if not req.kv.holds_kv]
        for req, row in zip(new, self.r2t.alloc_rows(len(new)) or [], strict=False):
            req.kv.req_pool_idx = row
        pre = torch.tensor([p for _, p, _ in batch], dtype=torch.int64)
        seq = torch.tensor([p + e for _, p, e in batch], dtype=torch.int64)
        rows = torch.tensor([r.kv.req_pool_idx for r, _, _ in batch], dtype=torch.int64)
        dev = self.device
        pre_d, seq_d, rows_d = pre.to(dev), seq.to(dev), rows.to(dev)
        last_loc = sg["allocation"].get_last_loc_torch(self.r2t.req_to_token, rows_d, pre_d)
        n_tokens = int((seq - pre).sum())
        if ps == 1:  # SGLang's alloc_for_extend takes plain slots at page size 1
            out = sg["allocation"].alloc_token_slots(self.tree, n_tokens)
        else:
            out = sg["allocation"].alloc_paged_token_slots_extend(
                self.tree, pre_d, pre, seq_d, seq, last_loc, n_tokens)
        self._write_rows(rows, pre, seq, out)
        done = []
        for req, p, e in batch:
            req.kv.kv_allocated_len = req.kv.kv_committed_len = p + e
            if req in self.waiting:
                self.waiting.remove(req)
            if p + e == req.prompt_len:  # the prompt is in: first token sampled
                req.n_out = 1
                self.chunked = None if self.chunked is req else self.chunked
                (done if req.n_out >= req.max_new else self.running).append(req)
            else:
                self.chunked = req
        self._release(done)
        return {"kind": "extend", "reqs": [r.rid for r, _, _ in batch],
                "tokens": n_tokens, "finished": [r.rid for r in done]}

    def _decode(self) -> dict:
        alloc, ps, sg = self.alloc, self.w.page_size, self.sg
        retracted = []
        while len(self.running) > 1 and alloc.available_size() < len(self.running) * ps:
            req = self.running.pop()  # the newest goes back to the queue, recomputed
            self._free_row(req)
            req.n_out, req.decode_batch_idx = 0, 0
            self.waiting.insert(0, req)
            retracted.append(req.rid)
        alloc.free_group_begin()
        w = self.w
        for req in self.running:  # SGLang's due rule and its first-decode skip
            seqlen = req.kv_len + 1
            if req.decode_batch_idx >= 1 and (seqlen - 1 - w.window >= req.kv.get_evicted_seqlen(
                    self.swa_component) + w.eviction_interval):
                self._evict(req, seqlen - 1, 1)
        alloc.free_group_end()
        lens = torch.tensor([r.kv_len for r in self.running], dtype=torch.int64)
        rows = torch.tensor([r.kv.req_pool_idx for r in self.running], dtype=torch.int64)
        dev = self.device
        lens_d, rows_d = lens.to(dev), rows.to(dev)
        last_loc = self.r2t.req_to_token[rows_d, lens_d - 1]
        if ps == 1:
            out = sg["allocation"].alloc_token_slots(self.tree, len(self.running))
        else:
            out = sg["allocation"].alloc_paged_token_slots_decode(
                self.tree, lens_d + 1, lens + 1, last_loc)
        self.r2t.req_to_token[rows_d, lens_d] = out.to(torch.int32)
        done = []
        for req in self.running:
            req.kv.kv_allocated_len += 1
            req.kv.kv_committed_len += 1
            req.n_out += 1
            req.decode_batch_idx += 1
            if req.n_out >= req.max_new:
                done.append(req)
        ids = {r.rid for r in done}
        decoded = [r.rid for r in self.running]
        self.running = [r for r in self.running if r.rid not in ids]
        self._release(done)
        return {"kind": "decode", "reqs": decoded, "retracted": retracted,
                "finished": [r.rid for r in done]}

    # ---- SGLang's frees --------------------------------------------------------------------
    def _evict(self, req, pre_len: int, interval: int) -> None:
        if req.kv.holds_kv:
            self.sg["common"].free_swa_out_of_window_slots(
                req, pre_len, sliding_window_size=self.w.window, page_size=self.w.page_size,
                req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                supports_prefix_sharing=False, eviction_interval=interval)

    def _release(self, reqs: list) -> None:
        if not reqs:
            return
        self.alloc.free_group_begin()
        for req in reqs:
            self._free_row(req)
        self.alloc.free_group_end()

    def _free_row(self, req) -> None:
        kv, ps = req.kv, self.w.page_size
        row = self.r2t.req_to_token[kv.req_pool_idx]
        self.sg["common"].free_kv_row_segments(
            self.alloc, [(row[kv.cache_protected_len:kv.kv_allocated_len],
                          kv.cache_protected_len)],
            swa_evicted_seqlen=kv.get_evicted_seqlen(self.swa_component),
            swa_dead_lo=kv.swa_dead_lo(ps))
        self.r2t.free_rows([kv.req_pool_idx])
        kv.req_pool_idx = None
        kv.kv_committed_len = 0
        kv.mark_kv_released()

    def _write_rows(self, rows, pre, seq, out) -> None:
        n = (seq - pre).numpy()
        if not n.sum():
            return
        starts = np.cumsum(n) - n
        owner = np.repeat(np.arange(len(n)), n)
        cols = pre.numpy()[owner] + np.arange(int(n.sum())) - starts[owner]
        index = torch.from_numpy(np.stack([rows.numpy()[owner], cols])).to(self.device)
        self.r2t.req_to_token[index[0], index[1]] = out.to(torch.int32)

    # ---- observation (reads the device; conformance only) --------------------------------
    def held(self) -> dict:
        """rid -> [full pages, SWA pages, window frontier] of every request holding a row."""
        ps, out = self.w.page_size, {}
        mapping = self.alloc.full_to_swa_index_mapping
        for req in ([self.chunked] if self.chunked else []) + self.running:
            kv = req.kv
            slots = self.r2t.req_to_token[kv.req_pool_idx, :kv.kv_allocated_len].long()
            front = kv.get_evicted_seqlen(self.swa_component)
            swa = mapping[slots[front:]]
            out[req.rid] = [int(torch.unique(slots // ps).numel()),
                            int(torch.unique(swa[swa > 0] // ps).numel()), front]
        return out

    def owners_disjoint(self) -> bool:
        """No FULL or SWA page is held by two requests (graphalloc's invariant)."""
        ps, mapping = self.w.page_size, self.alloc.full_to_swa_index_mapping
        fulls, swas = [], []
        for req in ([self.chunked] if self.chunked else []) + self.running:
            kv = req.kv
            slots = self.r2t.req_to_token[kv.req_pool_idx, :kv.kv_allocated_len].long()
            fulls.append(torch.unique(slots // ps))
            swa = mapping[slots[kv.get_evicted_seqlen(self.swa_component):]]
            swas.append(torch.unique(swa[swa > 0] // ps))
        f = torch.cat(fulls) if fulls else torch.zeros(0)
        s = torch.cat(swas) if swas else torch.zeros(0)
        return (len(torch.unique(f)) == len(f) and len(torch.unique(s)) == len(s)
                and not (f == 0).any() and not (s == 0).any())


class _ChunkTree:
    """What SGLang's allocation path reads of a tree cache without prefix sharing (its
    chunk-cache behaviour): the allocator, and no eviction."""

    def __init__(self, allocator, req_to_token_pool, page_size: int):
        self.token_to_kv_pool_allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size

    def supports_prefix_sharing(self) -> bool:
        return False

    def available_and_evictable_str(self) -> str:
        a = self.token_to_kv_pool_allocator
        return f"available full={a.full_available_size()} swa={a.swa_available_size()}"

    def pretty_print(self) -> None:
        return None
