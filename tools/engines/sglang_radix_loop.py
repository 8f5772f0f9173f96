"""The continuous-batching loop of ``sglang_loop.py`` with SGLang's radix cache.

Requests are SGLang's own ``Req`` objects whose prompts share a few system prompts;
the cache is SGLang's ``UnifiedRadixCache`` with its FULL and SWA components (SWA
tombstones: a node whose window was evicted keeps its FULL KV). Everything that touches
the cache or the allocator is SGLang's code: ``Req.init_next_round_input`` (the match,
``extra_key`` and ``cache_salt`` in the key), ``tree_cache.lock`` at admission as its
``PrefillAdder`` does, ``prefix_device_indices``, ``alloc_paged_token_slots_extend`` /
``_decode`` (which evict from the tree when short), ``checkpoint_kv_cache`` after a
chunk, ``evict_sliding_windows`` with SGLang's due rule and first-decode skip, and
``release_kv_cache(checkpoint=True)`` in a free group. The admission budget reads
``available_size()`` plus the tree's evictable sizes; pools are sized so nothing is
retracted. ``held()`` adds the prefix hit of every request to what the base loop reports.
"""

from __future__ import annotations

from array import array

import numpy as np
import torch
from sglang_loop import Loop

__all__ = ["RadixLoop"]


