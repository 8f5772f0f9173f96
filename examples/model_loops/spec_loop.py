"""Speculative decoding over graphalloc's pages: draft k tokens, verify 1 + k in one forward.

Two models of one architecture (``hybrid_model.TinyHybridLM``): the target, and a draft
(here the target with perturbed weights). One allocator maps both: the draft keeps its own
K/V buffers (``draft_kv``) at the SAME slots as the target's, as SGLang's EAGLE does. A
request's draft K/V and target K/V of a position live, die and are evicted together, so the
draft needs no allocator step, no table and no page of its own, and its window eviction is
the target's.

Attention reads the step's page tables. The allocator is built with
``page_tables=spec_tables_spec(max_batch, W)`` (the block-table form, FULL and SWA layers,
the model's window W): every step it plans writes ``block_table[lane, position // ps]`` and
``seq_lens`` of its batch into ``alloc.tables``, inside the same launch, after its
allocations. A round's batch is its decode rows with lookahead k (query ``1 + k`` each),
lane m = the m-th occupied model lane; lane m's SWA range starts at the window of its FIRST
query, ``max(f, L - k - W) = max(f, C + 1 - W)``, so it serves every draft step and every
verify query. :func:`table_key_table` turns block-table rows into the model's key table
(slot = ``page * ps + position % ps``; SWA entries of page 0 -- outside the range -- are
masked): the draft, the verify and the prefill read K/V through the tables only, never
through ``req_to_token`` / ``full_to_swa``.

One round per iteration, for every decoding request row r with committed length C and its
pending token x (sampled by the target, not yet in any cache)::

    allocator step  step(release=finished, accept=(rows, n of the last round),
                         evict=rows, decode=rows, lookahead=k)
                    accept: C += 1 + n (x and the n accepted drafts), pages wholly
                    past C given back;
                    evict:  SWA pages below floor_page(C - W_alloc) freed (W_alloc = W - 1);
                    decode: 1 + k slots at positions [C, C + 1 + k), lanes FIRST[b] + j
    draft           k + 1 steps of one token: step j reads the token at C + j (x, then its
                    own proposals d_1 .. d_j), writes the draft's K/V at C + j, proposes
                    d_{j+1}. Step k's proposal is dropped: it runs so that the draft's
                    K/V of C + k (the token d_k) exists when all k are accepted.
    verify          the target on [x, d_1 .. d_k] at [C, C + k] in ONE forward: writes the
                    target's K/V of all 1 + k positions, then every query attends through
                    the step's block tables (full layers: keys <= q; SWA layers: keys
                    (q - W, q], so the SWA keys of the batch are the W + k positions
                    (C - W, C + k]); y_j = argmax at C + j
    acceptance      n = longest prefix with d_{j+1} == y_j; the round's tokens are
                    y_0 .. y_n (n drafts + the target's bonus token y_n): n_kept = n + 1;
                    the next pending token is y_n; history[serial, gen + j] <- y_j, j <= n
    poison          (``poison=True``) the K/V of the rejected positions [C + n + 1, C + k]
                    are overwritten with a large finite value in both models' caches: a
                    later read of one would change the logits (masked keys still get an
                    exact 0 weight, so finite poison never leaks into a masked read)
    the ONE read    n_kept of every lane (``[max_batch]`` int64) copied into pinned host
                    memory, then an event waited on, inside ``graphalloc.diagnostics.sync_points.
                    sync_allowed()``: the round's single host/device synchronisation

Positions the round reads and writes, per request (C committed, k lookahead)::

    [0, C)            committed: the K/V of both models written by earlier rounds
                      (SWA layers: only [floor_page(C - W_alloc), C) still mapped)
    [C, C + 1 + k)    this round's slots: written by the draft (positions C .. C + k) and
                      by the verify (all 1 + k) before anything reads them
    past C + k        never read: causal masks; a rejected position of an earlier round is
                      trimmed by that round's commit and rewritten before it is read again

The host knows C exactly when it plans a round (it read the counts), so every position
and output lane comes from host-side numbers; nothing on the device is read to plan.
Overlap scheduling (planning round k + 1 before round k's counts are read) is the
allocator's other mode -- a second ``decode(rows, lookahead=k)`` in flight, slots taken on
the device as ``req_to_token[r, pos]`` -- and is not what this loop does: it synchronises
once per round to keep the host's lengths exact.

On a CUDA allocator with ``graph=True`` the allocator step with its tables
(``alloc.launch(i)``), the k + 1 draft steps, the verify forward and the acceptance are ONE
captured graph per descriptor buffer ``i``; otherwise the same body runs eagerly.
Admission (prefill of the target and the draft over the prompt, one allocator step) runs
eagerly between rounds, as in ``paged_decode.DecodeLoop``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hybrid_model import KeyTable, PagedKV, TinyHybridLM
from paged_decode import Request, capture_step_graphs

import graphalloc as ga
from graphalloc.diagnostics.sync_points import sync_allowed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from timing import graph_nodes  # noqa: E402

__all__ = ["SpecLoop", "SpecResult", "table_key_table", "spec_tables_spec",
           "perturbed_weights"]

# rows of the per-round lane input table [N_LANE_FIELDS, max_batch]; TAB: the lane's table
# lane (its rank among the round's decode rows)
ROW, POS, VALID, FIRST, SERIAL, GEN, TAB = range(7)
N_LANE_FIELDS = 7


def spec_tables_spec(max_batch: int, window: int) -> ga.PageTableSpec:
    """The page tables a :class:`SpecLoop` reads: the block-table form (``block_table``,
    ``seq_lens``), FULL and SWA layers, ``max_batch`` lanes, the model's window ``window``
    (W). Pass it as ``HybridAllocator(cfg, page_tables=...)``."""
    return ga.PageTableSpec(max_batch=max_batch, forms=("block_table",),
                            layers=("full", "swa"), model_window=window)
POISON = 1.0e4  # finite: masked keys keep an exact 0 weight (softmax of the dtype's min)


def perturbed_weights(weights: dict[str, torch.Tensor], layers, noise: float,
                      seed: int) -> dict[str, torch.Tensor]:
    """The draft's weights: the target's, with Gaussian noise of ``noise`` times each
    matrix's standard deviation added to every weight matrix of the given decoder layers
    (norms, biases, embeddings and the LM head unchanged). Seeded; CPU."""
    g = torch.Generator().manual_seed(seed)
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    out = {}
    for name, w in weights.items():
        if name.startswith(prefixes) and w.dim() == 2:
            out[name] = w + noise * w.std() * torch.randn(w.shape, generator=g)
        else:
            out[name] = w.clone()
    return out


def table_key_table(model: TinyHybridLM, full_bt, swa_bt, page_size: int, q_pos,
                    n_full_keys: int) -> KeyTable:
    """Keys of ``Q`` consecutive queries per lane (``q_pos`` ``[B, Q]``, ``q_pos[:, j] =
    q_pos[:, 0] + j``) from block-table rows (``full_bt`` / ``swa_bt`` ``[B, width]``, the
    lanes' rows of ``alloc.tables``' block tables), at a fixed shape: full layers read
    positions ``[0, n_full_keys)`` masked to ``<= q``; SWA layers the ``W + Q - 1``
    positions ``(q_0 - W, q_{Q-1}]``, each query masked to its own window ``(q - W, q]``
    (transformers' sliding mask). A position whose page is 0 (outside the lane's range) is
    masked. Slot of a position: ``page * ps + position % ps``. Sync-free, capture-safe."""
    W, ps = model.cfg.sliding_window, page_size
    dev = q_pos.device
    n_q = q_pos.shape[1]
    k_full = torch.arange(n_full_keys, device=dev)
    full_page = full_bt.long()[:, k_full // ps]  # [B, K]
    full_slot = full_page * ps + k_full % ps
    full_mask = (k_full[None, None, :] <= q_pos[:, :, None]) & (full_page != 0)[:, None, :]
    k_swa = q_pos[:, :1] - (W - 1) + torch.arange(W + n_q - 1, device=dev)[None, :]
    k_read = k_swa.clamp(min=0)
    swa_page = torch.gather(swa_bt.long(), 1, k_read // ps)
    swa_slot = swa_page * ps + k_read % ps
    swa_mask = ((k_swa[:, None, :] <= q_pos[:, :, None])
                & (k_swa[:, None, :] > q_pos[:, :, None] - W)
                & (k_swa >= 0)[:, None, :] & (swa_page != 0)[:, None, :])
    return KeyTable(full_slot, full_mask, swa_slot, swa_mask)


@dataclasses.dataclass
class SpecResult:
    tokens: dict[int, list[int]]  # serial -> its first n_out accepted tokens
    logits: dict[int, np.ndarray] | None  # serial -> [n_out, vocab] target logits
    rounds: list[dict]  # per round, host-side numbers
    audits: list[dict]  # midpoint audits: round, findings
    wall_s: float
    prefill_s: float
    host_round_us: list[float]  # plan + fill + replay + mark_submitted, per round
    read_wait_us: list[float]  # the one read per round: copy issued -> counts on the host
    prefill_pages: dict  # pages allocated by the (eager) prefill steps
    graph_nodes: dict | None = None


class SpecLoop:
    """Serves ``requests`` by speculative decoding: ``draft`` proposes, ``target`` decides.

    Args:
        target, draft: two models of the same ``ModelConfig`` (K/V sized from
            ``alloc.config``); the tokens are the target's greedy tokens whatever the draft.
        alloc: a fresh :class:`graphalloc.HybridAllocator` (pool mode, no live requests)
            built with ``page_tables=spec_tables_spec(max_batch, W)``: every attention of
            the loop reads K/V through the block tables its steps write.
        max_batch: lanes of the fixed-shape round (each ``1 + k`` allocator lanes).
        n_serials: requests over the whole run (rows of the history buffers).
        max_out: most tokens one request generates.
        lookahead: k, draft tokens per round (>= 0; 0 is plain decoding through the
            speculative path: one token per round, nothing to reject).
        graph: capture each round into a CUDA graph (needs a CUDA allocator).
        keep_logits: record the target's logits of every accepted token (for comparison).
        poison: overwrite rejected positions' K/V after the verify (see the module doc).
        commit_extra: NEGATIVE CONTROL, 0 in real use: keep ``n_kept + commit_extra`` tokens
            (at most ``1 + k``) in the allocator while the model's positions follow the true
            count, so the allocator's lengths run ahead of the K/V: tokens must differ.

    Cost per round: one allocator plan (O(rows) numpy), one replay (or the eager body:
    k + 1 draft forwards of ``[max_batch, 1]`` tokens and one verify forward of
    ``[max_batch, 1 + k]``), one ``[max_batch]`` int64 device-to-host read and its wait.
    """

    def __init__(self, target: TinyHybridLM, draft: TinyHybridLM, alloc: ga.HybridAllocator,
                 *, max_batch: int, n_serials: int, max_out: int, lookahead: int,
                 graph: bool = False, keep_logits: bool = True, poison: bool = True,
                 commit_extra: int = 0):
        acfg, mcfg = alloc.config, target.cfg
        if draft.cfg != mcfg:
            raise ValueError("the draft must have the target's ModelConfig (same caches, "
                             f"same window): {draft.cfg} vs {mcfg}")
        if alloc.n_live > 0:
            raise ValueError("SpecLoop needs a fresh allocator (no live requests)")
        if acfg.ring_mode:
            raise ValueError("SpecLoop runs a pool-mode allocator (swa_ring_pages=0)")
        if graph and acfg.device.type != "cuda":
            raise ValueError("graph=True needs an allocator on a CUDA device")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {lookahead!r}")
        n_slots = max_batch * (1 + lookahead)
        if max_batch > acfg.max_alloc_rows or n_slots > acfg.max_step_tokens:
            raise ValueError(f"{max_batch} lanes of 1 + {lookahead} slots exceed the "
                             f"allocator's frozen max_alloc_rows {acfg.max_alloc_rows} / "
                             f"max_step_tokens {acfg.max_step_tokens}")
        if 1 + lookahead > acfg.max_tokens_per_alloc_row:
            raise ValueError(f"1 + lookahead = {1 + lookahead} exceeds the allocator's "
                             f"max_tokens_per_alloc_row {acfg.max_tokens_per_alloc_row}")
        t = alloc.tables
        if t is None or not (t.spec.has("block_table", "full")
                             and t.spec.has("block_table", "swa")):
            raise ValueError("SpecLoop reads the page tables of each step: build the allocator "
                             "with page_tables=spec_tables_spec(max_batch, window) (block "
                             "tables, FULL and SWA layers)")
        if t.spec.max_batch != max_batch:
            raise ValueError(f"the allocator's page tables have {t.spec.max_batch} lanes, the "
                             f"loop {max_batch}: build them with spec_tables_spec({max_batch}, "
                             "window)")
        self.tables = t
        self.target, self.draft, self.alloc = target, draft, alloc
        self.max_batch, self.k, self.graph = max_batch, lookahead, graph
        self.poison, self.commit_extra = poison, int(commit_extra)
        dev = acfg.device
        self.device = dev
        n_full_slots, n_swa_slots = acfg.num_full_slots, (acfg.num_swa_pages + 1) * acfg.page_size
        self.kv = PagedKV(mcfg, n_full_slots, n_swa_slots, dev)  # the target's K/V
        self.draft_kv = PagedKV(mcfg, n_full_slots, n_swa_slots, dev)  # same slots, own K/V
        self.n_serials, self.max_out = n_serials, max_out
        # history columns: a round may overshoot n_out by up to k tokens; the last column
        # is the scratch column that rejected lanes write to
        self.hist_width = max_out + lookahead + 2
        # *_buf(s): allocated once, updated in place only (a captured graph holds their addresses)
        self.tokens_buf = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # pending token
        self.lane_buf = torch.zeros(N_LANE_FIELDS, max_batch, dtype=torch.int64, device=dev)
        self.counts_buf = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # n_kept
        pin = dev.type == "cuda"
        self.lane_host_bufs = [  # one per descriptor buffer, guarded by the same event
            torch.zeros(N_LANE_FIELDS, max_batch, dtype=torch.int64, pin_memory=pin)
            for _ in range(len(alloc.ring))]
        self.lane_np = [t.numpy() for t in self.lane_host_bufs]
        self.counts_host_buf = (torch.zeros(max_batch, dtype=torch.int64, pin_memory=True)
                                if pin else self.counts_buf)
        self.counts_np = self.counts_host_buf.numpy()
        self.read_event = torch.cuda.Event() if pin else None
        self.history_buf = torch.zeros(n_serials + 1, self.hist_width, dtype=torch.int64,
                                       device=dev)
        self.logits_buf = (torch.zeros(n_serials + 1, self.hist_width, mcfg.vocab_size,
                                       device=dev) if keep_logits else None)
        self.arange_ctx = torch.arange(acfg.max_context_len, device=dev)
        self.arange_q = torch.arange(1 + lookahead, device=dev)
        self.graphs: list = []

    # ---- the round body (captured) ------------------------------------------------------
    def _body(self, i: int) -> None:
        alloc, k, t = self.alloc, self.k, self.tables
        # release, commit, evict, decode(lookahead=k), then the block tables of the batch
        alloc.launch(i)
        self.lane_buf.copy_(self.lane_host_bufs[i], non_blocking=True)
        pos, valid, first = (self.lane_buf[f] for f in (POS, VALID, FIRST))
        serial, gen = self.lane_buf[SERIAL], self.lane_buf[GEN]
        ok = valid != 0
        j = self.arange_q[None, :]  # [1, 1 + k]
        out_lane = first[:, None] + j  # this round's allocator lanes, position C + j
        full_new = torch.where(ok[:, None], alloc.state.out_full_buf[out_lane].long(), 0)
        swa_new = torch.where(ok[:, None], alloc.state.out_swa_buf[out_lane].long(), 0)
        q_pos = pos[:, None] + j  # [B, 1 + k]: positions C .. C + k
        ctx, ps = alloc.config.max_context_len, alloc.config.page_size
        tab = self.lane_buf[TAB]  # model lane b reads table lane tab[b]
        full_bt = t.full_block_table_buf.index_select(0, tab)
        swa_bt = t.swa_block_table_buf.index_select(0, tab)
        # draft: k + 1 one-token steps (the last only writes the draft's K/V of C + k)
        tok, proposals = self.tokens_buf, []
        for s in range(k + 1):
            qs = q_pos[:, s:s + 1]
            keys = table_key_table(self.draft, full_bt, swa_bt, ps, qs, ctx)
            logits = self.draft.forward(tok[:, None], qs, keys, full_new[:, s:s + 1],
                                        swa_new[:, s:s + 1], self.draft_kv)[:, 0]
            tok = torch.argmax(logits, dim=-1)
            if s < k:
                proposals.append(tok)
        drafts = (torch.stack(proposals, 1) if proposals
                  else self.tokens_buf.new_zeros(self.max_batch, 0))  # [B, k]: d_1 .. d_k
        # verify: the target on [x, d_1 .. d_k] at [C, C + k], one forward
        inputs = torch.cat([self.tokens_buf[:, None], drafts], 1)
        keys = table_key_table(self.target, full_bt, swa_bt, ps, q_pos, ctx)
        logits = self.target.forward(inputs, q_pos, keys, full_new, swa_new, self.kv)
        y = torch.argmax(logits, dim=-1)  # [B, 1 + k]
        # greedy acceptance: the longest prefix with d_{j+1} == y_j, plus the bonus y_n
        n = (drafts == y[:, :k]).long().cumprod(1).sum(1)  # [B], 0 .. k
        self.tokens_buf.copy_(torch.gather(y, 1, n[:, None])[:, 0])
        accepted = j <= n[:, None]  # [B, 1 + k]
        col = torch.where(accepted, gen[:, None] + j, self.hist_width - 1)
        self.history_buf[serial[:, None], col] = y
        if self.logits_buf is not None:
            self.logits_buf[serial[:, None], col] = logits
        if self.poison:
            rejected = ok[:, None] & ~accepted
            for kv in (self.kv, self.draft_kv):
                _poison(kv, full_new, swa_new, rejected)
        self.counts_buf.copy_(torch.where(ok, n + 1, 0))

    def capture(self) -> None:
        """Warm up and capture one graph per descriptor buffer. Call before any request."""
        alloc = self.alloc

        def empty_round() -> None:  # every lane padded
            p = alloc.plan()
            self._fill_lanes(p.buffer_index, [], [], None)
            self._body(p.buffer_index)
            alloc.mark_submitted(p)
        self.graphs.extend(capture_step_graphs(alloc, self._body, empty_round))

    def describe(self) -> dict | None:
        """Node counts of the first round graph (``timing.graph_nodes``); None before
        capture."""
        return graph_nodes(self.graphs[0]) if self.graphs else None

    # ---- host side ----------------------------------------------------------------------
    def _fill_lanes(self, i: int, lanes: list[int], reqs: list, first_lane) -> None:
        """Lane inputs of one round into pinned buffer ``i`` (host memory only)."""
        t = self.lane_np[i]
        t[:] = 0
        t[SERIAL] = self.n_serials  # padded lanes record into the scratch row
        for m, (b, st) in enumerate(zip(lanes, reqs, strict=True)):
            t[ROW, b], t[POS, b], t[VALID, b] = st["row"], st["pos"], 1
            t[FIRST, b], t[SERIAL, b], t[GEN, b] = first_lane[m], st["serial"], st["n_gen"]
            t[TAB, b] = m  # the round's m-th decode row: lane m of its tables

    def _read_counts(self) -> np.ndarray:
        """THE one host/device synchronisation of a round: the accepted counts, copied into
        pinned memory (non-blocking) and waited for on an event. Returns the host view."""
        if self.read_event is None:  # CPU: the body ran synchronously
            return self.counts_np
        self.counts_host_buf.copy_(self.counts_buf, non_blocking=True)
        self.read_event.record()
        with sync_allowed():
            self.read_event.synchronize()  # sync ok: the round's one documented read
        return self.counts_np

    def _admit(self, new: list[tuple[int, Request]], state: dict) -> None:
        """Prefill ``(lane, request)`` pairs eagerly, as few allocator steps as the frozen
        step size allows."""
        cap = self.alloc.config.max_step_tokens
        chunk: list = []
        for lane, req in new:
            if chunk and sum(len(r.prompt) for _, r in chunk) + len(req.prompt) > cap:
                self._prefill(chunk, state)
                chunk = []
            chunk.append((lane, req))
        if chunk:
            self._prefill(chunk, state)

    def _prefill(self, new: list[tuple[int, Request]], state: dict) -> None:
        """One allocator step for the prompts (its batch: the prompts, lane m = prompt m,
        whose block tables the step writes); per prompt one target forward (its last
        logits give the first token) and one draft forward (its K/V only), same slots,
        both reading K/V through lane m's block-table rows."""
        alloc, t, ps = self.alloc, self.tables, self.alloc.config.page_size
        rows = [alloc.admit() for _ in new]
        p = alloc.plan(extend=(rows, [len(r.prompt) for _, r in new]))
        res = alloc.run(p)
        self.prefill_pages["full"] += p.pages_allocated["full"]
        self.prefill_pages["swa"] += p.pages_allocated["swa"]
        for m, ((lane, req), row) in enumerate(zip(new, rows, strict=True)):
            n = len(req.prompt)
            full, swa = res.slots_of(m)
            full, swa = full[None].long(), swa[None].long()
            q_pos = self.arange_ctx[:n][None]
            keys = table_key_table(self.target, t.full_block_table_buf[m:m + 1],
                                   t.swa_block_table_buf[m:m + 1], ps, q_pos, n)
            ids = self.prompts_dev[req.serial:req.serial + 1, :n]
            logits = self.target.forward(ids, q_pos, keys, full, swa, self.kv)[0, -1]
            self.draft.forward(ids, q_pos, keys, full, swa, self.draft_kv)  # its K/V only
            nxt = torch.argmax(logits)
            self.tokens_buf[lane] = nxt
            self.history_buf[req.serial, 0] = nxt
            if self.logits_buf is not None:
                self.logits_buf[req.serial, 0] = logits
            state[lane] = {"row": row, "pos": n, "serial": req.serial, "n_gen": 1,
                           "n_out": req.n_out, "n_kept": None}

    def _pages_ok(self, prompts: list[int], n_active: int) -> bool:
        """Whether both pools hold the new prompts and one round of every active row."""
        ps, st = self.alloc.config.page_size, self.alloc.stats()
        per_round = -(-(1 + self.k) // ps) + 1
        need = sum(-(-n // ps) + 1 for n in prompts) + (n_active + len(prompts)) * per_round
        return need <= min(st["full_free_pages"], st["swa_free_pages"])

    def run(self, requests: list[Request], *, audit_every: int = 0, progress=None,
            sync_debug: bool = False) -> SpecResult:
        """Serve every request to its output length; the history is read once at the end.

        ``audit_every`` > 0: ``alloc.audit()`` every that many rounds (a device read on
        purpose, inside ``sync_allowed``), recorded. ``sync_debug``: run the loop under
        ``torch.cuda.set_sync_debug_mode("error")``: any host/device synchronisation other
        than the sanctioned ones (the round's read, the audits) raises (CUDA only).
        """
        max_prompt = max(len(r.prompt) for r in requests)
        prompts = np.zeros((self.n_serials, max_prompt), dtype=np.int64)
        for r in requests:
            prompts[r.serial, :len(r.prompt)] = r.prompt
        self.prompts_dev = torch.from_numpy(prompts).to(self.device)  # before the loop
        self.prefill_pages = {"full": 0, "swa": 0}
        debug = sync_debug and self.device.type == "cuda"
        if debug:
            old_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        t_start = time.perf_counter()
        try:
            out = self._loop(list(requests), audit_every, progress)
        finally:
            if debug:
                torch.cuda.set_sync_debug_mode(old_mode)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # sync ok: after the loop
        wall = time.perf_counter() - t_start
        hist = self.history_buf.cpu().numpy()  # the one read of the sampled tokens
        tokens = {r.serial: hist[r.serial, :r.n_out].tolist() for r in requests}
        logits = None
        if self.logits_buf is not None:
            lg = self.logits_buf.cpu().numpy()
            logits = {r.serial: lg[r.serial, :r.n_out] for r in requests}
        rounds, audits, host_us, wait_us, prefill_s = out
        return SpecResult(tokens, logits, rounds, audits, wall, prefill_s, host_us, wait_us,
                          dict(self.prefill_pages), self.describe())

    def _loop(self, queue: list[Request], audit_every: int, progress):
        alloc, B, k = self.alloc, self.max_batch, self.k
        state: dict[int, dict] = {}  # lane -> request state (host)
        to_release: list[int] = []
        rounds, audits, host_us, wait_us, prefill_s = [], [], [], [], 0.0
        while queue or state or to_release:
            # 1. finished requests free their lanes; their rows are released in this round
            for lane in [b for b, st in state.items() if st["n_gen"] >= st["n_out"]]:
                to_release.append(state.pop(lane)["row"])
            # 2. admit into free lanes while rows and pages allow (eager prefill)
            free_lanes = [b for b in range(B) if b not in state]
            n_new = min(len(free_lanes), len(queue), alloc.config.max_reqs - alloc.n_live)
            while n_new and not self._pages_ok([len(r.prompt) for r in queue[:n_new]],
                                               len(state)):
                n_new -= 1
            if n_new:
                t0 = time.perf_counter()
                self._admit(list(zip(free_lanes[:n_new], queue[:n_new], strict=True)), state)
                del queue[:n_new]
                prefill_s += time.perf_counter() - t0
            # 3. one round: ONE allocator step, draft, verify, acceptance
            lanes = sorted(state)
            reqs = [state[b] for b in lanes]
            rows = [st["row"] for st in reqs]
            spec = [st for st in reqs if st["n_kept"] is not None]
            accept = None
            if spec:  # last round's counts (a newly admitted row has no speculative step)
                n_kept = [min(st["n_kept"] + self.commit_extra, 1 + k) for st in spec]
                accept = ([st["row"] for st in spec], [n - 1 for n in n_kept])  # drafts
            t0 = time.perf_counter()
            p = alloc.plan(release=to_release, accept=accept, evict=rows,
                           decode=rows, lookahead=k if rows else None)
            if rows and self.commit_extra == 0:  # the allocator's lengths are the host's
                lens = p.tables.seq_lens_host  # the step's tables: lane m, L = C + 1 + k
                for m, st in enumerate(reqs):
                    if (alloc.committed_len(st["row"]) != st["pos"]
                            or alloc.seq_len(st["row"]) != st["pos"] + 1 + k
                            or int(lens[m]) != st["pos"] + 1 + k):
                        raise RuntimeError(f"row {st['row']}: allocator C/L "
                                           f"{alloc.committed_len(st['row'])}/"
                                           f"{alloc.seq_len(st['row'])}, table L "
                                           f"{int(lens[m])}, host C {st['pos']}")
            self._fill_lanes(p.buffer_index, lanes, reqs,
                             p.result.first_lane if rows else None)
            if self.graphs:
                self.graphs[p.buffer_index].replay()
            else:
                self._body(p.buffer_index)
            alloc.mark_submitted(p)
            t1 = time.perf_counter()
            counts = self._read_counts()[lanes] if rows else np.zeros(0, dtype=np.int64)
            t2 = time.perf_counter()
            host_us.append((t1 - t0) * 1e6)
            wait_us.append((t2 - t1) * 1e6)
            st_now = alloc.stats()
            rounds.append({
                "lanes": len(rows), "released": len(to_release), "committed_rows": len(spec),
                "accepted": counts.tolist(),
                "swa_pages_evicted": p.pages_evicted,
                "pages_freed": dict(p.pages_freed), "pages_allocated": dict(p.pages_allocated),
                "full_used_pages": st_now["full_used_pages"],
                "swa_used_pages": st_now["swa_used_pages"],
                "live_requests": st_now["live_requests"],
            })
            to_release = []
            for st, n_acc in zip(reqs, counts.tolist(), strict=True):
                if not 1 <= n_acc <= 1 + k:
                    raise RuntimeError(f"row {st['row']}: {n_acc} tokens accepted of 1 + {k}")
                st["pos"] += n_acc
                st["n_gen"] += n_acc
                st["n_kept"] = n_acc
            if audit_every and len(rounds) % audit_every == 0:
                audits.append({"round": len(rounds), "live_requests": st_now["live_requests"],
                               "findings": [str(f) for f in alloc.audit()]})
            if progress is not None:
                progress.update(1)
        return rounds, audits, host_us, wait_us, prefill_s


def _poison(kv: PagedKV, full_slot, swa_slot, bad) -> None:
    """Overwrite the K/V at the slots of ``bad`` lanes (``[B, Q]`` masks over ``[B, Q]``
    slots) with :data:`POISON`, every layer; other lanes write their own values back (the
    padded lanes' sink slot 0 included: the same value, whichever write lands)."""
    flat = bad.reshape(-1)[None, :, None, None]
    for cache, slot in ((kv.full_k, full_slot), (kv.full_v, full_slot),
                        (kv.swa_k, swa_slot), (kv.swa_v, swa_slot)):
        s = slot.reshape(-1)
        cache[:, s] = torch.where(flat, POISON, cache[:, s])


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run examples/model_loops/speculative_decode.py"
            " instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
