"""A decode loop whose Mamba-2 state lives in graphalloc's state slots: ONE CUDA graph a step.

The model is ``recurrent_model.TinyRecurrentLM`` (Bamba: Mamba-2 mixers and full attention).
Its K/V lives in the allocator's FULL pages (position t of row r at slot ``req_to_token[r,
t]``); its recurrent state in a ``RecurrentState`` whose two tensors are registered with the
allocator, ``HybridAllocator(cfg, state_tensors=[(conv, 1), (ssm, 1)])`` (slot dimension 1,
``num_state_slots + 1`` slots, slot 0 the sink). The allocator hands every request a slot
(``alloc.req_to_state[r]``), copies a slot of each tensor inside its own step when a
prefix snapshot is taken (``prefix_cache.insert``) or restored (``admit(handle=)``), and gives
every token of a speculative step a slot (``alloc.spec_state[r, :1 + k]``). The model never
asks the host which slot: it gathers the slot ids from those device tables.

The graph of a step, captured once per descriptor buffer ``i`` (``len(alloc.ring)`` graphs,
one memory pool)::

    lane_buf <- lane_host_bufs[i]          this step's lanes (pinned, 5 x B int64: ROW, POS,
                                           VALID, SERIAL, GEN)
    alloc.launch(i)                        releases (their slots back); admits: a fresh slot
                                           each, and for a cache hit (admit_on) the K/V
                                           prefix and the snapshot's state COPIED into it;
      plain:        decode(rows)           one K/V slot per row; the state slot stays
      speculative:  commit(rows, n), decode(rows, lookahead=k)
                                           req_to_state[r] <- spec_state[r, n - 1] (the state
                                           after the last accepted token), the other slots of
                                           the last round back; 1 + k fresh slots into
                                           spec_state[r, :1 + k]
    plain:        logits = model.decode(tokens_buf at POS, state at req_to_state[ROW],
                                        K/V through req_to_token[ROW])   state advanced in place
    speculative:  d_1..d_k = draft_buf[SERIAL, GEN - 1 + j] (the caller's guesses of the
                             request's outputs, uploaded once: an earlier greedy pass of the
                             target, perturbed)
                  logits = model.prefill([x, d_1..d_k] at [C, C + k], state read at
                           req_to_state[ROW], the state after token j written to
                           spec_state[ROW, j])
                  n = longest prefix of drafts equal to the argmax; y_0..y_n kept;
                  counts_buf <- n + 1
    tokens_buf <- argmax (the next input); history_buf[SERIAL, GEN..] <- the tokens

Per step the host plans from host-side lengths only (``p = alloc.plan(...)``), fills
``lane_host_bufs[p.buffer_index]``, replays graph ``p.buffer_index`` and calls
``alloc.mark_submitted(p)``; the step's event also guards the lane buffer. A speculative
round then reads the accepted counts (``[B]`` int64, a pinned copy and an event wait inside
``sync_allowed()``): the host commits them in the next round's step. Plain decoding reads
nothing until the loop ends.

Ledger of a request's state (C committed tokens, P the cached prefix)::

    req_to_state[r]        the state after [0, C): read and advanced in place by a plain
                           step; only read by a verify
    spec_state[r, j]       during a round: the state after [0, C + j + 1), j <= k; the commit
                           keeps j = n - 1, the others go back unread -- a rejected draft leaves
                           the request's state exactly as if it never ran (its K/V past
                           C + n - 1 is causally masked and rewritten by the next round)
    handle_to_state[h]     the snapshot after [0, P), P page-aligned (the cache's entry end)

Admission. A step admits the requests that get a lane (``admit``, or ``admit_on`` for a
cache hit: the state copy runs inside the step's graph); after its replay each admitted
request's prompt is prefilled eagerly, in chunks of at most ``chunk_tokens``, each one
allocator step (``extend``) and one forward that reads and updates the request's slot; it
decodes from the next step. With a shared system prompt of S tokens the first request
carrying it also ends a chunk at ``P = floor(S / ps) * ps`` (vLLM's "align" mode) and then
calls ``prefix_cache.insert(row, prompt)``: a handle on ``[0, P)`` whose step copies the
request's state (committed length P) into a snapshot slot; later carriers wait for that
insert. Every later carrier gets ``m = prefix_cache.match(prompt)`` (``cached_tokens == P``,
ending at the snapshot) and is admitted with ``admit_on=([row], [m.handle], [P])`` in the
decode step: its ``req_to_token`` prefix copied (the K/V of ``[0, P)`` shared, not
recomputed) and the snapshot copied into its fresh slot (``PlannedStep.state_copies``); it
prefills only ``[P, len)``, starting from that state. A request admitted without a hit
starts at position 0, where the model zeroes its state itself.

Negative controls (``stale_state``): ``"restore"`` zeroes a sharer's slot after its admit, as
if the snapshot had not been restored (its recurrence misses the prefix; the K/V is still
there); ``"commit"`` makes each verify read the slot the request had BEFORE its round's
commit (gathered in the graph before ``alloc.launch(i)``): the state one round stale. Either
must change tokens.

Cost per step (B lanes, k lookahead, M Mamba and A attention layers, ``K = max_context_len``
keys gathered per lane): host -- one plan (numpy: the compiled planner does not plan state
slots yet), B lane writes, one replay, ``mark_submitted``; speculative: one ``[B]`` int64
read and its wait. Device -- the allocator's step (its rows; a plain decode step copies no
state, a round writes ``1 + k + 1`` table entries a row); per Mamba layer one gather of B
states and ``1 + k`` scan steps of ``O(B * heads * head_dim * d_state)`` with one scatter a
token (plain: one scatter); per attention layer ``O(B * (1 + k) * K * hidden)``; the drafts
one gather. State copies happen only at a snapshot's take or restore: one slot of each
registered tensor (``RecurrentConfig.state_bytes_per_slot``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch
from paged_decode import Request, capture_step_graphs
from recurrent_model import RecurrentState, TinyRecurrentLM, paged_kv

import graphalloc as ga
from graphalloc.diagnostics.sync_points import sync_allowed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from timing import graph_nodes  # noqa: E402

__all__ = ["RecurrentLoop", "LoopResult", "STALE_STATE", "chunk_ends", "state_slots_needed"]

# rows of the per-step lane input table [N_LANE_FIELDS, max_batch]
ROW, POS, VALID, SERIAL, GEN = range(5)
N_LANE_FIELDS = 5
STALE_STATE = ("restore", "commit")  # the negative controls


def state_slots_needed(max_reqs: int, lookahead: int, max_handles: int) -> int:
    """State slots that never run short: each request row its own slot and one speculative
    step's ``1 + k``, each handle its snapshot."""
    return max_reqs * (1 + (1 + lookahead if lookahead else 0)) + max_handles


