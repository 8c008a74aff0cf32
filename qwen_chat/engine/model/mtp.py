"""The checkpoint's multi-token-prediction (MTP) head as the drafter of speculative decoding.

Qwen3.5 checkpoints carry one MTP layer under ``mtp.`` (``checkpoints.layout.mtp_head``): ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``fc`` [hidden, 2 * hidden], one gated full-attention decoder layer ``layers.0`` and
``norm``; it shares the target's ``embed_tokens`` and ``lm_head``.  For position q it reads the target's final
normed hidden state h_q and the embedding of the token at q + 1 and predicts the token at q + 2:

    x = fc([pre_fc_norm_embedding(embed(t_{q+1})), pre_fc_norm_hidden(h_q)])
    y = norm(decoder_layer(x, position q))          logits = lm_head(y)

(vLLM ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``, SGLang ``qwen3_next_mtp.py``: embedding first in the
concatenation, the hidden state after the target's final norm, the layer's residual starting at x.)  Chained
drafts feed y back as the hidden state of the next position with the previous draft's embedding.

The MTP layer keeps its own keys and values for every position it has processed, in the target's KV blocks
(same block tables, its own cache tensors: the extra last entry of the runner's ``k_cache``/``v_cache``, planned
with the memory budget by ``with_mtp_layer``).  A prompt's chunks fill it as they are prefilled (``fill``); its
last position waits for the drawn token (``record``).  Exact state: after a verify step the layer runs over the
positions the step kept (h from the verify forward, the next tokens from the kept drafts and the corrected
token), so its cache holds exactly the accepted positions; the chained draft positions beyond are overwritten by
the next step.  It attends only to positions it has processed since its sequence's context last broke (a plain
decode step leaves no hidden states behind: ``_start`` marks where the context begins), so stale keys are never
read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors import safe_open

from qwen_chat.engine.model import glue, kv_quant
from qwen_chat.engine.model.speculative import device_ints
from qwen_chat.engine.model.state import Geometry

MTP_PREFIX = "mtp."


class MtpHead(torch.nn.Module):
    """The MTP modules (transformers' ``Qwen3_5RMSNorm`` and ``Qwen3_5DecoderLayer`` of a full-attention layer,
    so the formulas are the target's own).  Args: the text config."""

    def __init__(self, text_config) -> None:
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        H, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=eps)
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        full = list(text_config.layer_types).index("full_attention")
        self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(text_config, full)])
        self.norm = Qwen3_5RMSNorm(H, eps=eps)


def _dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """An FP8 weight [N, K] with block scales [ceil(N / block), ceil(K / block)] (the published FP8 format,
    docs/checkpoints.md) back to fp32."""
    s = scale_inv.float().repeat_interleave(block, 0)[:w.shape[0]].repeat_interleave(block, 1)[:, :w.shape[1]]
    return w.float() * s


