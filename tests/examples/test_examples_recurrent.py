"""``examples/model_loops/recurrent_model.py`` against transformers' ``BambaForCausalLM``, on
the CPU.

Every check compares greedy tokens with the reference's ``generate(do_sample=False)`` on
the request's full prompt (never stored outputs), in float32:

* continuous batching: requests arrive and finish at different steps, prompts are
  prefilled in ragged chunks beside padded lanes, lanes, state slots and K/V slots are
  reused (a reused state slot holds a finished request's state); rows of the state that
  no lane names are left untouched;
* prefix reuse: B's state is restored (``copy_states``) from a snapshot of A's state
  taken at the prefix boundary, and B reads the prefix's K/V through A's K/V slots;
* speculative rollback: k + 1 tokens verified into k + 1 slots, j accepted, decoding goes
  on from slot j (renamed as the request's slot, or copied back into it);
* negative controls (the checks can fail): a snapshot one token too early, or the state
  one token too early after verification, changes the tokens;
* the step is shape-static: it runs on the meta device, where ``.item()``, ``nonzero``
  or boolean-mask indexing would raise.

Tolerance: tokens must be equal; logits agree to < 1e-4 (the reference's prefill sums the
SSM in chunks, ours token by token).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "model_loops"))

from recurrent_model import (  # noqa: E402
    RecurrentConfig,
    RecurrentState,
    TinyRecurrentLM,
    copy_states,
    paged_kv,
    random_weights,
    to_transformers,
)

pytest.importorskip("transformers")

CFG = RecurrentConfig()
N_KEYS = 48           # req_to_token columns: longest prompt + output
N_KV_SLOTS = 512      # K/V pool, slot 0 the sink
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=0)


@pytest.fixture(scope="module")
def reference(weights):
    """``greedy(prompt, n)``: the reference's n greedy tokens and their logits ``[n, vocab]``."""
    model = to_transformers(CFG, weights)

    @functools.cache
    def greedy(prompt: tuple[int, ...], n_new: int):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)

    return greedy


def prompt_of(seed: int, n_tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, CFG.vocab_size, (n_tokens,), generator=g).tolist()