def chunk_ends(start: int, end: int, chunk_tokens: int, align_at: int | None = None
               ) -> list[int]:
    """The end of every prefill chunk of ``[start, end)``: at most ``chunk_tokens`` tokens each
    (0: no limit), and one chunk ends at ``align_at`` when ``start < align_at < end`` (the
    cached prefix's page-aligned end; the chunks after it count from there).
    ``chunk_ends(0, 30, 8, 20) == [8, 16, 20, 28, 30]``."""
    pieces = ([(start, align_at), (align_at, end)]
              if align_at is not None and start < align_at < end else [(start, end)])
    out = []
    for a, b in pieces:
        size = chunk_tokens or b - a
        out += [*range(a + size, b, size), b]
    return out


@dataclasses.dataclass
class LoopResult:
    tokens: dict[int, list[int]]  # serial -> generated tokens
    logits: dict[int, np.ndarray] | None  # serial -> [n_out, vocab]
    steps: list[dict]  # per decode step / round, host-side numbers
    wall_s: float
    prefill_s: float
    host_step_us: list[float]  # plan + fill + replay + mark_submitted
    read_wait_us: list[float]  # speculative: copy issued -> counts on the host
    sharing: dict | None  # the shared prompt: what the cache served, the state copies
    graph_nodes: dict | None = None


