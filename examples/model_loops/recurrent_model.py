"""A tiny Mamba-2 + attention hybrid whose recurrent state lives in caller-owned slots.

The architecture is Bamba's (transformers ``BambaForCausalLM``): every layer is
``x + mixer(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``, the mixer a Mamba-2 block
(``"linear_attention"``) or full grouped-query attention with rotary on the first
half of each head (``"full_attention"``). Weights are random and held under the
transformers names; :func:`to_transformers` loads them into ``BambaForCausalLM``
with ``strict=True``, so the reference is code we did not write.

Why full attention: no Mamba-2 hybrid of transformers 5.24 has sliding-window
attention. Bamba, Jamba, FalconH1, Zamba2, Qwen3Next, Lfm2 and GraniteMoeHybrid
have no window at all; NemotronH's config carries a ``sliding_window`` its
modeling code never reads, and Zamba's attention docstring names a window its code
does not apply. Recurrence next to a window does exist in other families, none
Mamba-2: RecurrentGemma (RG-LRU), MiniMax (lightning attention), LaraMini (gated
DeltaNet), Zaya (CCA), Lfm3 and Inkling/Inkling2 (short convolutions).

Recurrent state (``RecurrentState``, allocated once, slot 0 the sink)::

    conv [n_mamba_layers, n_slots + 1, conv_dim, conv_kernel - 1]   last inputs of the conv
    ssm  [n_mamba_layers, n_slots + 1, n_heads, head_dim, d_state]  the SSM state h

(transformers' cache keeps ``conv_kernel`` conv inputs; the oldest never reaches the next
output, so ``conv_kernel - 1`` is the state, as in vLLM and SGLang.)

Per token, per head: ``dt = softplus(dt_raw + dt_bias)``, ``h = exp(dt * A) * h +
dt * x B^T``, ``y = h C + D x``; then ``y * silu(gate)`` RMS-normalised per group
(``n_groups`` groups of B/C, heads of a group share them). A step reads a lane's
state at ``state_slots[b]`` with ``index_select`` (a zero state where the lane starts
at position 0) and writes it back with ``index_copy_``: fixed shapes, no host sync.
Attention K/V is paged like ``hybrid_model.py`` (its ``PagedKV`` / ``KeyTable``; the
full-attention pool only): position ``t`` of lane ``b`` lives at K/V slot
``r2t_rows[b, t]``.

Exactness: float32. Our scan runs token by token; transformers' prefill runs the
chunked SSD form (``mamba_chunk_size``), its decode the same recurrence as ours. Sums
differ in order, so logits agree to about 1e-5 and tests require equal greedy tokens.
Cost of a step: per Mamba layer one gather and one scatter of ``B`` rows of state,
and ``Q`` sequential scan steps of ``O(B * n_heads * head_dim * d_state)``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from hybrid_model import FULL, KeyTable, PagedKV, _rms_norm, _rotate_half

__all__ = ["RecurrentConfig", "RecurrentState", "TinyRecurrentLM", "copy_states",
           "paged_kv", "random_weights", "to_transformers", "MAMBA", "ATTENTION"]

MAMBA, ATTENTION = "linear_attention", FULL  # transformers' names of Bamba's layer kinds


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Sizes of the tiny hybrid. ``layer_pattern`` repeats over the layers: ``m`` a
    Mamba-2 mixer, ``a`` full attention (``"ma"``: alternating)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    layer_pattern: str = "ma"
    num_heads: int = 4          # attention
    num_kv_heads: int = 2
    mamba_n_heads: int = 4
    # One group by default: with several, Mamba-2 normalises the gated output per group (as
    # transformers 5.24 and mamba_ssm do); transformers 5.17 normalised over the whole
    # width, so the comparison would depend on the installed version (it did on the GPU
    # machine). With one group every version computes the same thing.
    mamba_n_groups: int = 1
    mamba_d_state: int = 16
    mamba_conv_kernel: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 8   # transformers' prefill chunk (ours scans token by token)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 512

    def __post_init__(self) -> None:
        if set(self.layer_pattern) - {"m", "a"} or not self.layer_pattern:
            raise ValueError(f"layer_pattern must use 'm' and 'a', got {self.layer_pattern!r}")
        if set(self.layer_types) != {MAMBA, ATTENTION}:
            raise ValueError(f"a hybrid needs both layer kinds; {self.num_layers} layers of "
                             f"pattern {self.layer_pattern!r} give {sorted(set(self.layer_types))}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 4 (half rotary)")
        if self.mamba_intermediate % self.mamba_n_heads or self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError("mamba_expand * hidden_size % mamba_n_heads and mamba_n_heads % "
                             "mamba_n_groups must be 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Bamba rotates the first half of each head (``partial_rotary_factor = 0.5``)."""
        return self.head_dim // 2

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_head_dim(self) -> int:
        return self.mamba_intermediate // self.mamba_n_heads

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, then B and C of every group."""
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def layer_types(self) -> list[str]:
        pat = self.layer_pattern
        return [MAMBA if pat[i % len(pat)] == "m" else ATTENTION for i in range(self.num_layers)]

    @property
    def n_mamba_layers(self) -> int:
        return self.layer_types.count(MAMBA)

    @property
    def n_full_layers(self) -> int:
        return self.layer_types.count(ATTENTION)

    n_swa_layers = 0  # read by hybrid_model.PagedKV: this model has no window pool

    def state_bytes_per_slot(self, elt_bytes: int = 4) -> int:
        """One slot of :class:`RecurrentState` over all Mamba layers (conv + ssm)."""
        conv = self.conv_dim * (self.mamba_conv_kernel - 1)
        ssm = self.mamba_n_heads * self.mamba_head_dim * self.mamba_d_state
        return self.n_mamba_layers * (conv + ssm) * elt_bytes


def random_weights(cfg: RecurrentConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under the transformers Bamba names (CPU).

    Linear layers scaled like 1/sqrt(fan_in) so logits spread; ``dt`` lands in
    about [0.05, 0.5] and ``A`` in [-8, -1], so the state decays by 0.6 to 0.99 a token
    and carries many tokens back: a stale or wrong state slot changes the argmax.
    """
    g = torch.Generator().manual_seed(seed)
    h, H = cfg.hidden_size, cfg.mamba_n_heads
    hd, inter, K = cfg.head_dim, cfg.mamba_intermediate, cfg.mamba_conv_kernel

    def lin(n_out, n_in, gain=1.0):
        return torch.randn(n_out, n_in, generator=g) * (gain / math.sqrt(n_in))

    def uniform(n, lo, hi):
        return lo + (hi - lo) * torch.rand(n, generator=g)

    w = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
        if kind == MAMBA:
            m = p + "mamba."
            w[m + "in_proj.weight"] = lin(inter + cfg.conv_dim + H, h, 2.0)
            w[m + "conv1d.weight"] = torch.randn(cfg.conv_dim, 1, K, generator=g) / math.sqrt(K)
            w[m + "conv1d.bias"] = 0.1 * torch.randn(cfg.conv_dim, generator=g)
            dt = uniform(H, 0.05, 0.5)
            w[m + "dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus^-1
            w[m + "A_log"] = torch.log(uniform(H, 1.0, 8.0))
            w[m + "D"] = uniform(H, 0.5, 1.5)
            w[m + "norm.weight"] = 1.0 + 0.1 * torch.randn(inter, generator=g)
            w[m + "out_proj.weight"] = lin(h, inter)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = lin(cfg.num_heads * hd, h, 2.0)
            w[a + "k_proj.weight"] = lin(cfg.num_kv_heads * hd, h, 2.0)
            w[a + "v_proj.weight"] = lin(cfg.num_kv_heads * hd, h)
            w[a + "o_proj.weight"] = lin(h, cfg.num_heads * hd)
        w[p + "pre_ff_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
        w[p + "feed_forward.gate_proj.weight"] = lin(cfg.intermediate_size, h)
        w[p + "feed_forward.up_proj.weight"] = lin(cfg.intermediate_size, h)
        w[p + "feed_forward.down_proj.weight"] = lin(h, cfg.intermediate_size)
    w["model.final_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    w["lm_head.weight"] = lin(cfg.vocab_size, h, 2.0)
    return w


@dataclasses.dataclass
class RecurrentState:
    """Every request's Mamba state, one row per slot, allocated once (captured addresses).

    ``conv`` ``[n_mamba_layers, n_slots + 1, conv_dim, conv_kernel - 1]``: the last
    ``conv_kernel - 1`` conv inputs, oldest first. ``ssm`` ``[n_mamba_layers, n_slots + 1,
    n_heads, head_dim, d_state]``. Slot 0 is the sink padded lanes write to; it is never
    read for a live request. Slots are handed out by the caller (the allocator's state pool).
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def zeros(cls, cfg: RecurrentConfig, n_slots: int, device,
              dtype: torch.dtype = torch.float32) -> RecurrentState:
        """``n_slots`` usable slots ``[1, n_slots]`` plus the sink."""
        n, rows = cfg.n_mamba_layers, n_slots + 1
        conv = torch.zeros(n, rows, cfg.conv_dim, cfg.mamba_conv_kernel - 1, device=device,
                           dtype=dtype)
        ssm = torch.zeros(n, rows, cfg.mamba_n_heads, cfg.mamba_head_dim, cfg.mamba_d_state,
                          device=device, dtype=dtype)
        return cls(conv, ssm)


def copy_states(state: RecurrentState, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy the state of slot ``src_slots[i]`` into slot ``dst_slots[i]`` (int64 ``[n]``, same
    device), every layer: snapshot a request into a cache slot, or restore one into a new
    request's slot. All rows are gathered before any is written, so sources and
    destinations may overlap; destinations must be distinct (or 0, the sink)."""
    for buf in (state.conv, state.ssm):
        buf.index_copy_(1, dst_slots, buf.index_select(1, src_slots))


def paged_kv(cfg: RecurrentConfig, n_kv_slots: int, device) -> PagedKV:
    """``hybrid_model.PagedKV`` with the full-attention pool only: ``full_k`` / ``full_v``
    ``[n_full_layers, n_kv_slots, n_kv_heads, head_dim]`` (sink page included)."""
    return PagedKV(cfg, n_kv_slots, 0, device)


class TinyRecurrentLM:
    """The hybrid in plain torch: state through :class:`RecurrentState` slots, K/V through
    ``req_to_token`` rows. :meth:`prefill` and :meth:`decode` are fixed-shape for fixed input
    shapes and never synchronise (a decode step can be captured into a CUDA graph)."""

    def __init__(self, cfg: RecurrentConfig, weights: dict[str, torch.Tensor], device):
        self.cfg = cfg
        self.device = torch.device(device)
        self.w = {k: v.to(device=self.device, dtype=torch.float32) for k, v in weights.items()}
        rd = cfg.rotary_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2).float() / rd))
        freqs = torch.arange(cfg.max_position).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # computed on the CPU, like the reference
        self.cos, self.sin = emb.cos().to(self.device), emb.sin().to(self.device)
        self.kind_index = []  # index of each layer within its kind
        counts = {MAMBA: 0, ATTENTION: 0}
        for kind in cfg.layer_types:
            self.kind_index.append(counts[kind])
            counts[kind] += 1

    def decode(self, tokens, pos, state_slots, r2t_rows, kv: PagedKV,
               state: RecurrentState) -> torch.Tensor:
        """One token per lane: logits ``[B, vocab]`` for ``tokens`` ``[B]`` at positions
        ``pos`` ``[B]``; the state at ``state_slots`` ``[B]`` is advanced in place. A padded
        lane uses slot 0 and a ``r2t_rows`` row of zeros."""
        ones = torch.ones_like(pos)
        return self.prefill(tokens[:, None], pos, ones, state_slots, r2t_rows, kv, state)[:, 0]

    def prefill(self, tokens, start_pos, n_tokens, state_slots, r2t_rows, kv: PagedKV,
                state: RecurrentState, step_slots=None) -> torch.Tensor:
        """Run ``n_tokens[b]`` tokens of lane ``b`` (``tokens`` ``[B, Q]``, left-aligned, the rest
        padding) from position ``start_pos[b]``: logits ``[B, Q, vocab]`` (padding's are junk).

        State: read at ``state_slots`` ``[B]`` (int64), a zero state where ``start_pos == 0``;
        the state after the lane's last token is written back there. With ``step_slots``
        ``[B, Q]`` the state after token ``t`` goes to ``step_slots[b, t]`` instead (0: not kept;
        speculative verification) and ``state_slots`` is only read. A lane with
        ``n_tokens == 0`` must use slot 0.
        K/V: ``r2t_rows`` ``[B, n_keys]`` (the first ``n_keys`` columns of each lane's
        ``req_to_token`` row, ``n_keys > start_pos + n_tokens - 1``); token ``t`` writes its K/V
        at ``r2t_rows[b, start_pos[b] + t]`` (padding at slot 0) and attends to positions
        ``[0, start_pos[b] + t]``.
        """
        cfg, w = self.cfg, self.w
        B, Q = tokens.shape
        n_keys = r2t_rows.shape[1]
        t_range = torch.arange(Q, device=tokens.device)
        valid = t_range[None, :] < n_tokens[:, None]                            # [B, Q]
        q_pos = start_pos[:, None] + t_range[None, :]
        new_kv_slot = torch.where(valid, torch.gather(r2t_rows, 1, q_pos.clamp(max=n_keys - 1)), 0)
        k_pos = torch.arange(n_keys, device=tokens.device)
        full_mask = k_pos[None, None, :] <= q_pos[:, :, None]
        keys = KeyTable(r2t_rows, full_mask, r2t_rows[:, :0], full_mask[..., :0])
        rot_pos = q_pos.clamp(max=cfg.max_position - 1)
        rope = (self.cos[rot_pos][:, :, None, :], self.sin[rot_pos][:, :, None, :])
        fresh = start_pos == 0
        if step_slots is not None:
            step_slots = torch.where(valid, step_slots, 0)
        x = w["model.embed_tokens.weight"][tokens]
        for i, kind in enumerate(cfg.layer_types):
            p, j = f"model.layers.{i}.", self.kind_index[i]
            h = _rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            if kind == MAMBA:
                x = x + self._mamba(p + "mamba.", h, j, valid, fresh, state_slots, step_slots,
                                    state)
            else:
                x = x + self._attention(p + "self_attn.", h, j, rope, new_kv_slot, keys, kv)
            h = _rms_norm(x, w[p + "pre_ff_layernorm.weight"], cfg.rms_norm_eps)
            gate = F.linear(h, w[p + "feed_forward.gate_proj.weight"])
            up = F.linear(h, w[p + "feed_forward.up_proj.weight"])
            x = x + F.linear(F.silu(gate) * up, w[p + "feed_forward.down_proj.weight"])
        x = _rms_norm(x, w["model.final_layernorm.weight"], cfg.rms_norm_eps)
        return F.linear(x, w["lm_head.weight"])

    def _attention(self, p, h, j, rope, new_kv_slot, keys, kv: PagedKV):
        """Grouped-query attention, rotary on the first ``rotary_dim`` of each head."""
        cfg, w = self.cfg, self.w
        B, Q, _ = h.shape
        Hkv, hd, rd = cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
        q = F.linear(h, w[p + "q_proj.weight"]).view(B, Q, cfg.num_heads, hd)
        k = F.linear(h, w[p + "k_proj.weight"]).view(B, Q, Hkv, hd)
        v = F.linear(h, w[p + "v_proj.weight"]).view(B, Q, Hkv, hd)
        cos, sin = rope
        q = torch.cat((q[..., :rd] * cos + _rotate_half(q[..., :rd]) * sin, q[..., rd:]), -1)
        k = torch.cat((k[..., :rd] * cos + _rotate_half(k[..., :rd]) * sin, k[..., rd:]), -1)
        cache_k, cache_v = kv.full_k[j], kv.full_v[j]
        cache_k.index_copy_(0, new_kv_slot.reshape(-1), k.reshape(-1, Hkv, hd))
        cache_v.index_copy_(0, new_kv_slot.reshape(-1), v.reshape(-1, Hkv, hd))
        attn = keys.attend(FULL, q, cache_k, cache_v, Hkv)
        return F.linear(attn, w[p + "o_proj.weight"])

    def _mamba(self, p, h, j, valid, fresh, state_slots, step_slots, state: RecurrentState):
        """The Mamba-2 mixer over ``h`` ``[B, Q, hidden]``, scanned token by token; a token
        with ``valid`` false leaves its lane's state as it was."""
        cfg, w = self.cfg, self.w
        B, Q, _ = h.shape
        inter, H, P = cfg.mamba_intermediate, cfg.mamba_n_heads, cfg.mamba_head_dim
        G, N = cfg.mamba_n_groups, cfg.mamba_d_state
        gate, xbc, dt = F.linear(h, w[p + "in_proj.weight"]).split([inter, cfg.conv_dim, H], -1)
        dt = F.softplus(dt + w[p + "dt_bias"])                                   # [B, Q, H]
        A = -torch.exp(w[p + "A_log"])                                           # [H]
        D = w[p + "D"][None, :, None]
        conv_w, conv_b = w[p + "conv1d.weight"][:, 0, :], w[p + "conv1d.bias"]  # [conv_dim, K]
        conv = state.conv[j].index_select(0, state_slots)            # [B, conv_dim, K - 1]
        ssm = state.ssm[j].index_select(0, state_slots)              # [B, H, P, N]
        conv = torch.where(fresh[:, None, None], 0.0, conv)
        ssm = torch.where(fresh[:, None, None, None], 0.0, ssm)
        ys = []
        for t in range(Q):
            window = torch.cat((conv, xbc[:, t, :, None]), dim=-1)   # [B, conv_dim, K]
            u = F.silu((window * conv_w).sum(-1) + conv_b)
            x, b, c = u.split([inter, G * N, G * N], dim=-1)
            x = x.view(B, H, P)
            b = b.view(B, G, N).repeat_interleave(H // G, dim=1)      # head h: group h // (H/G)
            c = c.view(B, G, N).repeat_interleave(H // G, dim=1)
            dt_t = dt[:, t]                                           # [B, H]
            new_ssm = (ssm * torch.exp(dt_t * A)[:, :, None, None]
                       + (dt_t[:, :, None] * x)[..., None] * b[:, :, None, :])
            ys.append(((new_ssm * c[:, :, None, :]).sum(-1) + D * x).reshape(B, inter))
            ok = valid[:, t]
            conv = torch.where(ok[:, None, None], window[..., 1:], conv)
            ssm = torch.where(ok[:, None, None, None], new_ssm, ssm)
            if step_slots is not None:
                state.conv[j].index_copy_(0, step_slots[:, t], conv)
                state.ssm[j].index_copy_(0, step_slots[:, t], ssm)
        if step_slots is None:
            state.conv[j].index_copy_(0, state_slots, conv)
            state.ssm[j].index_copy_(0, state_slots, ssm)
        y = torch.stack(ys, dim=1) * F.silu(gate)                    # gated, then normalised
        y = y.view(B, Q, G, inter // G)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        y = w[p + "norm.weight"] * y.view(B, Q, inter)
        return F.linear(y, w[p + "out_proj.weight"])


def to_transformers(cfg: RecurrentConfig, weights: dict[str, torch.Tensor], *, device="cpu"):
    """The matching ``transformers`` ``BambaForCausalLM`` (float32, eager attention, no
    bos/eos/pad ids so that ``generate`` never stops early) with ``weights`` loaded strictly.
    ``time_step_limit`` is (0, inf): transformers clamps ``dt`` to it in its prefill but not
    in its decode, a no-op only at that limit. Checked with transformers 5.24 (its torch
    fallbacks: no mamba_ssm / causal_conv1d)."""
    from transformers import BambaConfig, BambaForCausalLM

    attn_layers = [i for i, kind in enumerate(cfg.layer_types) if kind == ATTENTION]
    hf_cfg = BambaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        attn_layer_indices=attn_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, mamba_n_heads=cfg.mamba_n_heads,
        mamba_n_groups=cfg.mamba_n_groups, mamba_d_state=cfg.mamba_d_state,
        mamba_d_conv=cfg.mamba_conv_kernel, mamba_expand=cfg.mamba_expand,
        mamba_chunk_size=cfg.mamba_chunk_size, mamba_conv_bias=True, mamba_proj_bias=False,
        time_step_limit=(0.0, float("inf")), rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False, mlp_bias=False, hidden_act="silu",
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    hf_cfg._attn_implementation = "eager"
    rotary = hf_cfg.rope_parameters.get("partial_rotary_factor")
    if list(hf_cfg.layers_block_type) != cfg.layer_types or rotary != 0.5:
        raise RuntimeError(f"transformers changed Bamba's layout: {hf_cfg.layers_block_type}, "
                           f"partial_rotary_factor {rotary}")
    model = BambaForCausalLM(hf_cfg).eval()
    model.load_state_dict(weights, strict=True)
    return model.to(device)


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run examples/model_loops/recurrent_decode.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
