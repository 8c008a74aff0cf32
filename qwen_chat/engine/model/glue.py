"""The element-wise glue of one decode step, as pure functions that ``torch.compile`` can fuse.

Between the projections (which stay eager module calls, so sharded and hooked modules keep working) a decode
step is dozens of tiny element-wise ops per layer; in a CUDA graph each is still one kernel of a few
microseconds.  On CUDA the runner wraps these functions with ``torch.compile`` (Inductor fuses each into a few
Triton kernels) before capturing its graphs; on CPU they run as plain PyTorch, so the CPU parity tests check
exactly this code.  Formulas: transformers ``models/qwen3_5/modeling_qwen3_5.py`` (Qwen3_5Attention,
Qwen3_5GatedDeltaNet, torch_recurrent_gated_delta_rule, l2norm, apply_rotary_pos_emb).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from qwen_chat.engine.model import kv_quant, memory

log = logging.getLogger(__name__)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (transformers ``qwen3_5.l2norm``, aligned with fla)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding on the first ``cos.shape[-1]`` channels of ``x`` (rotate-half convention).

    x: [..., n, head_dim]; cos/sin broadcastable to [..., n, rotary_dim].  Same as transformers
    ``qwen3_5.apply_rotary_pos_emb`` for one tensor.
    """
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def add_norm(h: torch.Tensor, x: torch.Tensor, norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then the next RMSNorm: returns (h + x, norm(h + x)), both [B, hidden] in h's dtype."""
    h = h + x
    return h, norm(h)


def attn_qkv(qg: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, q_norm: torch.nn.Module,
             k_norm: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, kv_heads: int,
             cache_dtype: torch.dtype):
    """Split the gated query and apply q/k RMSNorm and rotary for one token per row (no cache write).

    qg: [B, 2 * nq * hd] (q_proj output: per head [query | gate]); kx, vx: [B, nkv * hd]; cos/sin: [B, rot].
    Returns q [B, nkv, nq // nkv, hd] (query heads grouped by KV head), gate [B, nq * hd], and k, v
    [B, nkv, hd] in ``cache_dtype`` (what goes into the paged KV cache).
    """
    # (the last dim split with ``unflatten``, not ``view(B, ...)``: a view through the row dim makes TorchDynamo
    # check its contiguity, which for one row specialises the compiled graph to one row: ``compiled_once``)
    q, gate = torch.chunk(qg.unflatten(-1, (-1, 2 * head_dim)), 2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    q = apply_rotary(q_norm(q), c, s)
    k = apply_rotary(k_norm(kx.unflatten(-1, (-1, head_dim))), c, s)
    return (q.unflatten(1, (kv_heads, -1)), gate.flatten(1), k.to(cache_dtype),
            vx.unflatten(-1, (-1, head_dim)).to(cache_dtype))


def attn_pre(qg: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, q_norm: torch.nn.Module,
             k_norm: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, kv_block: torch.Tensor, kv_offset: torch.Tensor, head_dim: int,
             kv_heads: int, k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None):
    """``attn_qkv``, then write k, v into the paged KV cache at (kv_block[b], kv_offset[b]) in place (an FP8
    cache with its scales: ``kv_quant.write``).  The write indexes the cache tensor itself, not a view of it, so
    that compiled it stays one small scatter (through a reshaped view Inductor copies the whole cache).

    k_cache/v_cache: [blocks, block_tokens, nkv, hd]; k_scale/v_scale: [blocks, block_tokens, nkv] fp32 or
    None; kv_block, kv_offset: int64 [B]; the rest as ``attn_qkv``.  Returns q [B, nkv, nq // nkv, hd] and gate
    [B, nq * hd].
    """
    stored = k_cache.dtype if k_scale is None else qg.dtype  # (quantised by the write)
    q, gate, k, v = attn_qkv(qg, kx, vx, q_norm, k_norm, cos, sin, head_dim, kv_heads, stored)
    kv_quant.write(k_cache, k_scale, (kv_block, kv_offset), k)
    kv_quant.write(v_cache, v_scale, (kv_block, kv_offset), v)
    return q, gate


def attn_core(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
              pos: torch.Tensor, scale: float, k_scale: Optional[torch.Tensor] = None,
              v_scale: Optional[torch.Tensor] = None, start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention of each row over its own sequence's positions 0..pos[b], read from the paged cache.

    q: [B, nkv, G, hd] (G query heads share a KV head); caches [blocks, block_tokens, nkv, hd]; blocks: int64
    [B, nb], the first nb entries of each row's block table (nb * block_tokens >= max(pos) + 1, static per
    graph).  Written as broadcast-multiply-and-sum so that, compiled, the cache blocks are loaded indirectly
    through the table (no gathered copy of the cache).  An FP8 cache is dequantised with its scales
    (``k_scale``/``v_scale``, as ``attn_pre``) as it is loaded.  ``start``: int64 [B], each row's first
    position (earlier ones are not attended to: the MTP layer's context, ``mtp.MtpDrafter``); None: 0.  fp32
    scores and softmax.  Returns [B, nkv, G, hd].
    """
    keys = kv_quant.read(k_cache, k_scale, blocks, torch.float32).flatten(1, 2)         # [B, ctx, nkv, hd]
    vals = kv_quant.read(v_cache, v_scale, blocks, torch.float32).flatten(1, 2)
    ctx = keys.shape[1]
    scores = (q.float()[:, None] * keys[:, :, :, None]).sum(-1) * scale                 # [B, ctx, nkv, G]
    span = torch.arange(ctx, device=q.device)[None, :]
    hidden = span > pos[:, None]                                                         # [B, ctx]
    if start is not None:
        hidden = hidden | (span < start[:, None])
    probs = torch.softmax(scores.masked_fill(hidden[:, :, None, None], float("-inf")), dim=1)
    return (probs[..., None] * vals[:, :, :, None]).sum(1).to(q.dtype)


def attn_post(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Output gate of Qwen3.5 attention: o [B, nkv, groups, hd] -> [B, nq * hd] * sigmoid(gate)."""
    return o.reshape(gate.shape) * torch.sigmoid(gate)


def gdn_step(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_buf: torch.Tensor,
             rec_buf: torch.Tensor, slot_idx: torch.Tensor, pos: torch.Tensor, conv_w: torch.Tensor,
             A_log: torch.Tensor, dt_bias: torch.Tensor, norm: torch.nn.Module, activation: str, key_dim: int,
             dk: int, dv: int) -> torch.Tensor:
    """One Gated DeltaNet decode token per row, from the projections to the gated RMSNorm; updates the slots'
    conv and recurrent state in place.

    qkv: [B, C] (in_proj_qkv output, C = 2 * key_dim + value_dim); z: [B, value_dim]; b, a: [B, HV];
    conv_buf: [slots, C, K] ring of the last inputs (model dtype): ``conv_buf[s, c, p % K]`` is the input at
    position p (prefill writes it: ``forward.ModelForward._conv_prefill``); rec_buf: [slots, HV, dv, dk] fp32
    recurrent state S^T (value-major, so each value row is one contiguous reduction: the whole update is one
    pass); slot_idx: int64 [B] (rows with the same slot, i.e. padding rows, must not matter); pos: int64 [B],
    this token's position (the slot's length before it); conv_w: [C, K] depthwise taps; A_log, dt_bias: [HV].  Returns core
    [B, value_dim] in the model dtype.

    Maths: causal conv1d over [inputs at pos-K+1 .. pos-1, this one] + activation; q, k l2-normalised (fp32),
    q scaled by dk^-1/2; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias); S <- S * exp(g);
    S <- S + k (beta (v - S^T k))^T; o = S^T q; then norm(o, z) (gated RMSNorm).  The products are written as
    broadcast-and-sum (as transformers' torch_recurrent_gated_delta_rule) so Inductor can fuse the state
    gather, decay, update and both reductions instead of calling batched matmuls on materialised copies.
    ``gdn.gdn_decode`` is the same step as one Triton kernel.
    """
    B, C = qkv.shape
    K = conv_w.shape[-1]
    cols = torch.remainder(pos[:, None] - (K - 1) + torch.arange(K - 1, device=pos.device), K)     # [B, K-1]
    prev = conv_buf[slot_idx].gather(-1, cols[:, None, :].expand(B, C, K - 1))                    # [B, C, K-1]
    x = qkv.to(conv_buf.dtype)
    window = torch.cat([prev, x[:, :, None]], dim=-1)                                             # [B, C, K]
    conv_buf[slot_idx, :, torch.remainder(pos, K)] = x
    mixed = ACT2FN[activation]((window.float() * conv_w.float()).sum(-1)).to(qkv.dtype)
    q, k, v = torch.split(mixed, [key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    hv = b.shape[-1]
    rep = hv // (key_dim // dk)
    q = l2norm(q.float().view(B, -1, dk)).repeat_interleave(rep, dim=1) * dk ** -0.5   # [B, HV, dk]
    k = l2norm(k.float().view(B, -1, dk)).repeat_interleave(rep, dim=1)
    v = v.float().view(B, hv, dv)
    beta = b.sigmoid().float()
    decay = (-A_log.float().exp() * F.softplus(a.float() + dt_bias)).exp()               # [B, HV]
    state = rec_buf[slot_idx] * decay[:, :, None, None]                                  # [B, HV, dv, dk]
    kv_mem = (state * k[:, :, None, :]).sum(dim=-1)                                      # [B, HV, dv]
    delta = (v - kv_mem) * beta[:, :, None]
    state = state + delta[:, :, :, None] * k[:, :, None, :]
    o = (state * q[:, :, None, :]).sum(dim=-1)
    rec_buf[slot_idx] = state
    return norm(o.to(qkv.dtype).reshape(-1, dv), z.reshape(-1, dv)).reshape(B, -1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, act: torch.nn.Module) -> torch.Tensor:
    """act(gate) * up, the middle of Qwen3_5MLP (gate/up/down projections stay module calls)."""
    return act(gate) * up


GLUE = {"add_norm": add_norm, "attn_qkv": attn_qkv, "attn_pre": attn_pre, "attn_core": attn_core, "attn_post": attn_post,
        "gdn_step": gdn_step, "swiglu": swiglu}


def in_row_groups(core: Callable) -> Callable:
    """``attn_core`` (or its compiled form) called on groups of ``memory.attention_rows`` rows, so that its
    fp32 scores stay within ``memory.SCORES_BYTES_MAX`` at any batch and window (each row's result is the same
    as in one call: rows do not mix).  Same arguments and result as ``attn_core``."""

    def run(q, k_cache, v_cache, blocks, pos, scale, k_scale=None, v_scale=None, start=None):
        B = q.shape[0]
        rows = memory.attention_rows(q.shape[1] * q.shape[2], blocks.shape[1] * k_cache.shape[1])
        if rows >= B:
            return core(q, k_cache, v_cache, blocks, pos, scale, k_scale, v_scale, start)
        return torch.cat([core(q[s:s + rows], k_cache, v_cache, blocks[s:s + rows], pos[s:s + rows], scale, k_scale,
                               v_scale, None if start is None else start[s:s + rows]) for s in range(0, B, rows)])

    return run


#: Per glue function, the positions of its per-row tensor arguments (dim 0: one row per sequence of the
#: step) and, for ``attn_core``, of the one whose dim 1 is the context bucket's blocks (``compiled_once``).
ROW_ARGS: dict[str, tuple[int, ...]] = {
    "add_norm": (0, 1), "attn_qkv": (0, 1, 2, 5, 6), "attn_pre": (0, 1, 2, 5, 6, 9, 10), "attn_core": (0, 3, 4, 8),
    "attn_post": (0, 1), "swiglu": (0, 1)}
WINDOW_ARG = {"attn_core": 3}


def compiled_once(fn: Callable, rows: Sequence[int], window: Optional[int] = None) -> Callable:
    """``fn`` under ``torch.compile``, traced once for every row count (and every width of argument
    ``window``'s dim 1: ``attn_core``'s blocks, one per context bucket).

    Left to itself TorchDynamo compiles a glue function twice: for the first shapes it sees (the batch-1 decode
    graph, whose row count 1 it specialises), then again with the shapes that changed marked dynamic; the two
    compiles of the decode step's glue took about 25 s each of a cold start on an H200 (docs/performance.md,
    start-up by phase).  Here dim 0 of the arguments at positions ``rows`` (per-row tensors) is marked unbacked
    before the call (a size the graph never specialises, 1 included) and ``window``'s dim 1 dynamic, under
    PyTorch's size-oblivious mode (``backed_size_oblivious``), so one graph serves every batch and window.
    Checked against the eager glue for 1-4 rows and two windows (tests/engine/test_glue_compile.py).  When a call
    fails this way (a PyTorch that cannot trace the function so), the function is compiled from then on as
    TorchDynamo would on its own, with a warning in the log, rather than the start-up failing (an error of that
    compile too propagates).  Same arguments and results as ``fn``; the wrapper costs a few microseconds per
    call, paid when a CUDA graph is captured (and per call where the glue runs outside graphs)."""
    from torch.fx.experimental import _config as fx_config

    compiled = torch.compile(fn, fullgraph=True)
    marked = set(rows) | ({window} if window is not None else set())
    state = {"plain": None}  # the fallback, once a marked call failed

    def marked_call(args):
        # the marks go on aliases (views of the same storage), not on the caller's tensors: a marked tensor
        # passed on to another compiled function would carry its marks there
        args = [a[...] if i in marked and isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        with fx_config.patch(backed_size_oblivious=True):
            for i in rows:
                if i < len(args) and isinstance(args[i], torch.Tensor):
                    torch._dynamo.decorators.mark_unbacked(args[i], 0)
            if window is not None:
                torch._dynamo.mark_dynamic(args[window], 1)
            return compiled(*args)

    def run(*args):
        if state["plain"] is not None:
            return state["plain"](*args)
        try:
            return marked_call(args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - compiled the usual way instead (logged); its errors propagate
            log.warning("%s: compiling once for every batch failed (%s: %s); compiled per batch shape instead",
                        getattr(fn, "__name__", fn), type(exc).__name__, (str(exc).splitlines() or [""])[0][:200])
            state["plain"] = torch.compile(fn, fullgraph=True)
            return state["plain"](*args)
    return run


def glue_functions(compile: bool) -> dict[str, Callable]:
    """The glue functions, wrapped with ``torch.compile`` when ``compile`` is true (``compiled_once``: one
    graph per function for every batch and context bucket); ``attn_core`` runs in row groups
    (``in_row_groups``) either way.  Compilation happens lazily on the first call."""
    if not compile:
        fns = dict(GLUE)
    else:
        fns = {name: compiled_once(GLUE[name], rows, WINDOW_ARG.get(name)) for name, rows in ROW_ARGS.items()}
        # (traced for one row with its rows unbacked, gdn_step's indexed state write gave other rows wrong values
        # on the CPU; CUDA decodes with the Triton kernel instead: ``gdn.gdn_decode``)
        fns["gdn_step"] = torch.compile(GLUE["gdn_step"], fullgraph=True)
    fns["attn_core"] = in_row_groups(fns["attn_core"])
    return fns