class Pools:
    """What the allocator will own, done by hand: K/V slots handed out shuffled (so a request's
    positions are scattered and reused slots hold stale K/V), ``req_to_token`` rows (row 0 all
    zeros, for padded lanes) and state slots ``[1, n_state_slots]``, reused last-freed first."""

    def __init__(self, n_state_slots: int, n_rows: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.kv_free = (torch.randperm(N_KV_SLOTS - 1, generator=g) + 1).tolist()
        self.req_to_token = torch.zeros(n_rows, N_KEYS, dtype=torch.int64)
        self.rows_free = list(range(n_rows - 1, 0, -1))
        self.state_free = list(range(n_state_slots, 0, -1))

    def admit(self, n_positions: int, shared: torch.Tensor | None = None) -> tuple[int, int]:
        """A row whose first ``len(shared)`` positions use the K/V slots ``shared`` and the rest
        fresh ones, and a state slot: ``(row, state_slot)``."""
        row = self.rows_free.pop()
        n_shared = 0 if shared is None else len(shared)
        if shared is not None:
            self.req_to_token[row, :n_shared] = shared
        fresh = [self.kv_free.pop() for _ in range(n_positions - n_shared)]
        self.req_to_token[row, n_shared:n_positions] = torch.tensor(fresh, dtype=torch.int64)
        return row, self.state_free.pop()

    def release(self, row: int, state_slot: int, n_shared: int = 0) -> None:
        owned = self.req_to_token[row, n_shared:]
        self.kv_free += owned[owned != 0].tolist()
        self.req_to_token[row] = 0
        self.rows_free.append(row)
        self.state_free.append(state_slot)


def lanes(values, n_lanes: int, pad: int = 0) -> torch.Tensor:
    return torch.tensor(list(values) + [pad] * (n_lanes - len(values)), dtype=torch.int64)


# ---- continuous batching -------------------------------------------------------------------

# (prompt length, output length, arrival step)
REQUESTS = [(1, 6, 0), (13, 9, 0), (5, 4, 1), (20, 11, 2), (3, 5, 4), (9, 7, 6), (2, 8, 6)]
MAX_LANES, CHUNK_TOKENS, N_STATE_SLOTS = 3, 6, 4


def test_continuous_batching_matches_transformers(weights, reference):
    """Each step: one batched prefill call (one chunk of up to CHUNK_TOKENS per prefilling
    request, padded lanes at slot 0), then one batched decode call over MAX_LANES lanes."""
    model = TinyRecurrentLM(CFG, weights, "cpu")
    state, kv = RecurrentState.zeros(CFG, N_STATE_SLOTS, "cpu"), paged_kv(CFG, N_KV_SLOTS, "cpu")
    pools = Pools(N_STATE_SLOTS)
    prompts = [prompt_of(i, n) for i, (n, _, _) in enumerate(REQUESTS)]
    out = {i: [] for i in range(len(REQUESTS))}
    logit_diff, active, slots_used = 0.0, {}, []  # active: request -> [row, slot, n_prefilled]
    waiting = list(range(len(REQUESTS)))
    for step in range(200):
        for i in [i for i in waiting if REQUESTS[i][2] <= step]:
            if len(active) < MAX_LANES:
                waiting.remove(i)
                active[i] = [*pools.admit(len(prompts[i]) + REQUESTS[i][1]), 0]
                slots_used.append(active[i][1])
        prefilling = [i for i, (_, _, done) in active.items() if done < len(prompts[i])]
        if prefilling:
            chunks = [prompts[i][active[i][2]:active[i][2] + CHUNK_TOKENS] for i in prefilling]
            tokens = torch.zeros(MAX_LANES, CHUNK_TOKENS, dtype=torch.int64)
            for b, chunk in enumerate(chunks):
                tokens[b, :len(chunk)] = torch.tensor(chunk)
            n_tokens = lanes([len(c) for c in chunks], MAX_LANES)
            logits = model.prefill(
                tokens, lanes([active[i][2] for i in prefilling], MAX_LANES), n_tokens,
                lanes([active[i][1] for i in prefilling], MAX_LANES),
                pools.req_to_token[lanes([active[i][0] for i in prefilling], MAX_LANES)],
                kv, state)
            for b, i in enumerate(prefilling):
                active[i][2] += len(chunks[b])
                if active[i][2] == len(prompts[i]):  # prompt done: its first output token
                    last = logits[b, len(chunks[b]) - 1]
                    out[i].append(int(last.argmax()))
                    logit_diff = max(logit_diff, _diff(reference, prompts[i], i, 0, last))
        decoding = [i for i, (_, _, done) in active.items()
                    if done == len(prompts[i]) and 0 < len(out[i]) < REQUESTS[i][1]
                    and i not in prefilling]
        if decoding:
            slots = lanes([active[i][1] for i in decoding], MAX_LANES)
            before = state.ssm.clone(), state.conv.clone()
            logits = model.decode(
                lanes([out[i][-1] for i in decoding], MAX_LANES),
                lanes([len(prompts[i]) + len(out[i]) - 1 for i in decoding], MAX_LANES), slots,
                pools.req_to_token[lanes([active[i][0] for i in decoding], MAX_LANES)], kv, state)
            untouched = torch.ones(N_STATE_SLOTS + 1, dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(state.ssm[:, untouched], before[0][:, untouched])
            assert torch.equal(state.conv[:, untouched], before[1][:, untouched])
            for b, i in enumerate(decoding):
                out[i].append(int(logits[b].argmax()))
                logit_diff = max(logit_diff, _diff(reference, prompts[i], i, len(out[i]) - 1,
                                                   logits[b]))
        for i in [i for i in active if len(out[i]) == REQUESTS[i][1]]:
            row, slot, _ = active.pop(i)
            pools.release(row, slot)
        if not active and not waiting:
            break
    assert not active and not waiting
    assert len(slots_used) > len(set(slots_used))  # state slots were reused
    for i, (_, n_out, _) in enumerate(REQUESTS):
        assert out[i] == reference(tuple(prompts[i]), n_out)[0], f"request {i}"
    assert logit_diff < LOGIT_TOL


def _diff(reference, prompt, i, k, logits) -> float:
    ref_logits = reference(tuple(prompt), REQUESTS[i][1])[1]
    return float((ref_logits[k] - logits).abs().max())


# ---- prefix reuse ------------------------------------------------------------------------

PREFIX, SUFFIX_A, SUFFIX_B, N_OUT = 11, 5, 4, 8


def _generate(model, kv, state, pools, row, slot, prompt_tail, start_pos, n_out):
    """Prefill ``prompt_tail`` from ``start_pos`` into one lane, then decode greedily."""
    logits = model.prefill(torch.tensor([prompt_tail]), torch.tensor([start_pos]),
                           torch.tensor([len(prompt_tail)]), torch.tensor([slot]),
                           pools.req_to_token[[row]], kv, state)
    toks = [int(logits[0, -1].argmax())]
    for k in range(n_out - 1):
        pos = start_pos + len(prompt_tail) + k
        logits = model.decode(torch.tensor([toks[-1]]), torch.tensor([pos]), torch.tensor([slot]),
                              pools.req_to_token[[row]], kv, state)
        toks.append(int(logits[0].argmax()))
    return toks


def run_prefix_reuse(weights, snapshot_pos: int) -> tuple[list[int], list[int], list[int]]:
    """A prefills its prefix in two chunks, ``[0, snapshot_pos)`` and ``[snapshot_pos, PREFIX)``;
    its state is snapshotted (``copy_states``) into a cache slot after the first. B, on a slot
    a finished request left dirty, restores the snapshot and prefills only from PREFIX, reading
    the prefix's K/V through A's slots. ``snapshot_pos == PREFIX``: the right snapshot."""
    model = TinyRecurrentLM(CFG, weights, "cpu")
    state, kv = RecurrentState.zeros(CFG, 4, "cpu"), paged_kv(CFG, N_KV_SLOTS, "cpu")
    pools = Pools(n_state_slots=4, seed=1)
    prefix = prompt_of(50, PREFIX)
    prompt_a, prompt_b = prefix + prompt_of(51, SUFFIX_A), prefix + prompt_of(52, SUFFIX_B)
    done = [pools.admit(7) for _ in range(2)]  # two finished requests leave the slots A and
    for seed, (row_x, slot_x) in enumerate(done):  # B will get dirty
        _generate(model, kv, state, pools, row_x, slot_x, prompt_of(53 + seed, 6), 0, 2)
    for row_x, slot_x in done:
        pools.release(row_x, slot_x)
    cache_slot = pools.state_free.pop(0)  # never used before: a clean slot
    row_a, slot_a = pools.admit(len(prompt_a) + N_OUT)
    model.prefill(torch.tensor([prefix[:snapshot_pos]]), torch.tensor([0]),
                  torch.tensor([snapshot_pos]), torch.tensor([slot_a]), pools.req_to_token[[row_a]],
                  kv, state)
    copy_states(state, torch.tensor([slot_a]), torch.tensor([cache_slot]))
    out_a = _generate(model, kv, state, pools, row_a, slot_a, prompt_a[snapshot_pos:],
                      snapshot_pos, N_OUT)
    row_b, slot_b = pools.admit(len(prompt_b) + N_OUT, shared=pools.req_to_token[row_a, :PREFIX])
    assert {slot_a, slot_b} == {slot for _, slot in done}
    assert state.ssm[:, slot_b].abs().sum() > 0  # B's slot is dirty until the restore
    copy_states(state, torch.tensor([cache_slot]), torch.tensor([slot_b]))
    out_b = _generate(model, kv, state, pools, row_b, slot_b, prompt_b[PREFIX:], PREFIX, N_OUT)
    return out_a, out_b, prompt_b


def test_prefix_reuse_restores_the_snapshot(weights, reference):
    out_a, out_b, prompt_b = run_prefix_reuse(weights, snapshot_pos=PREFIX)
    prompt_a = prompt_of(50, PREFIX) + prompt_of(51, SUFFIX_A)
    assert out_a == reference(tuple(prompt_a), N_OUT)[0]
    assert out_b == reference(tuple(prompt_b), N_OUT)[0]


def test_prefix_reuse_with_a_stale_snapshot_differs(weights, reference):
    """Negative control: the snapshot one token before the prefix boundary (B then misses
    prefix token PREFIX - 1 in its recurrence; its K/V is still there) changes B's tokens,
    while A, which went on from its own slot, is unaffected."""
    out_a, out_b, prompt_b = run_prefix_reuse(weights, snapshot_pos=PREFIX - 1)
    prompt_a = prompt_of(50, PREFIX) + prompt_of(51, SUFFIX_A)
    assert out_a == reference(tuple(prompt_a), N_OUT)[0]
    assert out_b != reference(tuple(prompt_b), N_OUT)[0]


# ---- speculative rollback ------------------------------------------------------------------

K_DRAFT = 3
ACCEPT_PLAN = [[2, 0, 3, 1, 3, 0, 2, 3, 1, 3], [0, 3, 3, 1, 2, 0, 1, 3, 2, 2]]  # per lane
# reference tokens the plans consume: the prefill's, j + 1 a step, and the last drafts
N_REF = 1 + max(sum(j + 1 for j in plan) for plan in ACCEPT_PLAN) + K_DRAFT


def run_speculative(weights, reference, state_lag: int) -> tuple[list[list[int]], list]:
    """Two lanes, k = K_DRAFT drafts a step: the first ``ACCEPT_PLAN[b][step]`` drafts are the
    reference's tokens, the rest wrong. One ``prefill`` verifies [last token, drafts] and writes
    the state after each of the k + 1 tokens into k + 1 slots; with j drafts accepted the
    request goes on from the state after token j (``state_lag`` tokens earlier: the negative
    control). Lane 0 renames that slot as its own; lane 1 copies it back into its home slot."""
    model = TinyRecurrentLM(CFG, weights, "cpu")
    n_slots = 2 * (K_DRAFT + 2)
    state, kv = RecurrentState.zeros(CFG, n_slots, "cpu"), paged_kv(CFG, N_KV_SLOTS, "cpu")
    pools = Pools(n_state_slots=n_slots, seed=2)
    prompts = [prompt_of(60, 7), prompt_of(61, 12)]
    want = [reference(tuple(p), N_REF)[0] for p in prompts]
    rows, home, spare = [], [], []
    for p in prompts:
        row, slot = pools.admit(len(p) + N_REF)
        rows.append(row)
        home.append(slot)
        spare.append([pools.state_free.pop() for _ in range(K_DRAFT + 1)])
    r2t = pools.req_to_token[rows]
    n_max = max(map(len, prompts))
    tokens = torch.tensor([p + [0] * (n_max - len(p)) for p in prompts])
    logits = model.prefill(tokens, torch.zeros(2, dtype=torch.int64),
                           torch.tensor([len(p) for p in prompts]), torch.tensor(home), r2t, kv,
                           state)
    out = [[int(logits[b, len(p) - 1].argmax())] for b, p in enumerate(prompts)]
    accepted_seen = []
    for step in range(len(ACCEPT_PLAN[0])):
        verify = []
        for b in range(2):
            j_plan, n = ACCEPT_PLAN[b][step], len(out[b])
            drafts = [want[b][n + d] if d < j_plan else (want[b][n + d] + 1) % CFG.vocab_size
                      for d in range(K_DRAFT)]
            verify.append([out[b][-1], *drafts])
        pos = torch.tensor([len(p) + len(o) - 1 for p, o in zip(prompts, out, strict=True)])
        logits = model.prefill(torch.tensor(verify), pos, torch.full((2,), K_DRAFT + 1),
                               torch.tensor(home), r2t, kv, state, step_slots=torch.tensor(spare))
        target = logits.argmax(-1).tolist()
        accepted = []
        for b in range(2):
            j = 0
            while j < K_DRAFT and verify[b][j + 1] == target[b][j]:
                j += 1
            accepted.append(j)
            out[b] += verify[b][1:j + 1] + [target[b][j]]
            keep = spare[b][max(j - state_lag, 0)]
            if b == 0:   # rename: the kept slot becomes the request's, its old slot a spare
                spare[0][spare[0].index(keep)] = home[0]
                home[0] = keep
            else:        # copy back into the home slot
                copy_states(state, torch.tensor([keep]), torch.tensor([home[1]]))
        accepted_seen.append(accepted)
    return out, want, accepted_seen


def test_speculative_rollback_matches_plain_greedy(weights, reference):
    out, want, accepted = run_speculative(weights, reference, state_lag=0)
    # the drafts were judged as the reference judges them
    assert accepted == [list(a) for a in zip(*ACCEPT_PLAN, strict=True)]
    for b in range(2):
        assert len(out[b]) == 1 + sum(j + 1 for j in ACCEPT_PLAN[b])
        assert out[b] == want[b][:len(out[b])]


def test_speculative_rollback_with_a_stale_slot_differs(weights, reference):
    """Negative control: going on from the slot one token before the accepted one."""
    out, want, _ = run_speculative(weights, reference, state_lag=1)
    assert any(out[b] != want[b][:len(out[b])] for b in range(2))


# ---- interface properties --------------------------------------------------------------------

def test_copy_states_gathers_before_writing():
    state = RecurrentState.zeros(CFG, 3, "cpu")
    state.conv.normal_(generator=torch.Generator().manual_seed(0))
    state.ssm.normal_(generator=torch.Generator().manual_seed(1))
    conv, ssm = state.conv.clone(), state.ssm.clone()
    copy_states(state, torch.tensor([1, 2]), torch.tensor([2, 1]))  # a swap
    assert torch.equal(state.conv[:, [0, 2, 1, 3]], conv)
    assert torch.equal(state.ssm[:, [0, 2, 1, 3]], ssm)


def test_step_is_shape_static_on_meta(weights):
    """On the meta device any host read (``.item()``, ``.tolist()``) or data-dependent shape
    (``nonzero``, boolean-mask indexing) raises: prefill, verify and decode run there."""
    model = TinyRecurrentLM(CFG, weights, "meta")
    state, kv = RecurrentState.zeros(CFG, 4, "meta"), paged_kv(CFG, 64, "meta")
    ints = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device="meta")  # noqa: E731
    logits = model.prefill(ints(3, 5), ints(3), ints(3), ints(3), ints(3, 16), kv, state)
    assert logits.shape == (3, 5, CFG.vocab_size)
    logits = model.prefill(ints(3, 4), ints(3), ints(3), ints(3), ints(3, 16), kv, state,
                           step_slots=ints(3, 4))
    assert logits.shape == (3, 4, CFG.vocab_size)
    logits = model.decode(ints(3), ints(3), ints(3), ints(3, 16), kv, state)
    assert logits.shape == (3, CFG.vocab_size)
    copy_states(state, ints(2), ints(2))


def test_grouped_norm_matches_transformers_that_groups():
    """With several B/C groups the gated output is normalised per group (Mamba-2, mamba_ssm,
    transformers 5.24); transformers 5.17 normalised over the whole width, which is why the
    default config has one group. Where the installed transformers groups, a two-group
    model's greedy tokens equal its own."""
    import inspect

    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated

    if "group_size" not in inspect.signature(BambaRMSNormGated.__init__).parameters:
        pytest.skip("this transformers normalises the gated output over the whole width")
    cfg = RecurrentConfig(mamba_n_groups=2)
    w = random_weights(cfg, seed=3)
    hf = to_transformers(cfg, w)
    prompt, n_out = prompt_of(7, 12), 6
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=n_out,
                           do_sample=False)[0, len(prompt):].tolist()
    model = TinyRecurrentLM(cfg, w, "cpu")
    state, kv = RecurrentState.zeros(cfg, 1, "cpu"), paged_kv(cfg, N_KV_SLOTS, "cpu")
    r2t = torch.arange(1, N_KEYS + 1)[None, :]
    one, slot = torch.ones(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    logits = model.prefill(torch.tensor([prompt]), 0 * one, len(prompt) * one, slot, r2t, kv,
                           state)
    got = [int(logits[0, -1].argmax())]
    for t in range(n_out - 1):
        logits = model.decode(torch.tensor([got[-1]]), (len(prompt) + t) * one, slot, r2t, kv,
                              state)
        got.append(int(logits[0].argmax()))
    assert got == want
