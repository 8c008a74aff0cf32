"""Prefill of one short prompt chunk through CUDA graphs: padded to a token bucket, captured in pieces that end
where attention starts.

A short prefill (a follow-up turn, a tool-loop step, a short first prompt) is bound by the host: launched op by
op it costs thousands of kernel launches from Python, more than its GPU time.  Its shape changes with every
prompt, and its attention reads a number of cached positions that changes too, so one whole graph per shape is
not possible.  Here a chunk of n tokens runs padded to the smallest bucket T >= n of ``PREFILL_BUCKETS`` and the
forward is cut at each full-attention layer's attention (vLLM's piecewise CUDA graphs cut the same way): the
pieces between attention calls (projections, norms, rotary, MLPs, every Gated DeltaNet layer with its conv and
delta rule) are one graph per (bucket, piece); each attention (KV write, SDPA over the chunk and its cached
positions) runs eagerly between them on the real n tokens.  Every piece reads and writes fixed buffers, so the
replays chain.

The padding changes nothing a slot keeps: attention is causal and the padding comes last, so real positions
never see it, and attention itself runs on the real tokens only; the padded tokens enter the delta rule with
beta = 0 and log decay 0, which leaves the recurrent state unchanged (S' = S * exp(0) + 0); the conv ring takes
the last K real inputs (index tensors).  One keep point (``PrefillItem.keeps``: the state at an inner position,
kept for a later prompt) is a second row of the delta rule whose tokens after the keep point are masked the
same way, so its final state is the state at the keep point; chunks with more keep points run eagerly.

Without CUDA (tests) the same pieces run eagerly, padded, so CPU tests check the padding.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

from qwen_chat.engine.model.forward import ModelForward
from qwen_chat.engine.model.prefill_meta import PrefillRows

#: Token counts a chunk is padded to; a chunk longer than the last runs the eager packed prefill.  Graphs
#: against eager for one prompt (H200, docs/performance.md, "Short prefills"): 16 vs 105 ms at 100 tokens,
#: 48 vs 80 ms at 1,000; at 2,000 tokens the eager prefill (88 ms) is GPU-bound, and an earlier whole-prompt
#: graph of 2,048 tokens saved 4 ms of 85: buckets stop at 1,024.
PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024)
#: Keep points one chunk may hold to run here (rows of the delta rule: 1 + this).
MAX_KEEPS = 1


class GraphPrefill:
    """The bucketed, piecewise prefill of one chunk (see the module docstring) over a runner's ``ModelForward``.

    Args:
        fwd: the runner's forward (its layers, caches and math: ``attn_inputs``, ``attn_core``, ``gdn_inputs``...).
        scratch_slot: a state row no sequence uses (keep-point writes of a chunk without one go there).
        max_context: tokens per sequence (size of the rows buffer).
        graphs: the runner's ``graphs.CudaGraphs`` (its pool and capture), or None to run the pieces eagerly.
        buckets: the padded token counts (default ``PREFILL_BUCKETS``).
    Raises ValueError when the model's full-attention layers differ in geometry (the pieces share buffers).
    """

    def __init__(self, fwd: ModelForward, *, scratch_slot: int, max_context: int, graphs=None,
                 buckets=PREFILL_BUCKETS) -> None:
        self._f = fwd
        self._graphs = graphs
        self._scratch = scratch_slot
        self.buckets = tuple(buckets)
        layers, kinds, geo = fwd._layers, fwd._kinds, fwd._geo
        self._attn = [i for i, k in enumerate(kinds) if k != "linear"]
        shapes = {(geo[i]["hd"], geo[i]["nkv"]) for i in self._attn}
        if len(shapes) > 1:
            raise ValueError(f"full-attention layers of different shapes {shapes}")
        self._K = next((g["K"] for k, g in zip(kinds, geo) if k == "linear"), 1)
        device, dtype, T = fwd.cos_table.device, fwd.dtype, self.buckets[-1]
        hidden = layers[0].input_layernorm.weight.shape[-1]
        rot = fwd.cos_table.shape[-1]
        self._emb = torch.zeros(T, hidden, device=device, dtype=dtype)
        self._cos = torch.zeros(T, rot, device=device, dtype=fwd.cos_table.dtype)
        self._sin = torch.zeros_like(self._cos)
        self._h = torch.zeros(1, T, hidden, device=device, dtype=dtype)  # the residual stream between pieces
        self._qkv: Optional[list[torch.Tensor]] = None  # q, k, v, gate of the attention a piece ends at
        self._o: Optional[torch.Tensor] = None  # the attention's output [1, T, nq * hd]
        if self._attn:  # the buffers' shapes, from one probe token through the first attention layer's projections
            i = self._attn[0]
            probe = self._h[:, :1]
            with torch.no_grad():
                q, k, v, gate = fwd.attn_inputs(i, layers[i].self_attn, layers[i].input_layernorm(probe),
                                                self._cos[None, :1], self._sin[None, :1])
            self._qkv = [x.new_zeros(x.shape[:2] + (T,) + x.shape[3:]) for x in (q, k, v)]
            self._qkv.append(gate.new_zeros(1, T, gate.shape[-1]))
            self._o = gate.new_zeros(1, T, gate.shape[-1])
        # int64 inputs: slot, past, n, keep, last, keep row, prev_cols [K-1], ring rows [2], ring cols [2, K],
        # ring ext [2, K], then the chunk's KV rows (positions 0..start+n-1)
        K = self._K
        self._head = 6 + (K - 1) + 2 + 4 * K
        self._dev_in = torch.zeros(self._head + max_context, dtype=torch.long, device=device)
        cuda = device.type == "cuda"
        self._host_in = torch.zeros(self._head + max_context, dtype=torch.long, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        d = self._dev_in
        self._slot, self._past, self._n, self._keep, self._last, self._keep_row = (d[j:j + 1] for j in range(6))
        o = 6
        self._prev_cols = d[o:o + K - 1]
        self._ring_rows = d[o + K - 1:o + K + 1]
        self._ring_cols = d[o + K + 1:o + 3 * K + 1].view(2, K)
        self._ring_ext = d[o + 3 * K + 1:o + 5 * K + 1].view(2, K)
        self._held: dict[int, list] = {}  # bucket -> per piece (graph, output)
        self._pool = None  # a memory pool of their own: dropping these graphs frees it (the decode graphs keep theirs)
        self.capture_seconds: dict[int, float] = {}

    # ------------------------------------------------------------------ which chunks
    def bucket(self, n: int) -> Optional[int]:
        """The smallest bucket >= n tokens, or None when n is above the last."""
        return next((b for b in self.buckets if b >= n), None)

    def takes(self, seqs: list[PrefillRows]) -> bool:
        """Whether this step's chunks run here: one chunk of at most the last bucket's tokens, <= MAX_KEEPS keep
        points."""
        return len(seqs) == 1 and seqs[0].n <= self.buckets[-1] and len(seqs[0].keeps) <= MAX_KEEPS

    # ------------------------------------------------------------------ pieces
    def _piece(self, j: int, T: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Piece j at bucket T: finish attention layer ``_attn[j - 1]`` (from the attention output buffer), run
        the layers up to the next attention layer, and that layer's projections into the q/k/v/gate buffers; the
        last piece also the final norm and lm_head of the last real token.  Only tensor ops on fixed buffers.
        Returns (fp32 logits [1, V], final normed hidden [1, hidden]) for the last piece, else None."""
        f, layers = self._f, self._f._layers
        A = self._attn
        lo = A[j - 1] if j else -1
        hi = A[j] if j < len(A) else len(layers)
        if j:
            at = layers[lo].self_attn
            h = self._h[:, :T] + f.attn_output(at, self._o[:, :T], self._qkv[3][:, :T])
            h = f.mlp_block(lo, layers[lo], h)
        else:
            h = self._emb[None, :T]
        for i in range(lo + 1, hi):
            x = self._gdn(i, layers[i].linear_attn, f.ops.norm(layers[i].input_layernorm, h), T)
            h = f.mlp_block(i, layers[i], h + x)
        if hi < len(layers):
            x = f.ops.norm(layers[hi].input_layernorm, h)
            outs = f.attn_inputs(hi, layers[hi].self_attn, x, self._cos[None, :T], self._sin[None, :T])
            for buf, y in zip(self._qkv, outs):
                (buf[:, :, :T] if buf.dim() == 4 else buf[:, :T]).copy_(y)
            self._h[:, :T].copy_(h)
            return None
        self._h[:, :T].copy_(h)  # every token's hidden state (pre final norm), for the MTP drafter
        last = f._final_norm(h[0].index_select(0, self._last))
        return f._lm_head(last).float(), last

    def _gdn(self, i: int, la, x: torch.Tensor, T: int) -> torch.Tensor:
        """Gated DeltaNet layer ``i`` over the padded chunk (see the module docstring for the masking)."""
        f = self._f
        q, k, v, beta, g, z = f.gdn_inputs(i, la, x, lambda qkv: self._conv(i, qkv, T))
        pos = torch.arange(T, device=x.device)
        keep = torch.stack([pos < self._n, pos < self._keep])[:, :, None]  # [2, T, 1]: real tokens, up to the keep
        beta, g = torch.where(keep, beta, 0.0), torch.where(keep, g, 0.0)  # [2, T, HV]
        real = keep[:1, :, :, None]  # selected, not multiplied: a padded row's inf must not become NaN
        k, v = torch.where(real, k, 0.0), torch.where(real, v, 0.0)
        rec = f.rec_state[i]
        h0 = torch.where(self._past.bool()[:, None, None, None], rec.index_select(0, self._slot), 0.0)
        h0 = h0.transpose(-1, -2).expand(2, -1, -1, -1).contiguous()     # key-major, as the rule takes it
        out, state = f._chunk_rule(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                   g=g, beta=beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=False)
        rows = torch.cat([self._slot, self._keep_row])
        rec.index_copy_(0, rows, state.float().transpose(-1, -2).contiguous())
        return f.gdn_output(i, la, out[:1], z, x.dtype)

    def _conv(self, i: int, qkv: torch.Tensor, T: int) -> torch.Tensor:
        """Causal depthwise conv of the padded chunk qkv [T, C] after the K - 1 inputs before it (the slot's ring,
        zeros for a new prompt); writes the slot's ring (its last K real inputs) and the keep row's."""
        la = self._f._layers[i].linear_attn
        ring = self._f.conv_state[i]
        seg = qkv.t().to(ring.dtype)                                                  # [C, T]
        prev = ring.index_select(0, self._slot)[0].index_select(1, self._prev_cols)   # [C, K - 1]
        prev = torch.where(self._past.bool(), prev, 0.0)
        ext = torch.cat([prev, seg], dim=1)                                           # [C, T + K - 1]
        ring[self._ring_rows[:, None], :, self._ring_cols] = ext[:, self._ring_ext].permute(1, 2, 0)
        w = la.conv1d.weight
        return F.conv1d(ext[None].to(w.dtype), w, la.conv1d.bias, groups=w.shape[0])[0].t()

    # ------------------------------------------------------------------ run
    def _inputs(self, sq: PrefillRows) -> None:
        """Fill and send the int64 inputs of chunk ``sq`` (one copy; waits only for the previous one)."""
        K, n, s = self._K, sq.n, sq.start
        keep, keep_row = (sq.keeps[0] if sq.keeps else (n, self._scratch))
        cols = lambda p: [c % K for c in range(p - K, p)]  # noqa: E731 - ring columns of positions p-K..p-1
        head = ([sq.slot, int(s > 0), n, keep, n - 1, keep_row] + cols(s)[1:] + [sq.slot, keep_row]
                + cols(s + n) + cols(s + keep) + list(range(n - 1, n + K - 1)) + list(range(keep - 1, keep + K - 1)))
        rows = sq.rows.reshape(-1).cpu()
        if self._copied is not None:
            self._copied.synchronize()
        self._host_in[:self._head] = torch.tensor(head, dtype=torch.long)
        self._host_in[self._head:self._head + rows.numel()] = rows
        m = self._head + rows.numel()
        self._dev_in[:m].copy_(self._host_in[:m], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    @torch.no_grad()
    def run(self, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sq: PrefillRows) -> Optional[torch.Tensor]:
        """The prefill of one chunk (``takes``): emb [n, hidden], cos/sin [n, rot] as ``ModelForward.prefill``.
        Writes its KV and states as the packed prefill does.  Returns fp32 logits [1, V] of its last token when
        ``sq.logits``, else None.  Sets the forward's ``last_hidden`` (and, for the MTP drafter,
        ``prefill_hidden``/``prefill_cos``/``prefill_sin``)."""
        n = sq.n
        T = self.bucket(n)
        held = self.capture(T) if self._graphs is not None else None  # first use: captured with its own inputs
        self._inputs(sq)
        self._emb[:n].copy_(emb)
        self._emb[n:T].zero_()
        self._cos[:n].copy_(cos)
        self._sin[:n].copy_(sin)
        rows = self._dev_in[self._head:self._head + sq.start + n]
        out = None
        for j in range(len(self._attn) + 1):
            if held is None:
                out = self._piece(j, T)
            else:
                held[j][0].replay()
                out = held[j][1]
            if j < len(self._attn):
                i = self._attn[j]
                q, k, v, _ = self._qkv
                o = self._f.attn_core(i, q[:, :, :n], k[:, :, :n], v[:, :, :n], rows, sq.start)
                self._o[:, :n].copy_(o.transpose(1, 2).reshape(1, n, -1))
        logits, last = (x.clone() for x in out)  # graph outputs: the next replay rewrites them
        f = self._f
        f.last_hidden = last
        if f.keep_hidden:
            f.prefill_hidden, f.prefill_cos, f.prefill_sin = self._h[0, :n], self._cos[:n], self._sin[:n]
        return logits if sq.logits else None

    @torch.no_grad()
    def capture(self, T: int) -> list:
        """Capture every piece at bucket T (CUDA graphs; inputs point at the scratch slot meanwhile).  Returns
        the pieces' (graph, output) pairs."""
        if T in self._held:
            return self._held[T]
        no_rows = torch.zeros(0, dtype=torch.long)  # the pieces read no KV rows: attention runs between them
        self._inputs(PrefillRows(self._scratch, 0, T, 0, no_rows, True, ((T, self._scratch),)))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._held[T] = [self._graphs.warm_and_capture(self._piece, (j, T), warm_runs=1, pool=self._pool)
                         for j in range(len(self._attn) + 1)]
        return self._held[T]

    def capture_all(self) -> int:
        """Capture every bucket's pieces.  Returns the number of graphs held; ``capture_seconds``: seconds per
        bucket."""
        for T in self.buckets:
            t0 = time.perf_counter()
            self.capture(T)
            torch.cuda.synchronize()
            self.capture_seconds[T] = round(time.perf_counter() - t0, 2)
        return sum(len(p) for p in self._held.values())
