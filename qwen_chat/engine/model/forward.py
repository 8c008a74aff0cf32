"""The model maths of the runner: the prefill forward of a batch of prompt chunks packed into one sequence of
tokens, and one batched decode step, over the slot state (``state.SlotState``: paged KV cache, Gated DeltaNet
state slots).

Formulas: transformers ``models/qwen3_5/modeling_qwen3_5.py`` (Qwen3_5Attention, Qwen3_5GatedDeltaNet,
Qwen3_5MLP, Qwen3_5DecoderLayer); every projection, norm and MLP is called through the model's own submodules,
or, for the projections that read one input, through their fused weight (``fusion``).  In decode the single
projections go through ``qwen_chat.engine.parallel.tp_decode`` (local weight, then the tensor-parallel
completion) and the element-wise glue through ``glue`` (compiled on CUDA); prefill calls the modules
themselves, or the fused kernels that compute the same norms, SwiGLU and conv (``prefill_kernels``).  The
decode step is tensor ops only, so ``graphs.CudaGraphs`` can capture it.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers.activations import ACT2FN

from qwen_chat.engine.model import delta_rule, fp8, gdn, kv_quant, prefill_kernels, prefill_meta
from qwen_chat.engine.model.fusion import Fused, Groups
from qwen_chat.engine.model.glue import apply_rotary, l2norm
from qwen_chat.engine.model.options import RunnerOptions
from qwen_chat.engine.model.paged import BlockTables
from qwen_chat.engine.model.prefill_kernels import PrefillOps
from qwen_chat.engine.model.prefill_meta import PrefillRows
from qwen_chat.engine.model.state import SlotState
from qwen_chat.engine.parallel.tp_decode import LocalDecode


@contextlib.contextmanager
def no_cudnn_attention():
    """Within: PyTorch's scaled-dot-product attention does not use its cuDNN backend (the other backends as they
    were: FlashAttention or the memory-efficient kernel run it).  cuDNN, which PyTorch prefers on Hopper for
    ``is_causal=True``, builds an execution plan for every new pair of query and key lengths (a few hundred ms
    each, docs/performance.md), and every new prompt or chunk length is one.  Also a decorator."""
    held = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(held)


class ModelForward:
    """Prefill and decode maths of one ``Qwen3_5ForConditionalGeneration`` over ``state``.

    Args:
        model: the model (its text decoder's layers, final norm and lm_head are used).
        state: the slot state the forward reads and writes.
        tables: the KV block tables (``paged.BlockTables``; decode reads its ``device_table``).
        groups, fused: each layer's projection groups and fused weights (``fusion.fuse_layers``).
        options: the runner's resolved ``RunnerOptions`` (``fast_gemv``, ``compile_glue``, ``gdn_kernel``).
        glue: the glue functions (``glue.glue_functions``).
        tp: the decode projections (``tp_decode.decode_projections``).
        chunk_rule: the chunked gated delta rule for prefill (fla's kernel or transformers' reference);
            tail_rule: the packed rule for the few tokens after keep points, or None (``delta_rule``).
        varlen: ``chunk_rule`` takes packed sequences (``cu_seqlens``, fla); else it runs once per sequence.
        max_context: tokens per sequence; device, dtype: of the activations.
    """

    def __init__(self, model, *, state: SlotState, tables: BlockTables, groups: Sequence[Groups],
                 fused: Sequence[dict[str, Fused]], options: RunnerOptions, glue: dict[str, Callable],
                 tp: LocalDecode, chunk_rule: Callable, varlen: bool, max_context: int, device: torch.device,
                 dtype: torch.dtype, tail_rule: Optional[Callable] = None) -> None:
        lm = model.model.language_model
        tc = model.config.text_config
        self._layers = list(lm.layers)
        self._final_norm, self._lm_head = lm.norm, model.lm_head
        self._kinds, self._geo = state.kinds, state.geo
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = state.k_cache, state.v_cache, state.k_scale, state.v_scale
        self.conv_state, self.rec_state = state.conv_state, state.rec_state
        self.tables = tables
        self._bt = tables.block_tokens
        self._groups, self._fused = groups, fused
        self._opts, self._glue, self.tp, self._chunk_rule = options, glue, tp, chunk_rule
        self._varlen, self._tail_rule = varlen, tail_rule
        self.dtype = dtype
        self._silu_mlp = getattr(tc, "hidden_act", None) == "silu"
        #: prefill's fused kernels (``prefill_kernels``) when ``options.prefill_kernels``: norms and SwiGLU through
        #: ``ops``, the conv of each Gated DeltaNet layer where ``conv_fits``
        self.ops = PrefillOps(bool(options.prefill_kernels), silu_mlp=self._silu_mlp)
        self._conv_K = next((g["K"] for k, g in zip(self._kinds, self._geo) if k == "linear"), 1)
        self._fused_conv: dict[int, bool] = {}
        for i, (kind, g) in enumerate(zip(self._kinds, self._geo)):
            if kind == "linear":
                la = self._layers[i].linear_attn
                self._fused_conv[i] = self.ops.enabled and prefill_kernels.conv_fits(
                    g["conv_dim"], g["key_dim"], g["dk"], la.conv1d, la.activation)
        # M-RoPE for decode: text tokens have equal t/h/w positions, so cos/sin depend on one index only.
        # Table built with the model's own rotary module over positions 0..max_context-1 (plus the largest
        # shift a decode position can take: rope deltas are <= 0 for images, so max_context suffices).
        pos = torch.arange(max_context, device=device).view(1, 1, -1).expand(3, 1, -1)
        probe = torch.zeros(1, 1, tc.hidden_size, device=device, dtype=dtype)
        cos, sin = lm.rotary_emb(probe, pos)
        self.cos_table, self.sin_table = cos[0].contiguous(), sin[0].contiguous()  # [T, rotary_dim]
        #: keep each prefill's hidden states [T, hidden] (pre final norm) and cos/sin [T, rotary_dim] as
        #: ``prefill_hidden``/``prefill_cos``/``prefill_sin`` (the MTP drafter fills its cache from them)
        self.keep_hidden = False

    # ------------------------------------------------------------------ prefill
    def prefill(self, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seqs: Sequence[PrefillRows]) -> Optional[torch.Tensor]:
        """The prefill forward of prompt chunks packed one after the other (no padding).

        emb: [T, hidden] input embeddings (model dtype), T = sum of the chunks' n; cos/sin: [T, rotary_dim] of
        each token's (M-RoPE) position.  Each chunk continues its slot from position ``start``: attention reads
        the slot's cached keys and values of positions < start, the Gated DeltaNet layers start from the slot's
        conv and recurrent state (zeros when start is 0).  Writes each chunk's KV into its rows and leaves each
        slot's conv and recurrent state at its last token.
        Returns fp32 logits [m, vocab_size] of the last token of the m chunks with ``logits``, in order (None
        when m is 0).
        """
        seqs, meta = prefill_meta.pack(seqs, self._conv_K, emb.device)
        h = emb[None]
        cos, sin = cos[None], sin[None]
        for i, layer in enumerate(self._layers):
            x = self.ops.norm(layer.input_layernorm, h)
            if self._kinds[i] == "linear":
                x = self._linear_prefill(i, layer.linear_attn, meta, x)
            else:
                x = self._attn_prefill(i, layer.self_attn, seqs, x, cos, sin)
            h = self.mlp_block(i, layer, h + x)
        if self.keep_hidden:  # every token's hidden state and rotary angles, for the MTP drafter (``mtp``)
            self.prefill_hidden, self.prefill_cos, self.prefill_sin = h[0], cos[0], sin[0]
        if not any(s.logits for s in seqs):
            return None
        rows = h[0].index_select(0, meta["last"])  # [m, hidden]
        self.last_hidden = self._final_norm(rows)  # [m, hidden]: the MTP drafter's input (``mtp``)
        return self._lm_head(self.last_hidden).float()

    def _project(self, i: int, group: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs of layer ``i``'s projection group ``group`` ("mix": the token mixer's input projections,
        "mlp": gate and up) for input x [..., hidden]: one GEMM over the fused weight when the group was fused
        (``fusion.fuse_group``: one GEMM per run of bf16 or FP8 layers), else one module call each.  Returns a
        tuple of [..., out_features] tensors (views into one output per GEMM when fused)."""
        fused = self._fused[i].get(group)
        if fused is None:
            return tuple(m(x) for m in self._groups[i][group])
        return tuple(y for w, sizes in fused for y in fp8.linear(x, w, fast=self._opts.fast_gemv).split(sizes, dim=-1))

    def mlp_block(self, i: int, layer, h: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MLP half for prefill: h + down(act(gate) * up) of its post-attention norm; h [1, T, hidden]."""
        mlp = layer.mlp
        gate, up = self._project(i, "mlp", self.ops.norm(layer.post_attention_layernorm, h))
        return h + mlp.down_proj(self.ops.swiglu(mlp.act_fn, gate, up))

    def attn_inputs(self, i: int, at, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The full-attention layer ``i``'s projections for prefill rows x [1, T, hidden] with cos/sin [1, T, rot]:
        returns q [1, nq, T, hd] and k [1, nkv, T, hd] (normed, rotated), v [1, nkv, T, hd] and the output gate
        [1, T, nq * hd]."""
        hd = self._geo[i]["hd"]
        T = x.shape[1]
        qg, kx, vx = self._project(i, "mix", x)
        q, gate = torch.chunk(qg.reshape(1, T, -1, 2 * hd), 2, dim=-1)
        q = self.ops.norm(at.q_norm, q).transpose(1, 2)
        k = self.ops.norm(at.k_norm, kx.reshape(1, T, -1, hd)).transpose(1, 2)
        v = vx.reshape(1, T, -1, hd).transpose(1, 2)
        c, s = cos[:, None], sin[:, None]
        return apply_rotary(q, c, s), apply_rotary(k, c, s), v, gate.reshape(1, T, -1)

    def attn_core(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                  start: int) -> torch.Tensor:  # (runs under ``no_cudnn_attention``: the runner's prefill)
        """Causal attention of one chunk of n tokens continuing its sequence at position ``start``: q [1, nq, n, hd],
        k/v [1, nkv, n, hd]; rows int64 [start + n] (device), the KV-cache rows of positions 0..start+n-1.  Writes
        the chunk's keys and values into rows[start:], then attends over the cached positions and the chunk's own
        (causal from the bottom right).  Returns o [1, nq, n, hd]."""
        g = self._geo[i]
        kc, vc = self.k_cache[i].view(-1, g["nkv"], g["hd"]), self.v_cache[i].view(-1, g["nkv"], g["hd"])
        ks, vs = (s[i].view(-1, g["nkv"]) if i in s else None for s in (self.k_scale, self.v_scale))
        kv_quant.write(kc, ks, rows[start:], k[0].transpose(0, 1))
        kv_quant.write(vc, vs, rows[start:], v[0].transpose(0, 1))
        if start == 0:  # (an FP8 cache: the chunk's own keys and values as the cache holds them, kv_quant)
            k, v = kv_quant.round_trip(k, kc.dtype), kv_quant.round_trip(v, vc.dtype)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=g["scale"], enable_gqa=True)
        keys = kv_quant.read(kc, ks, rows, q.dtype).transpose(0, 1)[None]    # [1, nkv, start + n, hd]
        vals = kv_quant.read(vc, vs, rows, q.dtype).transpose(0, 1)[None]
        mask = causal_lower_right(q.shape[2], rows.shape[0])
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=g["scale"], enable_gqa=True)

    @staticmethod
    def attn_output(at, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o_proj(o * sigmoid(gate)) for o and gate [1, T, nq * hd]."""
        return at.o_proj(o * torch.sigmoid(gate))

    def _attn_prefill(self, i, at, seqs, x, cos, sin):
        T = x.shape[1]
        q, k, v, gate = self.attn_inputs(i, at, x, cos, sin)
        outs = [self.attn_core(i, q[:, :, sq.offset:sq.offset + sq.n], k[:, :, sq.offset:sq.offset + sq.n],
                               v[:, :, sq.offset:sq.offset + sq.n], sq.rows, sq.start) for sq in seqs]
        o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        return self.attn_output(at, o.transpose(1, 2).reshape(1, T, -1), gate)

    def _conv_prefill(self, i, la, meta, qkv):
        """Causal depthwise conv of packed chunks, each continuing from its slot's conv ring.  qkv: [T, C]
        (in_proj_qkv output).  Each chunk is laid out after the K-1 inputs before it (from the ring; zeros at
        the start of a prompt), one conv without padding runs over all, and each token takes the window that
        ends at it.  Stores each slot's new ring (its last K inputs at column p % K).  No loop over the chunks:
        the layout is one gather (``prefill_meta.pack``'s ``ext_src``).  Returns [T, C] pre-activation outputs (with
        ``_fused_conv[i]``: activated, q/k normed)."""
        g = self._geo[i]
        K = g["K"]
        ring_buf = self.conv_state[i]                                                # [S, C, K]
        if self._fused_conv[i]:  # conv + SiLU + q/k l2-norm in one kernel, then the rings (same values)
            y = prefill_kernels.conv_silu_l2(qkv, ring_buf, la.conv1d.weight, meta, g["key_dim"], g["dk"])
            prefill_kernels.write_rings(ring_buf, qkv, meta)
            return y
        C, N = qkv.shape[1], meta["slots"].shape[0]
        prev = ring_buf[meta["slots"][:, None], :, meta["prev_cols"]]               # [N, K - 1, C]
        prev = torch.where(meta["past"][:, None, None], prev, 0.0)
        src = torch.cat([qkv.t().to(ring_buf.dtype), prev.permute(2, 0, 1).reshape(C, -1)], dim=1)
        ext = src.index_select(1, meta["ext_src"])                                   # [C, sum(n + K - 1)]
        ring_buf[meta["slots"][:, None], :, meta["ring_cols"]] = ext[:, meta["ring_src"]].view(C, N, K).permute(1, 2, 0)
        if meta["keep_rows"].numel():  # the ring at each keep point: the K inputs before it
            ring_buf[meta["keep_rows"][:, None], :, meta["keep_cols"]] = ext[:, meta["keep_ext"]].permute(1, 2, 0)
        ext = ext[None]
        w = la.conv1d.weight
        out = F.conv1d(ext.to(w.dtype), w, la.conv1d.bias, groups=w.shape[0])  # window j: ext[j .. j + K - 1]
        return out[0].index_select(1, meta["take"]).t()

    def gdn_inputs(self, i: int, la, x: torch.Tensor, conv: Callable[[torch.Tensor], torch.Tensor],
                   fused: bool = False):
        """The Gated DeltaNet layer ``i``'s inputs to the chunked delta rule for prefill rows x [1, T, hidden];
        ``conv`` maps the in_proj_qkv output [T, C] to the causal conv's pre-activation output [T, C], or when
        ``fused`` to the activated outputs with q and k l2-normalised (``prefill_kernels.conv_silu_l2``).  Returns
        q, k [1, T, HV, dk] (l2-normalised, key heads repeated to the value heads), v [1, T, HV, dv], beta and
        the log decay g [1, T, HV] (g fp32), and z [1, T, HV * dv] (the output gate's input)."""
        g = self._geo[i]
        T = x.shape[1]
        qkv, z, b, a = self._project(i, "mix", x)
        mixed = (conv(qkv[0]) if fused else ACT2FN[la.activation](conv(qkv[0])).to(x.dtype))[None]  # [1, T, C]
        q, k, v = torch.split(mixed, [g["key_dim"], g["key_dim"], g["value_dim"]], dim=-1)
        q, k, v = q.reshape(1, T, -1, g["dk"]), k.reshape(1, T, -1, g["dk"]), v.reshape(1, T, -1, g["dv"])
        # q, k l2-normalised here rather than inside fla's kernel: fla's l2norm kernel is autotuned per
        # ceil(L * heads / 65536), so every further 2,048 tokens of prompt cost seconds of one-off tuning
        # (measured: docs/performance.md); this is the same formula (glue.l2norm, fp32) at no such cost.
        if not fused:
            q, k = l2norm(q.float()).to(q.dtype), l2norm(k.float()).to(k.dtype)
        rep = g["nv"] // g["nk"]
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        beta = b.sigmoid()
        gdecay = -la.A_log.float().exp() * F.softplus(a.float() + la.dt_bias)
        return q, k, v, beta, gdecay, z

    def gdn_output(self, i: int, la, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out_proj(norm(out, z)) of the delta rule's output out [1, T, HV, dv] and z [1, T, HV * dv]."""
        dv = self._geo[i]["dv"]
        T = z.shape[1]
        core = self.ops.gated_norm(la.norm, out.reshape(-1, dv).to(dtype), z.reshape(-1, dv))
        return la.out_proj(core.reshape(1, T, -1))

    def _linear_prefill(self, i, la, meta, x):
        q, k, v, beta, gdecay, z = self.gdn_inputs(i, la, x, lambda qkv: self._conv_prefill(i, la, meta, qkv),
                                                   fused=self._fused_conv[i])
        slots = meta["slots"]
        rec = self.rec_state[i]
        h0 = torch.where(meta["past"][:, None, None, None], rec.index_select(0, slots), 0.0)
        h0 = h0.transpose(-1, -2).contiguous()
        out, state, kept = delta_rule.packed_delta_rule(self._chunk_rule, self._varlen, meta["seg"], q, k, v,
                                                        gdecay, beta, h0, meta, self._tail_rule)
        # [N, HV, dk, dv] -> value-major [N, HV, dv, dk]
        rec.index_copy_(0, slots, state.float().transpose(-1, -2).contiguous())
        if kept.shape[0]:
            rec.index_copy_(0, meta["keep_rows"], kept.float().transpose(-1, -2).contiguous())
        return self.gdn_output(i, la, out, z, x.dtype)

    # ------------------------------------------------------------------ decode
    def decode(self, slot_idx, tokens, pos, rope_pos, ctx: int) -> torch.Tensor:
        """One batched decode forward.  slot_idx/tokens/pos/rope_pos: int64 [B] on device; ctx: attention
        window in tokens, a multiple of the block size (static per graph).  Each row's KV blocks come from the
        block table (``tables.device_table[slot]``).  Returns fp32 logits [B, V].  Only tensor ops: safe to
        capture."""
        return self.decode_rows(slot_idx, tokens, pos, rope_pos, ctx)

    def decode_rows(self, slot_idx, tokens, pos, rope_pos, ctx: int, linear=None, eager_write: bool = False,
                    with_hidden: bool = False) -> torch.Tensor:
        """``decode``'s forward, shared with the speculative verify step (``speculative.verify_forward``):
        ``linear(i, layer.linear_attn, x)`` replaces the Gated DeltaNet layers' decode core when given,
        ``eager_write`` writes the keys and values outside the compiled glue (``_attn_decode``), and
        ``with_hidden`` returns fp32 [B, V + H]: the logits, then each row's final normed hidden state."""
        tp = self.tp
        tp.begin_step(tokens.shape[0])
        try:
            h, x = tp.embed(tokens)                                          # [B, H] each
            cos, sin = self.cos_table[rope_pos], self.sin_table[rope_pos]  # [B, rot]
            table = self.tables.device_table[slot_idx]                       # [B, max_blocks]
            kv_block = table.gather(1, (pos // self._bt)[:, None])[:, 0]    # [B]
            kv_offset = pos % self._bt
            blocks = table[:, :ctx // self._bt]                              # [B, nb]
            n = len(self._layers)
            for i, layer in enumerate(self._layers):
                if self._kinds[i] != "linear":
                    x = self._attn_decode(i, layer.self_attn, (kv_block, kv_offset), blocks, pos, x, cos, sin,
                                          eager_write=eager_write)
                elif linear is not None:
                    x = linear(i, layer.linear_attn, x)
                else:
                    x = self._linear_decode(i, layer.linear_attn, slot_idx, pos, x)
                h, x = tp.add_norm(h, x, layer.post_attention_layernorm)
                x = self._mlp_decode(i, layer.mlp, x)
                nxt = self._layers[i + 1].input_layernorm if i + 1 < n else self._final_norm
                h, x = tp.add_norm(h, x, nxt, last=i + 1 == n)
        finally:
            tp.end_step()
        logits = tp.linear(self._lm_head, x).float()
        return torch.cat([logits, x.float()], dim=-1) if with_hidden else logits

    def _mlp_decode(self, i: int, mlp, x: torch.Tensor) -> torch.Tensor:
        """Qwen3_5MLP for decode rows x [B, hidden]: down(act(gate(x)) * up(x)).  For one row, with the Triton
        GEMV, a fused gate/up weight, a down projection the step runs itself and SiLU, the SwiGLU is computed
        inside the down projection's kernel as it loads its input (``fp8.linear(..., swiglu=True)``, bf16 or FP8
        weights: one kernel fewer per layer; only for one row, faster there: docs/performance.md); else the glue."""
        fused = self._fused[i].get("mlp")
        down = self.tp.weight(mlp.down_proj)
        if (self._opts.fast_gemv and fused is not None and len(fused) == 1 and self._silu_mlp and down is not None
                and x.shape[0] == 1):
            w, sizes = fused[0]
            gate_up = fp8.linear(x, w, fast=True)                                # [B, 2 * intermediate]
            if fp8.fuses_swiglu(gate_up, down):
                return self.tp.run(mlp.down_proj, 1,
                                   lambda out: fp8.linear(gate_up, down, out=out, fast=True, swiglu=True))
            gate, up = gate_up.split(sizes, dim=-1)
        else:
            gate, up = self._project(i, "mlp", x)
        return self.tp.linear(mlp.down_proj, self._glue["swiglu"](gate, up, mlp.act_fn))

    def _attn_decode(self, i, at, kv_at, blocks, pos, x, cos, sin, eager_write=False):
        g = self._geo[i]
        kc, vc, ks, vs = self.k_cache[i], self.v_cache[i], self.k_scale.get(i), self.v_scale.get(i)
        qg, kx, vx = self._project(i, "mix", x)
        if eager_write:  # the verify step: compiled for its row counts, the write copied the whole cache
            q, gate, k, v = self._glue["attn_qkv"](qg, kx, vx, at.q_norm, at.k_norm, cos, sin, g["hd"], g["nkv"],
                                                   kc.dtype if ks is None else self.dtype)
            kv_quant.write(kc, ks, kv_at, k)
            kv_quant.write(vc, vs, kv_at, v)
        else:
            q, gate = self._glue["attn_pre"](qg, kx, vx, at.q_norm, at.k_norm, cos, sin, kc, vc, *kv_at,
                                             g["hd"], g["nkv"], ks, vs)
        o = self.decode_attention(q, kc, vc, ks, vs, blocks, pos, g["scale"])
        return self.tp.linear(at.o_proj, self._glue["attn_post"](o, gate))

    def decode_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: Optional[torch.Tensor],
                         vs: Optional[torch.Tensor], blocks: torch.Tensor, pos: torch.Tensor, scale: float,
                         start: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's attention over its sequence's positions ``start`` (None: 0) .. ``pos`` in the paged cache
        (``glue.attn_core``'s arguments and result: q [B, nkv, G, hd] -> [B, nkv, G, hd]): the compiled glue in
        row groups when the glue is compiled, else a gathered copy of the window and SDPA (cheaper than the
        broadcast form without a compiler).  The decode step's and the MTP head's (``mtp.MtpDrafter``)."""
        if self._opts.compile_glue:
            return self._glue["attn_core"](q, kc, vc, blocks, pos, scale, ks, vs, start)
        keys = kv_quant.read(kc, ks, blocks, q.dtype).flatten(1, 2).transpose(1, 2)   # [B, nkv, ctx, hd]
        vals = kv_quant.read(vc, vs, blocks, q.dtype).flatten(1, 2).transpose(1, 2)
        ctx = keys.shape[2]
        span = torch.arange(ctx, device=pos.device)[None, :]
        attend = span <= pos[:, None]
        if start is not None:
            attend = attend & (span >= start[:, None])
        # The query heads of one KV group act as that group's "query positions": no KV head expansion.
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=attend.view(q.shape[0], 1, 1, ctx),
                                              scale=scale)

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
