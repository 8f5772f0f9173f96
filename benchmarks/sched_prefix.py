"""Prefix-caching workloads for the scheduler trace: token ids, and the hits they give.

:class:`PrefixModel` is the generator's (``sched_workload.generate``) view of a prefix
cache that never evicts. It draws every request's token ids, so that hits are real (equal
token prefixes), and decides each admission's hit: the longest prefix of whole pages
already computed by an earlier request, at most ``prompt - 1`` tokens (one token is left
to compute, as both engines do). The engines replaying the trace find their hits in their
own caches; with pools that never evict they must find exactly these.

Workloads (``WorkloadSpec.prefix``)::

    system-prompt   ``system_prompts`` shared prompts of ``system_prompt_tokens`` tokens;
                    each request picks one (uniformly) and appends its own user tokens
                    (the drawn prompt length); hit = the system prompt, page-floored
    multi-turn      conversations: turn 1 is a fresh prompt; when turn k finishes, turn
                    k + 1 arrives with prompt = turn k's prompt + its output + new user
                    tokens (log-normal, median prompt_median / 4), with probability
                    1 - 1 / turns_mean (and while prompt + output fit the context); hit =
                    turn k's tokens, page-floored. New conversations arrive at 1 /
                    turns_mean of the usual rate; a next turn joins the FRONT of the
                    queue, before new conversations, as SGLang's cache-aware LPM policy
                    (longest cached prefix first) would order it: FCFS behind the backlog
                    would push most later turns past the end of a trace

Token ids: content ids uniform in [0, VOCAB); every request (system-prompt) or
conversation (multi-turn) starts its own part with a unique marker id >= MARKER, so two
requests share exactly the intended prefixes and nothing else.

When pages count as computed (the rule both engines agree on)::

    prompt pages  whole pages of [hit, pre) after the step whose chunk computed them
                  (vLLM caches them at allocation, SGLang inserts them after the chunk)
    output pages  whole pages of [fill, L) when the request is released (SGLang inserts
                  them at cache_finished_req; vLLM hashed them as they filled, but no
                  other request can match into a running request's output here)

A waiting request whose first uncached page another request is still computing waits
(:meth:`PrefixModel.admit`, SGLang's in-batch prefix check, here also across the chunks
of a prefill still running), so no two requests ever compute the same page: the engines
then hold the same FULL pages in their caches, duplicates never arise.

SWA: a hit of h tokens needs the SWA pages of the window before h. In a system prompt
they are the prompt's own (both engines keep them); in multi-turn they are the last
window of the previous turn, which the finished request still held when
``window % page_size`` is 0 or 1 (true for every benchmark configuration): otherwise its
frontier can pass the page the next turn's window needs, which SGLang frees (a
request-owned decode page) while vLLM keeps it cached, and the two would hit differently.
:class:`WorkloadSpec` refuses multi-turn otherwise.

Keys are Python hashes chained over the pages' bytes (the generator's own; the engines
hash in their own ways). Cost: O(pages) hashing per request, once.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PrefixModel", "PREFIX_WORKLOADS", "VOCAB", "MARKER", "chain_keys"]

PREFIX_WORKLOADS = ("system-prompt", "multi-turn")
VOCAB = 32000
MARKER = 1 << 20  # marker ids: MARKER + request id (system-prompt) or conversation id


def chain_keys(tokens: np.ndarray, ps: int, keys: list, n_pages: int) -> list:
    """Extend ``keys`` (the chained keys of the first ``len(keys)`` pages of ``tokens``)
    to ``n_pages`` pages; returns ``keys``."""
    prev = keys[-1] if keys else 0
    for j in range(len(keys), n_pages):
        prev = hash((prev, tokens[j * ps:(j + 1) * ps].tobytes()))
        keys.append(prev)
    return keys


class PrefixModel:
    """Token ids of every request and the no-eviction cache that gives the hits.

    Owns: ``tokens[rid]`` (int32, the request's whole sequence: prompt + output, what its
    KV holds at release), ``cached`` (keys of computed whole pages; never shrinks),
    ``pending`` (keys of pages an admitted request will compute; each key at most once),
    ``base[rid]`` (the keys its first pages share with its system prompt, or its previous
    turn's id). Hits, prompt tokens and admissions are counted for the summary.
    """

    def __init__(self, spec):
        self.spec, self.ps = spec, spec.page_size
        self.kind = spec.prefix
        # a stream of its own: the length draws of the generator stay as they were
        self.rng = np.random.default_rng([spec.seed, 0x9E3779B9])
        self.tokens: list = []
        self.base: list = []  # per request: the keys its first pages share (list) or a rid
        self.system: list = []
        self.system_keys: list = []
        if self.kind == "system-prompt":
            for _ in range(spec.system_prompts):
                s = self.rng.integers(0, VOCAB, spec.system_prompt_tokens, dtype=np.int32)
                self.system.append(s)
                self.system_keys.append(chain_keys(s, self.ps, [], len(s) // self.ps))
        self.keys: dict = {}  # rid -> page keys (admitted requests, until released)
        self.cached: set = set()
        self.pending: set = set()
        self.n_conversations = 0
        self.turn: list = []
        self.admitted = self.prompt_tokens = self.hit_tokens = self.with_hit = 0
        self.deferrals = 0

    # ---- requests ------------------------------------------------------------------
    def prompt_len(self, drawn: int) -> int:
        """The prompt of a new request (system prompt + user part, or a first turn)."""
        if self.kind == "system-prompt":
            return self.spec.system_prompt_tokens + min(
                drawn, self.spec.max_prompt - self.spec.system_prompt_tokens)
        return drawn

    def add(self, rid: int, prompt: int, out: int, parent: int = -1) -> None:
        """Draw request ``rid``'s token ids (``prompt`` + ``out`` of them)."""
        assert rid == len(self.tokens)
        rng = self.rng
        if parent >= 0:  # a later turn: the whole conversation so far, then the new user
            prev = self.tokens[parent]
            new = rng.integers(0, VOCAB, prompt - len(prev) + out, dtype=np.int32)
            toks = np.concatenate([prev, new])
            self.turn.append(self.turn[parent] + 1)
            base = parent
        elif self.kind == "system-prompt":
            i = int(rng.integers(len(self.system)))
            s = self.system[i]
            own = rng.integers(0, VOCAB, prompt - len(s) + out, dtype=np.int32)
            own[0] = MARKER + rid
            toks = np.concatenate([s, own])
            self.turn.append(1)
            base = self.system_keys[i]
        else:  # a first turn
            toks = rng.integers(0, VOCAB, prompt + out, dtype=np.int32)
            toks[0] = MARKER + self.n_conversations
            self.n_conversations += 1
            self.turn.append(1)
            base = []
        self.tokens.append(toks)
        self.base.append(base)

    def follow_up(self, rid: int) -> tuple[int, int] | None:
        """Multi-turn: ``(prompt, out)`` of the turn after finished request ``rid``, or
        None when the conversation ends."""
        if self.kind != "multi-turn":
            return None
        spec, rng = self.spec, self.rng
        if rng.random() >= 1.0 - 1.0 / spec.turns_mean:
            return None
        user = max(1, int(round(np.exp(rng.normal(np.log(max(1, spec.prompt_median // 4)),
                                                 spec.sigma)))))
        out = max(1, int(round(np.exp(rng.normal(np.log(spec.output_median), spec.sigma)))))
        prompt = len(self.tokens[rid]) + user
        if prompt + min(out, spec.max_output) > spec.max_context_len:
            return None
        return prompt, min(out, spec.max_output)

    # ---- the cache ------------------------------------------------------------------
    def _keys(self, rid: int) -> list:
        keys = self.keys.get(rid)
        if keys is None:
            base = self.base[rid]
            if isinstance(base, list):
                keys = list(base)
            else:  # a later turn: its previous turn's keys, which nothing needs after this
                keys = self.keys.pop(base)
                self.base[rid] = []
            toks = self.tokens[rid]
            keys = self.keys[rid] = chain_keys(toks, self.ps, keys, len(toks) // self.ps)
        return keys

    def admit(self, rid: int, fill: int) -> int:
        """Hit tokens of request ``rid`` (``fill`` prompt tokens) admitted now, or -1 when
        it must wait (its first uncached page is being computed by another request). On
        admission its pages still to compute become pending."""
        keys = self._keys(rid)
        ps, cached = self.ps, self.cached
        n_prompt_pages = fill // ps
        j = 0
        while j < n_prompt_pages and keys[j] in cached:
            j += 1
        if j < n_prompt_pages and keys[j] in self.pending:
            self.deferrals += 1
            return -1
        hit = min(j, (fill - 1) // ps) * ps
        # (a prompt of cached whole pages would recompute its last one: not in these
        # workloads, whose every prompt ends in new tokens)
        self.pending.update(k for k in keys[hit // ps:n_prompt_pages] if k not in cached)
        self.admitted += 1
        self.prompt_tokens += fill
        self.hit_tokens += hit
        self.with_hit += hit > 0
        return hit

    def computed(self, rid: int, pre_old: int, pre_new: int) -> None:
        """A prefill chunk took ``rid`` from ``pre_old`` to ``pre_new`` computed tokens."""
        keys = self.keys[rid]
        for key in keys[pre_old // self.ps:pre_new // self.ps]:
            self.pending.discard(key)
            self.cached.add(key)

    def released(self, rid: int, fill: int, length: int, continued: bool) -> None:
        """``rid`` finished at ``length`` tokens: its output pages are cached. Its keys are
        kept for its next turn when ``continued`` (that turn takes them at admission)."""
        keys = self.keys[rid]
        self.cached.update(keys[fill // self.ps:length // self.ps])
        if not continued:
            del self.keys[rid]

    def summary(self) -> dict:
        """Hits over every admission of the trace (what a cache that never evicts gives)."""
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"workload": self.kind, "requests_admitted": self.admitted,
                "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
                "hit_rate": rate, "requests_with_hit": self.with_hit,
                "deferred_admissions": self.deferrals,
                "conversations": self.n_conversations or None,
                "cached_pages": len(self.cached)}


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