def load_mtp_head(folder, text_config, *, device, dtype: torch.dtype) -> Optional[MtpHead]:
    """Read the ``mtp.*`` tensors of the checkpoint in ``folder`` (sharded with ``model.safetensors.index.json``,
    or one ``model.safetensors``) into an ``MtpHead`` on ``device`` in ``dtype``; FP8 tensors with
    ``weight_scale_inv`` block scales are dequantised.  Every tensor-parallel rank holds the whole head (one
    layer).  Returns None when the checkpoint has no ``mtp.`` tensors.  Raises ValueError naming the tensors
    that are missing or do not match the config."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        where = {n: f for n, f in json.loads(index.read_text())["weight_map"].items() if n.startswith(MTP_PREFIX)}
    elif (folder / "model.safetensors").exists():
        with safe_open(str(folder / "model.safetensors"), "pt") as fh:
            where = {n: "model.safetensors" for n in fh.keys() if n.startswith(MTP_PREFIX)}
    else:
        where = {}
    if not where:
        return None
    tensors = {}
    for file in sorted(set(where.values())):
        with safe_open(str(folder / file), "pt") as fh:
            for name in (n for n, f in where.items() if f == file):
                tensors[name[len(MTP_PREFIX):]] = fh.get_tensor(name)
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        base = name[:-len("_scale_inv")]
        tensors[base] = _dequantize(tensors[base], tensors.pop(name))
    with torch.device("meta"):
        head = MtpHead(text_config)
    expected = dict(head.state_dict())
    missing = sorted(set(expected) - set(tensors))
    wrong = sorted(n for n in expected if n in tensors and tuple(tensors[n].shape) != tuple(expected[n].shape))
    if missing or wrong:
        raise ValueError(f"{folder}: the MTP head is incomplete or does not match config.json (missing "
                         f"{missing[:3]}, wrong shape {wrong[:3]})")
    head = head.to_empty(device=device)
    head.load_state_dict({n: tensors[n].to(dtype) for n in expected})
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def with_mtp_layer(geometry: Geometry) -> Geometry:
    """``geometry`` plus one full-attention layer of the widest attention layer's widths at the end: the MTP
    layer's KV cache, so that the memory plan counts it and the runner's state holds it (at index
    ``len(geometry.kinds)``)."""
    full = next(g for k, g in zip(geometry.kinds, geometry.geo) if k == "full")
    return Geometry(tuple(geometry.kinds) + ("full",), tuple(geometry.geo) + (dict(full),), geometry.dtype,
                    geometry.kv_dtype)


class MtpDrafter:
    """Drafts with an ``MtpHead`` for the sequences of one ``ModelRunner`` (see the module docstring).

    Args: head (``MtpHead`` on the runner's device), runner (its embedding, lm_head, rotary tables, block tables
    and decode projections are shared), ``k`` (drafts per step at most).
    """

    def __init__(self, head: MtpHead, runner, *, k: int) -> None:
        self.head, self.runner, self.k = head, runner, int(k)
        fwd = runner._forward
        layer = len(fwd._layers)
        at = head.layers[0].self_attn
        nkv = at.k_proj.out_features // at.head_dim
        shape = (runner.num_blocks + 1, runner.block_tokens, nkv, at.head_dim)
        if not (layer in runner.k_cache and tuple(runner.k_cache[layer].shape) == shape):
            # not planned with the memory budget (a runner built without ``with_mtp_layer``): its own tensors,
            # registered with the runner's caches so that shared and restored prefixes copy them too
            runner.k_cache[layer] = torch.zeros(shape, device=runner.device, dtype=runner.dtype)
            runner.v_cache[layer] = torch.zeros(shape, device=runner.device, dtype=runner.dtype)
            runner.k_scale.pop(layer, None), runner.v_scale.pop(layer, None)  # (in the model's dtype: no scales)
        self.k_cache, self.v_cache = runner.k_cache[layer], runner.v_cache[layer]
        self.k_scale, self.v_scale = runner.k_scale.get(layer), runner.v_scale.get(layer)  # (FP8: kv_quant)
        fwd.keep_hidden = True
        S, H = runner.num_slots + 1, runner.config.text_config.hidden_size
        self._hidden = torch.zeros(S, self.k + 1, H, device=runner.device, dtype=runner.dtype)
        self._tokens = torch.zeros(S, self.k + 1, dtype=torch.long, device=runner.device)
        self._pending: dict[int, tuple[int, int]] = {}  # slot -> (first position, kept positions)
        self._start = [0] * S   # first position of each slot's MTP context
        self._next = [-1] * S   # the position after the last one processed
        #: the drafting's CUDA graphs (``mtp_graphs.DraftGraphs``, set by ``spec_step.Speculation``), or None
        self.graphs = None

    def forget(self, slot: int) -> None:
        """The sequence in ``slot`` ended, restarted or took a step without hidden states."""
        self._pending.pop(int(slot), None)
        self._next[int(slot)] = -1

    def share(self, src: int, dst: int) -> None:
        """``dst`` continues from ``src``'s state (``ModelRunner.copy_slot``: the KV blocks, the MTP layer's
        included, are shared or copied): it has the same MTP context."""
        self._start[dst], self._next[dst] = self._start[src], self._next[src]

    @torch.no_grad()
    def fill(self, slot: int, start: int, n: int, offset: int, next_tokens: torch.Tensor, first: bool) -> None:
        """The MTP layer's keys and values of a prompt chunk's positions start .. start + m - 1 (m = n, or n - 1
        for a prompt's last chunk, whose last position waits for the drawn token: ``record``), from the last
        prefill's hidden states and rotary angles (rows offset .. offset + m - 1) and ``next_tokens`` (int64 [m],
        the tokens at start + 1 .. start + m).  A single decoder layer's keys and values depend only on its input
        at the same position, so no attention runs.  ``first``: the chunk starts its sequence (at 0, or right
        after a kept prefix whose MTP keys and values were filled the same way)."""
        r, head, fwd = self.runner, self.head, self.runner._forward
        m = int(next_tokens.numel())
        if first:
            self._start[slot], self._next[slot] = 0, start
        if m == 0 or self._next[slot] != start:
            return
        at = head.layers[0].self_attn
        hd = at.head_dim
        emb, _ = fwd.tp.embed(next_tokens)
        hidden = fwd._final_norm(fwd.prefill_hidden[offset:offset + m])
        x = head.fc(torch.cat([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden.to(emb.dtype))], -1))
        y = head.layers[0].input_layernorm(x)
        cos, sin = fwd.prefill_cos[offset:offset + m][:, None], fwd.prefill_sin[offset:offset + m][:, None]
        k = glue.apply_rotary(at.k_norm(at.k_proj(y).view(m, -1, hd)), cos, sin)
        v = at.v_proj(y).view(m, -1, hd)
        rows = device_ints(r.tables.positions(slot, start, start + m).tolist(), r.device)
        nkv = k.shape[1]
        flat = (lambda t: None if t is None else t.view(-1, nkv))
        kv_quant.write(self.k_cache.view(-1, nkv, hd), flat(self.k_scale), rows, k)
        kv_quant.write(self.v_cache.view(-1, nkv, hd), flat(self.v_scale), rows, v)
        self._next[slot] = start + m

    @torch.no_grad()
    def record(self, slots: Sequence[int], start: Sequence[int], hidden: torch.Tensor, tokens: torch.Tensor,
               counts: Sequence[int]) -> None:
        """What a forward left for the MTP layer: slot b's positions start[b] .. start[b] + counts[b] - 1 had
        final hidden states ``hidden[b]`` (fp32 [B, T, H]) and are followed by ``tokens[b]`` (int64 [B, T]); the
        next ``propose`` processes them.  ``stage`` (queued on the device) then ``note`` (the host's part)."""
        self.stage(slots, hidden, tokens)
        self.note(slots, start, counts)

    def stage(self, slots: Sequence[int], hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """The device half of ``record``: keep ``hidden`` and ``tokens`` of ``slots`` (no host wait)."""
        idx = device_ints([int(s) for s in slots], self.runner.device)
        T = hidden.shape[1]
        self._hidden[idx, :T] = hidden.to(self._hidden.dtype)
        self._tokens[idx, :T] = tokens.to(self._tokens.device, torch.long)

    def note(self, slots: Sequence[int], start: Sequence[int], counts: Sequence[int]) -> None:
        """The host half of ``record``: slot b's kept positions start[b] .. start[b] + counts[b] - 1."""
        for s, p, c in zip(slots, start, counts):
            self._pending[int(s)] = (int(p), int(c))

    @torch.no_grad()
    def propose(self, slots: Sequence[int], last: torch.Tensor, k: int, mask=None) -> torch.Tensor:
        """k (<= ``self.k``) drafts per slot: int64 [B, k] on the device.  Slots with recorded positions run the
        MTP layer over them and then k - 1 chained positions (``draft``; through its CUDA graphs when the runner
        has them and no ``mask`` is given); the others draft their ``last`` token (int64 [B]), a guess the
        verify step will mostly reject.  The runner's block tables must cover each slot's length + k (the verify
        step's ``Verifier.prepare``).  ``mask(slots, logits, prefixes)``: applied to the logits of each draft
        (the rows' slots, float [R, V], each row's drafts so far as host ids; a grammar's
        ``ConstraintTable.mask_next_draft``; each draft then waits for the one before it on the host)."""
        slots = [int(s) for s in slots]
        r = self.runner
        dev = r.device
        drafts = last.to(dev, torch.long).reshape(-1, 1).repeat(1, k)
        ready = [(b, s) for b, s in enumerate(slots) if s in self._pending]
        if not ready:
            return drafts
        rows = []  # per ready slot: the ``draft`` inputs' columns
        for _, s in ready:
            p, n = self._pending.pop(s)
            if self._next[s] != p:
                self._start[s] = p
            self._next[s] = p + n
            rows.append((s, p, n, self._start[s], r.rope_deltas[s]))
        ctx = r.context_bucket(max(row[1] for row in rows) + self.k + 1 + k)  # every position written or read
        if mask is None and self.graphs is not None:
            got = self.graphs.run(rows, ctx, k)
        else:
            got = self.draft(device_ints([list(c) for c in zip(*rows)], dev), ctx, k, mask=mask)
        drafts[device_ints([b for b, _ in ready], dev)] = got
        return drafts

    def draft(self, inputs: torch.Tensor, ctx: int, k: int, mask=None) -> torch.Tensor:
        """The drafts of B slots with recorded positions: the MTP layer over each slot's T = ``self.k`` + 1 rows
        of ``stage`` (its kept positions and, past them, rows whose keys and values the chained drafts overwrite),
        then k - 1 chained positions after its last kept one.

        inputs: int64 [5, B] on the device: slot, first recorded position p, kept positions n (1..T), the first
        position of its MTP context, its rotary position shift.  ctx: the attention window (a context bucket
        covering p + T + k).  ``mask`` as in ``propose`` (then the host waits for each draft).  Returns int64
        [B, k].  Tensor ops only without ``mask`` (what ``mtp_graphs.DraftGraphs`` captures)."""
        slot, p, n, start, delta = inputs.unbind(0)
        B, T = slot.shape[0], self.k + 1
        pos = (p[:, None] + torch.arange(T, device=p.device)).reshape(-1)
        each = (lambda t: t[:, None].expand(B, T).reshape(-1))  # noqa: E731 - per slot -> per row
        out = self._rows(each(slot), self._tokens[slot].reshape(-1), self._hidden[slot].reshape(B * T, -1), pos,
                         pos + each(delta), each(start), ctx)                                  # [B * T, H]
        y = out.view(B, T, -1)[torch.arange(B, device=p.device), n - 1]
        nxt = p + n
        cols: list[torch.Tensor] = []
        prefixes = [[] for _ in range(B)] if mask is not None else None
        row_slots = slot.tolist() if mask is not None else None
        for j in range(k):
            logits = self._logits(y)
            if mask is not None:
                logits = mask(row_slots, logits, prefixes)
            d = logits.argmax(dim=-1)
            cols.append(d)
            if j + 1 < k:
                if mask is not None:
                    for prefix, token in zip(prefixes, d.tolist()):
                        prefix.append(token)
                y = self._rows(slot, d, y, nxt + j, nxt + j + delta, start, ctx)
        return torch.stack(cols, dim=1)

    def _logits(self, y: torch.Tensor) -> torch.Tensor:
        tp = self.runner.tp
        tp.begin_step(y.shape[0])
        try:
            return tp.linear(self.runner._forward._lm_head, y).float()
        finally:
            tp.end_step()

    def _rows(self, slot_idx: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
              rope: torch.Tensor, start: torch.Tensor, ctx: int) -> torch.Tensor:
        """The MTP layer for rows (slot, next token, target hidden, position, rotary position, context start; int64
        [R] each but hidden [R, H]): writes each row's keys and values at its position, attends to its slot's
        positions ``start`` .. its own (within the first ``ctx`` positions, a context bucket).  Returns the
        normed output [R, H] (model dtype).  Tensor ops only."""
        r, head = self.runner, self.head
        fwd = r._forward
        layer = head.layers[0]
        at = layer.self_attn
        emb, _ = fwd.tp.embed(tokens)
        x = head.fc(torch.cat([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden.to(emb.dtype))], -1))
        cos, sin = fwd.cos_table[rope], fwd.sin_table[rope]
        table = r.tables.device_table[slot_idx]
        kv_block = table.gather(1, (pos // r.block_tokens)[:, None])[:, 0]
        y = layer.input_layernorm(x)
        hd = at.head_dim
        nkv = at.k_proj.out_features // hd
        q, gate = glue.attn_pre(at.q_proj(y), at.k_proj(y), at.v_proj(y), at.q_norm, at.k_norm, cos, sin,
                                self.k_cache, self.v_cache, kv_block, pos % r.block_tokens, hd, nkv, self.k_scale,
                                self.v_scale)
        o = fwd.decode_attention(q, self.k_cache, self.v_cache, self.k_scale, self.v_scale,
                                 table[:, :ctx // r.block_tokens], pos, at.scaling, start)
        x = x + at.o_proj(glue.attn_post(o, gate))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return head.norm(x)