class RadixLoop(Loop):
    def __init__(self, sg, kind, w, *, device="cpu"):
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy",
                                                        page_size=w.page_size))
        super().__init__(sg, kind, w, device=device,
                         max_context=w.system_tokens + w.prompt_tokens[1]
                         + w.output_tokens[1] + 2 * w.page_size)
        self.finish_reason = FINISH_LENGTH
        self.tree = UnifiedRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
            page_size=w.page_size, sliding_window_size=w.window,
            tree_components=(ComponentType.FULL, ComponentType.SWA)))
        rng = np.random.default_rng(w.seed + 1000)
        systems = [list(rng.integers(1, 30_000, w.system_tokens))
                   for _ in range(w.system_prompts)]
        self.waiting = []
        for i in range(w.n_requests):
            suffix = list(rng.integers(30_000, 60_000, int(rng.integers(*w.prompt_tokens))))
            ids = array("q", systems[int(rng.integers(w.system_prompts))] + suffix)
            req = Req(f"r{i}", "", ids, SamplingParams(
                temperature=0, max_new_tokens=int(rng.integers(*w.output_tokens))))
            req.extra_key = f"tenant-{int(rng.integers(w.tenants))}"
            req.rid_int, req.n_out = i, 0
            self.waiting.append(req)
        self.hits: dict[int, int] = {}

    # ---- requests: SGLang's Req, read through the base loop's names ----------------------
    @staticmethod
    def _kv_len(req) -> int:
        return req.kv.kv_allocated_len

    def _prompt_len(self, req) -> int:
        return len(req.origin_input_ids)

    def _budget(self) -> int:
        t = self.tree
        return self.alloc.available_size() + min(t.full_evictable_size(),
                                                 t.swa_evictable_size())

    def _prefill_batch(self) -> list:
        ps, budget, batch = self.w.page_size, self.w.chunk_tokens, []
        need = len(self.running) * ps
        queue = ([self.chunked] if self.chunked else []) + list(self.waiting)
        rows = self.r2t.available_size()
        for req in queue:
            if budget <= 0:
                break
            new = not req.kv.holds_kv
            if new and (rows == 0 or len(self.running) + len(batch) >= self.w.max_running):
                break
            if new:
                req.init_next_round_input(self.tree)  # SGLang's match (keys salted)
                pre = req.prefix_len
            else:
                pre = req.kv.kv_allocated_len
            ext = min(self._prompt_len(req) - pre, budget)
            if self._budget() < need + ext + ps:
                break
            if new:
                req.lock = self.tree.lock(req.last_node)  # as PrefillAdder admits it
                self.hits[req.rid_int] = pre
            req.prefix_len, req.extend_end = pre, pre + ext
            batch.append((req, pre, ext))
            need += ext + ps
            budget -= ext
            rows -= new
        return batch

    def _extend(self, batch: list) -> dict:
        sg, dev = self.sg, self.device
        prefixes = []
        for req, pre, _ in batch:
            if req.kv.holds_kv:
                prefixes.append(self.r2t.req_to_token[req.kv.req_pool_idx, :pre].long())
            else:
                prefixes.append(self.tree.prefix_device_indices(req).long() if pre else
                                torch.empty(0, dtype=torch.int64, device=dev))
        new = [req for req, _, _ in batch if not req.kv.holds_kv]
        for req, row in zip(new, self.r2t.alloc_rows(len(new)) or [], strict=True):
            req.kv.req_pool_idx = row
        for (req, pre, _), prefix in zip(batch, prefixes, strict=True):
            if pre and prefix.numel():
                self.r2t.req_to_token[req.kv.req_pool_idx, :pre] = prefix.to(torch.int32)
        pre = torch.tensor([p for _, p, _ in batch], dtype=torch.int64)
        seq = torch.tensor([p + e for _, p, e in batch], dtype=torch.int64)
        rows = torch.tensor([r.kv.req_pool_idx for r, _, _ in batch], dtype=torch.int64)
        last_loc = torch.cat([t[-1:] if t.numel() else torch.full((1,), -1, device=dev)
                              for t in prefixes])
        n_tokens = int((seq - pre).sum())
        out = sg["allocation"].alloc_paged_token_slots_extend(
            self.tree, pre.to(dev), pre, seq.to(dev), seq, last_loc, n_tokens)
        self._write_rows(rows, pre, seq, out)
        done = []
        for req, p, e in batch:
            req.kv.kv_allocated_len = req.kv.kv_committed_len = p + e
            if req in self.waiting:
                self.waiting.remove(req)
            if p + e == self._prompt_len(req):
                self.chunked = None if self.chunked is req else self.chunked
                self._sample(req)
                (done if req.finished() else self.running).append(req)
            else:
                self.chunked = req
                sg["common"].checkpoint_kv_cache(req, self.tree)
        self._release(done)
        return {"kind": "extend", "reqs": [r.rid_int for r, _, _ in batch],
                "hits": [p for _, p, _ in batch], "tokens": n_tokens,
                "finished": [r.rid_int for r in done]}

    def _sample(self, req) -> None:
        req.output_ids.append(7 + req.rid_int % 1000)
        req.n_out += 1
        if len(req.output_ids) >= req.sampling_params.max_new_tokens:
            req.finished_reason = self.finish_reason(length=len(req.output_ids))

    def _decode(self) -> dict:
        alloc, sg, w = self.alloc, self.sg, self.w
        alloc.free_group_begin()
        window = self.tree.swa_retain_window
        for req in self.running:  # maybe_evict_swa's decode branch
            if req.decode_batch_idx >= 1 and (req.seqlen - 1 - window
                                              >= req.kv.get_evicted_seqlen(self.swa_component)
                                              + w.eviction_interval):
                self.tree.evict_sliding_windows(req, req.seqlen - 1, eviction_interval=1)
        alloc.free_group_end()
        lens = torch.tensor([r.kv.kv_allocated_len for r in self.running], dtype=torch.int64)
        rows = torch.tensor([r.kv.req_pool_idx for r in self.running], dtype=torch.int64)
        dev = self.device
        lens_d, rows_d = lens.to(dev), rows.to(dev)
        last_loc = self.r2t.req_to_token[rows_d, lens_d - 1]
        out = sg["allocation"].alloc_paged_token_slots_decode(
            self.tree, lens_d + 1, lens + 1, last_loc)
        self.r2t.req_to_token[rows_d, lens_d] = out.to(torch.int32)
        done = []
        for req in self.running:
            req.kv.kv_allocated_len += 1
            req.kv.kv_committed_len += 1
            req.decode_batch_idx += 1
            self._sample(req)
            if req.finished():
                done.append(req)
        decoded = [r.rid_int for r in self.running]
        self.running = [r for r in self.running if not r.finished()]
        self._release(done)
        return {"kind": "decode", "reqs": decoded, "retracted": [],
                "finished": [r.rid_int for r in done]}

    def _release(self, reqs: list) -> None:
        if not reqs:
            return
        self.alloc.free_group_begin()
        for req in reqs:
            self.sg["common"].release_kv_cache(req, self.tree, checkpoint=True)
        self.alloc.free_group_end()

    def iteration(self, observe: bool = False) -> dict:
        record = super().iteration(observe)
        if observe:
            t = self.tree
            record["evictable"] = [t.full_evictable_size(), t.swa_evictable_size()]
            record["protected"] = t.protected_size()
        return record

    def held(self) -> dict:
        out = {}
        ps, mapping = self.w.page_size, self.alloc.full_to_swa_index_mapping
        for req in ([self.chunked] if self.chunked else []) + self.running:
            kv = req.kv
            slots = self.r2t.req_to_token[kv.req_pool_idx, :kv.kv_allocated_len].long()
            front = kv.get_evicted_seqlen(self.swa_component)
            swa = mapping[slots[max(front, 0):]]
            out[req.rid_int] = [int(torch.unique(slots // ps).numel()),
                                int(torch.unique(swa[swa > 0] // ps).numel()), front,
                                self.hits.get(req.rid_int, 0)]
        return out

    def owners_disjoint(self) -> bool:
        """No page is held by two requests outside the tree's shared prefixes: every
        request's own part ``[cache_protected_len, len)`` is disjoint from the others'."""
        ps, fulls = self.w.page_size, []
        for req in ([self.chunked] if self.chunked else []) + self.running:
            kv = req.kv
            own = self.r2t.req_to_token[kv.req_pool_idx,
                                        kv.cache_protected_len:kv.kv_allocated_len].long()
            fulls.append(torch.unique(own // ps))
        f = torch.cat(fulls) if fulls else torch.zeros(0)
        return len(torch.unique(f)) == len(f) and not (f == 0).any()