class RecurrentLoop:
    """Serves ``requests`` with ``model``'s state in ``alloc``'s state slots (see the module
    docstring).

    Args:
        model: the hybrid (float32).
        alloc: a fresh :class:`graphalloc.HybridAllocator` (no live requests) with
            ``num_state_slots`` S > 0 and ``state_tensors=[(state.conv, 1), (state.ssm, 1)]``;
            ``prefix_cache=True`` for ``shared_prefix``; ``num_lookahead_tokens >= lookahead``.
        state: the model's :class:`RecurrentState` with S slots, the registered one.
        max_batch: lanes of the fixed-shape step.
        n_serials: requests over the whole run (rows of the history buffers).
        max_out: most tokens one request generates.
        lookahead: 0 -- plain decode steps (one token, the state advanced in its slot); k >= 1
            -- speculative rounds of ``1 + k`` tokens (the states in ``spec_state``), drafts
            from :meth:`run`'s ``drafts``.
        graph: capture each step into a CUDA graph (a CUDA allocator).
        shared_prefix: token ids of a system prompt served from ``alloc.prefix_cache``.
        chunk_tokens: most prompt tokens per prefill chunk (0: a whole prompt at once).
        stale_state: ``None``, or a negative control of :data:`STALE_STATE`.
        keep_logits: record the logits of every kept token (for comparison).
    """

    def __init__(self, model: TinyRecurrentLM, alloc: ga.HybridAllocator,
                 state: RecurrentState, *, max_batch: int, n_serials: int, max_out: int,
                 lookahead: int = 0, graph: bool = False, shared_prefix=None,
                 chunk_tokens: int = 0, stale_state: str | None = None,
                 keep_logits: bool = True):
        acfg, mcfg = alloc.config, model.cfg
        if alloc.n_live > 0:
            raise ValueError("RecurrentLoop needs a fresh allocator (no live requests)")
        if not acfg.has_states:
            raise ValueError("RecurrentLoop keeps the state in the allocator's slots: build "
                             "the config with num_state_slots > 0")
        registered = [t for t, _ in alloc.kernels.state_tensors]
        if not (any(t is state.conv for t in registered)
                and any(t is state.ssm for t in registered)):
            raise ValueError("the allocator must copy this state: build it with state_tensors="
                             "[(state.conv, 1), (state.ssm, 1)]")
        if graph and acfg.device.type != "cuda":
            raise ValueError("graph=True needs an allocator on a CUDA device")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {lookahead!r}")
        if lookahead and lookahead > acfg.num_lookahead_tokens:
            raise ValueError(f"lookahead = {lookahead} exceeds the allocator's "
                             f"num_lookahead_tokens {acfg.num_lookahead_tokens} (its state "
                             f"slots per speculative step, max_spec_tokens, are "
                             f"{acfg.max_spec_tokens})")
        if max_batch * (1 + lookahead) > acfg.max_step_tokens or max_batch > acfg.max_alloc_rows:
            raise ValueError(f"{max_batch} lanes of {1 + lookahead} tokens exceed the "
                             f"allocator's max_alloc_rows {acfg.max_alloc_rows} / "
                             f"max_step_tokens {acfg.max_step_tokens}")
        if shared_prefix is not None and alloc.prefix_cache is None:
            raise ValueError("shared_prefix needs an allocator built with prefix_cache=True")
        if stale_state not in (None, *STALE_STATE):
            raise ValueError(f"stale_state must be None or one of {STALE_STATE}, got "
                             f"{stale_state!r}")
        if stale_state == "commit" and not lookahead:
            raise ValueError("stale_state='commit' reads the pre-commit slot: it needs "
                             "speculative rounds (lookahead >= 1)")
        if stale_state == "restore" and shared_prefix is None:
            raise ValueError("stale_state='restore' skips a snapshot restore: it needs "
                             "shared_prefix")
        self.model, self.alloc, self.state = model, alloc, state
        self.max_batch, self.k, self.graph = max_batch, lookahead, graph
        self.chunk_tokens, self.stale_state = chunk_tokens, stale_state
        self.shared_prefix = (None if shared_prefix is None
                              else np.asarray(shared_prefix, dtype=np.int64))
        dev = self.device = acfg.device
        self.kv = paged_kv(mcfg, acfg.num_full_slots, dev)
        self.n_serials, self.max_out = n_serials, max_out
        # history columns: a round may overshoot n_out by k; the last is the rejects' scratch
        self.hist_width = max_out + lookahead + 2
        # *_buf(s): allocated once, updated in place only (a captured graph holds their addresses)
        self.tokens_buf = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.lane_buf = torch.zeros(N_LANE_FIELDS, max_batch, dtype=torch.int64, device=dev)
        self.counts_buf = torch.zeros(max_batch, dtype=torch.int64, device=dev)
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
        # the drafts: draft_buf[serial, t] guesses output t (row n_serials: padded lanes)
        self.draft_buf = torch.zeros(n_serials + 1, self.hist_width, dtype=torch.int64,
                                     device=dev)
        self.arange_ctx = torch.arange(acfg.max_context_len, device=dev)
        self.arange_q = torch.arange(1 + lookahead, device=dev)
        self.graphs: list = []
        self.sharing: dict | None = None
        # the shared prefix: in the cache; its first carrier admitted; its prefill done
        self._prefix_inserted = self._first_carrier_seen = self._first_carrier_done = False

    # ---- the step body (captured) -------------------------------------------------------
    def _body(self, i: int) -> None:
        alloc, model = self.alloc, self.model
        self.lane_buf.copy_(self.lane_host_bufs[i], non_blocking=True)
        rows, pos, valid = self.lane_buf[ROW], self.lane_buf[POS], self.lane_buf[VALID]
        serial, gen = self.lane_buf[SERIAL], self.lane_buf[GEN]
        ok = valid != 0
        pre_commit = self.stale_state == "commit"  # NEGATIVE CONTROL: the slot before it
        slot_before = alloc.req_to_state[rows].long() if pre_commit else None
        alloc.launch(i)
        slot_now = slot_before if pre_commit else alloc.req_to_state[rows].long()
        slot = torch.where(ok, slot_now, 0)
        r2t = torch.where(ok[:, None], alloc.req_to_token[rows].long(), 0)
        if not self.k:
            logits = model.decode(self.tokens_buf, pos, slot, r2t, self.kv, self.state)
            nxt = torch.argmax(logits, dim=-1)
            self.tokens_buf.copy_(nxt)
            self.history_buf[serial, gen] = nxt
            if self.logits_buf is not None:
                self.logits_buf[serial, gen] = logits
            return
        k, j = self.k, self.arange_q[None, :]
        drafts = self.draft_buf[serial[:, None], gen[:, None] + j[:, :k]]  # outputs gen..+k-1
        inputs = torch.cat([self.tokens_buf[:, None], drafts], 1)  # [B, 1 + k]
        spec = torch.where(ok[:, None], alloc.spec_state[rows, :1 + k].long(), 0)
        n_tok = torch.where(ok, 1 + k, 0)
        logits = model.prefill(inputs, pos, n_tok, slot, r2t, self.kv, self.state,
                               step_slots=spec)
        y = torch.argmax(logits, dim=-1)  # [B, 1 + k]: y_j the target's token after input j
        n = (inputs[:, 1:] == y[:, :k]).long().cumprod(1).sum(1)  # drafts accepted, 0..k
        self.tokens_buf.copy_(torch.gather(y, 1, n[:, None])[:, 0])
        accepted = (j <= n[:, None]) & ok[:, None]
        col = torch.where(accepted, gen[:, None] + j, self.hist_width - 1)
        self.history_buf[serial[:, None], col] = y
        if self.logits_buf is not None:
            self.logits_buf[serial[:, None], col] = logits
        self.counts_buf.copy_(torch.where(ok, n + 1, 0))

    def capture(self) -> None:
        """Warm up and capture one graph per descriptor buffer. Call before any request."""
        alloc = self.alloc

        def empty_step() -> None:  # every lane padded
            p = alloc.plan()
            self._fill_lanes(p.buffer_index, [], [])
            self._body(p.buffer_index)
            alloc.mark_submitted(p)
        self.graphs.extend(capture_step_graphs(alloc, self._body, empty_step))

    def describe(self) -> dict | None:
        """Node counts of the first step graph (``timing.graph_nodes``); None before capture."""
        return graph_nodes(self.graphs[0]) if self.graphs else None

    # ---- host side ----------------------------------------------------------------------
    def _fill_lanes(self, i: int, lanes: list[int], reqs: list) -> None:
        """Lane inputs of one step into pinned buffer ``i`` (host memory only)."""
        t = self.lane_np[i]
        t[:] = 0
        t[SERIAL] = self.n_serials  # padded lanes record into the scratch row
        for b, st in zip(lanes, reqs, strict=True):
            t[ROW, b], t[POS, b], t[VALID, b] = st["row"], st["pos"], 1
            t[SERIAL, b], t[GEN, b] = st["serial"], st["n_gen"]

    def _read_counts(self) -> np.ndarray:
        """A round's one host/device synchronisation: the accepted counts, copied into
        pinned memory (non-blocking) and waited for on an event. Returns the host view."""
        if self.read_event is None:  # CPU: the body ran synchronously
            return self.counts_np
        self.counts_host_buf.copy_(self.counts_buf, non_blocking=True)
        self.read_event.record()
        with sync_allowed():
            self.read_event.synchronize()  # sync ok: the round's one documented read
        return self.counts_np

    def _carries_prefix(self, req: Request) -> bool:
        pre = self.shared_prefix
        return (pre is not None and len(req.prompt) > len(pre)
                and bool((req.prompt[:len(pre)] == pre).all()))

    def _forward(self, row: int, serial: int, start: int, end: int) -> torch.Tensor:
        """Prompt tokens ``[start, end)`` of ``serial`` through the model at row ``row``
        (state read at ``req_to_state[row]``, zero at position 0, updated in place): the
        last token's logits. Device tensors only (slices of buffers made before the loop)."""
        a, alloc = self.arange_ctx, self.alloc
        logits = self.model.prefill(
            self.prompts_dev[serial:serial + 1, start:end], a[start:start + 1],
            a[end - start:end - start + 1], alloc.req_to_state[row:row + 1].long(),
            alloc.req_to_token[row:row + 1, :end].long(), self.kv, self.state)
        return logits[0, -1]

    def _admissions(self, queue: list[Request], free_lanes: list[int]) -> list[dict]:
        """Take the requests this step admits off the front of ``queue``: a lane, a row (and
        a cache hit: its handle and cached tokens) each, while lanes and rows last. Host
        only. Until the first carrier of the shared prefix has inserted it, later carriers
        wait (they would miss the cache)."""
        alloc, picks, rows = self.alloc, [], []
        n_max = min(len(free_lanes), alloc.config.max_reqs - alloc.n_live)
        while queue and len(picks) < n_max:
            req = queue[0]
            carries = self._carries_prefix(req)
            first = carries and not self._first_carrier_seen
            if carries and not first and not self._first_carrier_done:
                break  # the prefix is being prefilled: wait for its insert
            match = None
            if carries and self._prefix_inserted:
                match = alloc.prefix_cache.match(req.prompt)
                if match.cached_tokens >= len(req.prompt):
                    raise RuntimeError(f"request {req.serial}: {match.cached_tokens} cached "
                                       f"tokens of a {len(req.prompt)}-token prompt")
                if not match.cached_tokens:
                    match = None
            self._first_carrier_seen |= first
            rows.append(alloc.free_row(rows))
            picks.append({"lane": free_lanes[len(picks)], "req": queue.pop(0), "row": rows[-1],
                          "match": match, "first": first})
        return picks

    def _admit_kinds(self, picks: list[dict]) -> dict:
        """The step keywords admitting ``picks``: ``admit`` rows, and ``admit_on`` rows on
        their cache hits (the K/V prefix and the state snapshot copied in the step)."""
        plain = [a["row"] for a in picks if a["match"] is None]
        hits = [a for a in picks if a["match"] is not None]
        return {"admit": plain or None,
                "admit_on": ([a["row"] for a in hits], [a["match"].handle for a in hits],
                             [a["match"].cached_tokens for a in hits]) if hits else None}

    def _record_restores(self, picks: list[dict], p) -> None:
        """The step's state copies are its admit_on rows' restores, in row order."""
        hits = [a for a in picks if a["match"] is not None]
        if not hits:
            return
        copies = (np.zeros((0, 2), dtype=np.int64) if p.state_copies is None
                  else np.asarray(p.state_copies, dtype=np.int64))
        for i, a in enumerate(hits):
            m = a["match"]
            self.sharing["restores"].append({
                "serial": a["req"].serial, "cached_tokens": m.cached_tokens,
                "handle": m.handle, "state_recompute_tokens": m.state_recompute_tokens,
                "slot": int(self.alloc.ledger.state_slot[a["row"]]),  # host: its new slot
                "state_copies": copies[i:i + 1].tolist(),
                "step_restores": len(hits), "step_state_copies": len(copies)})
            if self.stale_state == "restore":  # NEGATIVE CONTROL: the snapshot not restored
                slot = self.alloc.req_to_state[a["row"]:a["row"] + 1].long()
                for buf in (self.state.conv, self.state.ssm):
                    buf.index_fill_(1, slot, 0.0)

    def _prefill(self, adm: dict, lanes_state: dict) -> None:
        """Prefill an admitted request's prompt past its cached tokens, chunk by chunk (one
        allocator step and one forward a chunk); the first carrier of the shared prefix ends
        a chunk at its page-aligned end and inserts it into the cache there."""
        alloc, ps, sh = self.alloc, self.alloc.config.page_size, self.sharing
        req, row, lane = adm["req"], adm["row"], adm["lane"]
        n = len(req.prompt)
        cached = 0 if adm["match"] is None else adm["match"].cached_tokens
        align = len(self.shared_prefix) // ps * ps if adm["first"] else None
        start = cached
        for end in chunk_ends(cached, n, self.chunk_tokens, align):
            alloc.step(extend=([row], [end - start]))
            logits = self._forward(row, req.serial, start, end)
            if end == align:  # the prefix's page-aligned end: snapshot it (one step)
                sh["cached_prefix_tokens"] = alloc.prefix_cache.insert(row, self.shared_prefix)
                sh["snapshot_handles"] = alloc.live_handles().tolist()
                self._prefix_inserted = sh["cached_prefix_tokens"] > 0
            start = end
        if adm["first"]:
            self._first_carrier_done = True
        nxt = torch.argmax(logits)
        self.tokens_buf[lane] = nxt
        self.history_buf[req.serial, 0] = nxt
        if self.logits_buf is not None:
            self.logits_buf[req.serial, 0] = logits
        if sh is not None:
            sh["prefill_tokens_computed"] += n - cached
            if cached:
                sh["requests_sharing"] += 1
                sh["prefill_tokens_saved"] += cached
        lanes_state[lane] = {"row": row, "pos": n, "serial": req.serial, "n_gen": 1,
                             "n_out": req.n_out, "n_kept": None}

    def run(self, requests: list[Request], *, drafts: dict | None = None, progress=None,
            sync_debug: bool = False) -> LoopResult:
        """Serve every request to its output length; the history is read once at the end.
        ``drafts`` (speculative): ``{serial: tokens}``, the guess of each request's outputs
        (token t proposed for output t; missing ones are 0: a wrong guess costs only speed).
        ``sync_debug``: run the loop under ``torch.cuda.set_sync_debug_mode("error")`` (CUDA):
        any synchronisation but a round's sanctioned read raises."""
        max_prompt = max(len(r.prompt) for r in requests)
        prompts = np.zeros((self.n_serials, max_prompt), dtype=np.int64)
        for r in requests:
            prompts[r.serial, :len(r.prompt)] = r.prompt
        guess = np.zeros((self.n_serials + 1, self.hist_width), dtype=np.int64)
        for s, toks in (drafts or {}).items():
            toks = np.asarray(toks, dtype=np.int64)[:self.hist_width]
            guess[s, :len(toks)] = toks
        self.prompts_dev = torch.from_numpy(prompts).to(self.device)  # before the loop
        self.draft_buf.copy_(torch.from_numpy(guess))
        self._prefix_inserted = self._first_carrier_seen = self._first_carrier_done = False
        if self.shared_prefix is not None:
            self.sharing = {"prefix_tokens": len(self.shared_prefix), "cached_prefix_tokens": 0,
                            "requests_carrying": sum(self._carries_prefix(r) for r in requests),
                            "requests_sharing": 0, "prefill_tokens_saved": 0,
                            "prefill_tokens_computed": 0, "restores": [],
                            "snapshot_handles": []}
        debug = sync_debug and self.device.type == "cuda"
        if debug:
            torch.cuda.synchronize()  # sync ok: before the loop (the uploads above)
            old_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        t_start = time.perf_counter()
        try:
            steps, host_us, wait_us, prefill_s = self._loop(list(requests), progress)
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
        return LoopResult(tokens, logits, steps, wall, prefill_s, host_us, wait_us,
                          None if self.sharing is None else dict(self.sharing),
                          self.describe())

    def _loop(self, queue: list[Request], progress):
        alloc, B, k = self.alloc, self.max_batch, self.k
        lanes_state: dict[int, dict] = {}  # lane -> request state (host)
        to_release: list[int] = []
        steps, host_us, wait_us, prefill_s = [], [], [], 0.0
        while queue or lanes_state or to_release:
            # 1. finished requests free their lanes; their rows are released in this step
            for lane in [b for b, st in lanes_state.items() if st["n_gen"] >= st["n_out"]]:
                to_release.append(lanes_state.pop(lane)["row"])
            # 2. requests admitted in this step (rows, slots, cache hits: restores in-step)
            free_lanes = [b for b in range(B) if b not in lanes_state]
            picks = self._admissions(queue, free_lanes)
            # 3. one step: releases (+ commits) + decode allocation + model + argmax
            lanes = sorted(b for b, st in lanes_state.items() if st["n_gen"] < st["n_out"])
            reqs = [lanes_state[b] for b in lanes]
            rows = [st["row"] for st in reqs]
            t0 = time.perf_counter()
            if k:
                spec = [st for st in reqs if st["n_kept"] is not None]
                accept = ([st["row"] for st in spec], [st["n_kept"] - 1 for st in spec]
                          ) if spec else None  # the drafts accepted: kept - 1
                p = alloc.plan(release=to_release, accept=accept, decode=rows,
                               lookahead=k if rows else None, **self._admit_kinds(picks))
            else:
                spec = []
                p = alloc.plan(release=to_release, decode=rows, **self._admit_kinds(picks))
            self._fill_lanes(p.buffer_index, lanes, reqs)
            if self.graphs:
                self.graphs[p.buffer_index].replay()
            else:
                self._body(p.buffer_index)
            alloc.mark_submitted(p)
            t1 = time.perf_counter()
            counts = (self._read_counts()[lanes] if k and rows
                      else np.ones(len(rows), dtype=np.int64))
            t2 = time.perf_counter()
            host_us.append((t1 - t0) * 1e6)
            if k:
                wait_us.append((t2 - t1) * 1e6)
            self._record_restores(picks, p)
            steps.append({"lanes": len(rows), "released": len(to_release),
                          "admitted": len(picks),
                          "committed_rows": len(spec), "accepted": counts.tolist(),
                          "state_counts": p.state_counts,
                          "free_state_slots": alloc.n_free("state")})
            to_release = []
            for st, n_acc in zip(reqs, counts.tolist(), strict=True):
                if not 1 <= n_acc <= 1 + k:
                    raise RuntimeError(f"row {st['row']}: {n_acc} tokens kept of 1 + {k}")
                st["pos"] += n_acc
                st["n_gen"] += n_acc
                st["n_kept"] = n_acc if k else None
            # 4. the admitted requests' prefills (eager): they decode from the next step
            if picks:
                t0 = time.perf_counter()
                for adm in picks:
                    self._prefill(adm, lanes_state)
                prefill_s += time.perf_counter() - t0
            if progress is not None:
                progress.update(1)
        return steps, host_us, wait_us, prefill_s


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run examples/model_loops/recurrent_decode.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
