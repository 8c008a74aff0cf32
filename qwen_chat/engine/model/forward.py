"""The model maths of the runner: the prefill forward of one (padded) prompt and one batched decode step,
over the slot state (``state.SlotState``).

Both are tensor ops only, so ``graphs.CudaGraphs`` can capture them.  Formulas: transformers
``models/qwen3_5/modeling_qwen3_5.py`` (Qwen3_5Attention, Qwen3_5GatedDeltaNet, Qwen3_5MLP,
Qwen3_5DecoderLayer); every projection, norm and MLP is called through the model's own submodules, or, for the
projections that read one input, through their fused weight (``fusion``).  In decode the single projections go
through ``qwen_chat.engine.parallel.tp_decode`` (local weight, then the tensor-parallel completion) and the
element-wise glue through ``glue`` (compiled on CUDA); prefill calls the modules themselves.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from qwen_chat.engine.model import gdn, gemv
from qwen_chat.engine.model.fusion import Fused, Groups
from qwen_chat.engine.model.glue import apply_rotary, conv_ring_from_tail, l2norm
from qwen_chat.engine.model.options import RunnerOptions
from qwen_chat.engine.model.state import SlotState
from qwen_chat.engine.parallel.tp_decode import LocalDecode


class ModelForward:
    """Prefill and decode maths of one ``Qwen3_5ForConditionalGeneration`` over ``state``.

    Args:
        model: the model (its text decoder's layers, final norm and lm_head are used).
        state: the slot state the forward reads and writes.
        groups, fused: each layer's projection groups and fused weights (``fusion.fuse_layers``).
        options: the runner's resolved ``RunnerOptions`` (``fast_gemv``, ``compile_glue``, ``gdn_kernel``).
        glue: the glue functions (``glue.glue_functions``).
        tp: the decode projections (``tp_decode.decode_projections``).
        chunk_rule: the chunked gated delta rule for prefill (fla's kernel or transformers' reference).
        max_context: tokens per slot; device, dtype: of the activations.
    """

    def __init__(self, model, *, state: SlotState, groups: Sequence[Groups], fused: Sequence[dict[str, Fused]],
                 options: RunnerOptions, glue: dict[str, Callable], tp: LocalDecode, chunk_rule: Callable,
                 max_context: int, device: torch.device, dtype: torch.dtype) -> None:
        lm = model.model.language_model
        tc = model.config.text_config
        self._layers = list(lm.layers)
        self._final_norm, self._lm_head = lm.norm, model.lm_head
        self._kinds, self._geo = state.kinds, state.geo
        self.k_cache, self.v_cache = state.k_cache, state.v_cache
        self.conv_state, self.rec_state = state.conv_state, state.rec_state
        self._groups, self._fused = groups, fused
        self._opts, self._glue, self.tp, self._chunk_rule = options, glue, tp, chunk_rule
        self.dtype = dtype
        self._silu_mlp = getattr(tc, "hidden_act", None) == "silu"
        # M-RoPE for decode: text tokens have equal t/h/w positions, so cos/sin depend on one index only.
        # Table built with the model's own rotary module over positions 0..max_context-1 (plus the largest
        # shift a decode position can take: rope deltas are <= 0 for images, so max_context suffices).
        pos = torch.arange(max_context, device=device).view(1, 1, -1).expand(3, 1, -1)
        probe = torch.zeros(1, 1, tc.hidden_size, device=device, dtype=dtype)
        cos, sin = lm.rotary_emb(probe, pos)
        self.cos_table, self.sin_table = cos[0].contiguous(), sin[0].contiguous()  # [T, rotary_dim]
        self._ctx_range = torch.arange(max_context, device=device)

    # ------------------------------------------------------------------ prefill
    def prefill(self, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_t: torch.Tensor,
                n_t: torch.Tensor) -> torch.Tensor:
        """The prefill forward of one prompt, padded or not, with tensor ops only (capturable in a CUDA graph).

        emb: [1, P, hidden] input embeddings (model dtype); cos/sin: [1, P, rotary_dim]; slot_t: int64 [1], the
        slot to fill; n_t: int64 [1], the real prompt length n <= P.  Positions n..P-1 are padding and leave no
        trace in what the slot keeps: the Gated DeltaNet layers see them with beta = 0 and log-decay g = 0, so
        S_t = S_{t-1} exactly (the delta rule's update is scaled by beta, its decay is exp(g)); the conv state
        ring is filled from the last real positions (glue.conv_ring_from_tail); attention is causal, so real
        positions never see padding, and the padding's KV entries (positions >= n) are overwritten by decode
        before any query reaches them.
        Returns fp32 logits [1, vocab_size] of position n - 1.
        """
        P = emb.shape[1]
        valid = (self._ctx_range[:P] < n_t).to(self.dtype)  # [P]
        h = emb
        for i, layer in enumerate(self._layers):
            x = layer.input_layernorm(h)
            if self._kinds[i] == "linear":
                x = self._linear_prefill(i, layer.linear_attn, slot_t, n_t, valid, x)
            else:
                x = self._attn_prefill(i, layer.self_attn, slot_t, x, cos, sin)
            h = h + x
            mlp = layer.mlp
            gate, up = self._project(i, "mlp", layer.post_attention_layernorm(h))
            h = h + mlp.down_proj(mlp.act_fn(gate) * up)
        last = h.index_select(1, n_t - 1)  # [1, 1, hidden]
        return self._lm_head(self._final_norm(last)).reshape(1, -1).float()

    def _project(self, i: int, group: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs of layer ``i``'s projection group ``group`` ("mix": the token mixer's input projections,
        "mlp": gate and up) for input x [..., hidden]: one GEMM over the fused weight when the group was fused
        (``fusion.fuse_linears``), else one module call each.  Returns a tuple of [..., out_features] tensors
        (views into one output when fused)."""
        fused = self._fused[i].get(group)
        if fused is None:
            return tuple(m(x) for m in self._groups[i][group])
        w, sizes = fused
        return (gemv.linear(x, w) if self._opts.fast_gemv else F.linear(x, w)).split(sizes, dim=-1)

    def _attn_prefill(self, i, at, slot_t, x, cos, sin):
        g = self._geo[i]
        B, P, _ = x.shape
        hd = g["hd"]
        qg, kx, vx = self._project(i, "mix", x)
        q, gate = torch.chunk(qg.reshape(B, P, -1, 2 * hd), 2, dim=-1)
        gate = gate.reshape(B, P, -1)
        q = at.q_norm(q).transpose(1, 2)                                     # [1, nq, P, hd]
        k = at.k_norm(kx.reshape(B, P, -1, hd)).transpose(1, 2)             # [1, nkv, P, hd]
        v = vx.reshape(B, P, -1, hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        self.k_cache[i][slot_t, :, :P] = k.to(self.k_cache[i].dtype)
        self.v_cache[i][slot_t, :, :P] = v.to(self.v_cache[i].dtype)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=g["scale"], enable_gqa=True)
        o = o.transpose(1, 2).reshape(B, P, -1) * torch.sigmoid(gate)
        return at.o_proj(o)

    def _linear_prefill(self, i, la, slot_t, n_t, valid, x):
        g = self._geo[i]
        B, P, _ = x.shape
        K = g["K"]
        qkv, z, b, a = self._project(i, "mix", x)
        qkv = qkv.transpose(1, 2)  # [1, C, P]
        # conv state: the ring of the last real inputs (zeros before the first token)
        ring = conv_ring_from_tail(qkv[0], n_t, K)                                     # [C, K]
        self.conv_state[i].index_copy_(0, slot_t, ring[None].to(self.conv_state[i].dtype))
        mixed = ACT2FN[la.activation](la.conv1d(qkv.to(la.conv1d.weight.dtype))[..., :P]).to(x.dtype)
        mixed = mixed.transpose(1, 2)
        q, k, v = torch.split(mixed, [g["key_dim"], g["key_dim"], g["value_dim"]], dim=-1)
        q = q.reshape(B, P, -1, g["dk"])
        k = k.reshape(B, P, -1, g["dk"])
        v = v.reshape(B, P, -1, g["dv"])
        # q, k l2-normalised here rather than inside fla's kernel: fla's l2norm kernel is autotuned per
        # ceil(L * heads / 65536), so every further 2,048 tokens of prompt cost seconds of one-off tuning
        # (measured: docs/performance.md); this is the same formula (glue.l2norm, fp32) at no such cost.
        q = l2norm(q.float()).to(q.dtype)
        k = l2norm(k.float()).to(k.dtype)
        rep = g["nv"] // g["nk"]
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        mask = valid[None, :, None]
        beta = b.sigmoid() * mask.to(b.dtype)
        gdecay = -la.A_log.float().exp() * F.softplus(a.float() + la.dt_bias) * mask.float()
        out, state = self._chunk_rule(q, k, v, g=gdecay, beta=beta, initial_state=None,
                                      output_final_state=True, use_qk_l2norm_in_kernel=False)
        # [1, HV, dk, dv] -> value-major [1, HV, dv, dk]
        self.rec_state[i].index_copy_(0, slot_t, state.float().transpose(-1, -2).contiguous())
        core = la.norm(out.reshape(-1, g["dv"]).to(x.dtype), z.reshape(-1, g["dv"]))
        return la.out_proj(core.reshape(B, P, -1))

    # ------------------------------------------------------------------ decode
    def decode(self, slot_idx, tokens, pos, rope_pos, ctx: int) -> torch.Tensor:
        """One batched decode forward.  slot_idx/tokens/pos/rope_pos: int64 [B] on device; ctx: attention
        window (static per graph).  Returns fp32 logits [B, V].  Only tensor ops: safe to capture."""
        tp = self.tp
        tp.begin_step(tokens.shape[0])
        try:
            h, x = tp.embed(tokens)                                          # [B, H] each
            cos, sin = self.cos_table[rope_pos], self.sin_table[rope_pos]  # [B, rot]
            n = len(self._layers)
            for i, layer in enumerate(self._layers):
                if self._kinds[i] == "linear":
                    x = self._linear_decode(i, layer.linear_attn, slot_idx, pos, x)
                else:
                    x = self._attn_decode(i, layer.self_attn, slot_idx, pos, x, cos, sin, ctx)
                h, x = tp.add_norm(h, x, layer.post_attention_layernorm)
                x = self._mlp_decode(i, layer.mlp, x)
                nxt = self._layers[i + 1].input_layernorm if i + 1 < n else self._final_norm
                h, x = tp.add_norm(h, x, nxt, last=i + 1 == n)
        finally:
            tp.end_step()
        return tp.linear(self._lm_head, x).float()

    def _mlp_decode(self, i: int, mlp, x: torch.Tensor) -> torch.Tensor:
        """Qwen3_5MLP for decode rows x [B, hidden]: down(act(gate(x)) * up(x)).  For one row, with the Triton
        GEMV, a fused gate/up weight, a down projection the step runs itself and SiLU, the SwiGLU is computed
        inside the down projection's kernel as it loads its input (``gemv.gemv(..., swiglu=True)``: one kernel
        fewer per layer); otherwise the compiled glue does it.  Only for one row, where it is faster (measured:
        docs/performance.md)."""
        fused = self._fused[i].get("mlp")
        down = self.tp.weight(mlp.down_proj)
        if self._opts.fast_gemv and fused is not None and self._silu_mlp and down is not None and x.shape[0] == 1:
            gate_up = gemv.linear(x, fused[0])                                   # [B, 2 * intermediate]
            if gemv.supports(gate_up, down, swiglu=True):
                return self.tp.run(mlp.down_proj, 1, lambda out: gemv.gemv(gate_up, down, out=out, swiglu=True))
            gate, up = gate_up.split(fused[1], dim=-1)
        else:
            gate, up = self._project(i, "mlp", x)
        return self.tp.linear(mlp.down_proj, self._glue["swiglu"](gate, up, mlp.act_fn))

    def _attn_decode(self, i, at, slot_idx, pos, x, cos, sin, ctx):
        g = self._geo[i]
        B = x.shape[0]
        kc, vc = self.k_cache[i], self.v_cache[i]
        qg, kx, vx = self._project(i, "mix", x)
        q, gate = self._glue["attn_pre"](qg, kx, vx, at.q_norm, at.k_norm, cos, sin, kc, vc, slot_idx, pos,
                                         g["hd"], g["nkv"])
        if self._opts.compile_glue:
            o = self._glue["attn_core"](q, kc, vc, slot_idx, pos, ctx, g["scale"])
        else:  # eager: gathered copy + SDPA (cheaper than the broadcast form without a compiler)
            keys, vals = kc[slot_idx, :, :ctx], vc[slot_idx, :, :ctx]              # [B, nkv, ctx, hd]
            mask = (self._ctx_range[:ctx][None, :] <= pos[:, None]).view(B, 1, 1, ctx)
            # The query heads of one KV group act as that group's "query positions": no KV head expansion.
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=g["scale"])
        return self.tp.linear(at.o_proj, self._glue["attn_post"](o, gate))

    def _linear_decode(self, i, la, slot_idx, pos, x):
        g = self._geo[i]
        qkv, z, b, a = self._project(i, "mix", x)
        if self._opts.gdn_kernel:
            core = gdn.gdn_decode(qkv, z, b, a, self.conv_state[i], self.rec_state[i], slot_idx, pos,
                                  la.conv1d.weight[:, 0, :], la.A_log, la.dt_bias, la.norm.weight,
                                  la.norm.variance_epsilon, g["key_dim"], g["dk"], g["dv"])
        else:
            core = self._glue["gdn_step"](
                qkv, z, b, a, self.conv_state[i], self.rec_state[i], slot_idx, pos, la.conv1d.weight[:, 0, :],
                la.A_log, la.dt_bias, la.norm, la.activation, g["key_dim"], g["dk"], g["dv"])
        return self.tp.linear(la.out_proj, core)
