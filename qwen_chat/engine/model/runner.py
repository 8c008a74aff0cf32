"""The model runner: our own Qwen3.5 text-decoder forward over static, preallocated per-slot state.

A *slot* holds one running sequence: its KV cache in the 8 (full config) gated full-attention layers, its
depthwise-conv state and fp32 recurrent state in the 24 Gated DeltaNet layers, its length and its M-RoPE
delta.  ``prefill`` fills one slot from a prompt (text and images); ``decode`` advances any set of slots by one
token in one batched forward; ``free`` releases a slot.  Slots are independent, so sequences of different
lengths join and leave the batch at any step (continuous batching is the scheduler's job).

The maths follows ``transformers/models/qwen3_5/modeling_qwen3_5.py`` (Qwen3_5Attention,
Qwen3_5GatedDeltaNet, torch_recurrent_gated_delta_rule, Qwen3_5DecoderLayer), but every projection, norm and
MLP is called through the model's own submodules (``layer.linear_attn.in_proj_qkv(x)``, ``layer.mlp(x)`` or, in
decode, ``mlp.gate_proj``/``up_proj``/``act_fn``/``down_proj``, ``model.lm_head(x)``...).  Under DeepSpeed AutoTP those submodules are sharded and communicate internally; under
ZeRO-3 their forward hooks gather the parameters.  Local head counts are derived from the actual output widths
(probed once at start-up), so the same code runs unsharded, tensor-parallel and ZeRO-3.

Projections that read the same input (a layer's token-mixer input projections; the MLP's gate and up) are
run as one GEMM over a fused weight when each computes ``x @ weight^T`` on a local weight: plain ``nn.Linear``
modules and DeepSpeed AutoTP's column-parallel layers (``fuse_linears``; the modules keep views of it, so no
memory is added; hooked or ZeRO-3 modules are left alone).  Under tensor parallelism the decode step runs the
row-parallel projections itself (local GEMV, then the all-reduce of ``collectives.TensorParallelComm``, fused with
the residual add and the next RMSNorm where symmetric memory works); prefill calls the sharded modules.

On CUDA (not ZeRO-3) the decode step is captured in CUDA graphs, one per (batch size, context bucket) of a
ladder, with static input/output buffers; a batch is padded up to the ladder size with rows that point at a
scratch slot.  The prefill of a prompt of up to ``max(PREFILL_BUCKETS)`` tokens replays a graph too, padded at
the end to its bucket (the padding is masked out of every state the slot keeps: ``_prefill_forward``).  The
element-wise glue between the projections (``qwen_chat.engine.model.glue``) is fused with ``torch.compile``
there.  On CPU the same steps run eagerly.  Measured speed: docs/performance.md.

Run the CPU parity tests with ``python -m pytest -q tests/engine/test_runner.py``.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from qwen_chat.chat_types import ContextTooLong, InvalidInput
from qwen_chat.engine.model import gdn, gemv
from qwen_chat.engine.parallel.collectives import TensorParallelComm, tp_comm_for
from qwen_chat.engine.model.glue import apply_rotary, conv_ring_from_tail, glue_functions, l2norm
from qwen_chat.engine.serving.requests import PreparedPrompt
from qwen_chat.engine.parallel.sharding import (GatheredColumnLinear, VocabParallelEmbedding, is_deepspeed_layer,
                                       row_parallel_weight)

log = logging.getLogger(__name__)

#: Batch sizes for which a decode graph is captured; a batch of B runs in the smallest size >= B.
BATCH_LADDER = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
#: Smallest context bucket (tokens) of the decode attention; buckets double up to ``max_context``.
MIN_CONTEXT_BUCKET = 512
#: Prompt lengths (tokens) for which the prefill is captured in a CUDA graph; a prompt of L tokens runs padded to
#: the smallest bucket >= L (buckets above ``max_context`` are dropped; longer prompts run eagerly).  Steps of
#: at most 1.5x above 256 tokens bound the padding's extra GPU work.  None above 2048: measured on one H200
#: (2026-11-30, docs/performance.md) a 2,500-token prompt took 116 ms padded to a 3,072 graph against 100 ms
#: eagerly, and 4,000 tokens 155 ms either way, while 1,000 tokens took 44 ms in a graph against 136 ms eagerly.
PREFILL_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536, 2048)


def _resolve_chunk_rule() -> tuple[Callable, str]:
    """Pick the chunked gated-delta-rule implementation for prefill: fla-core's Triton kernel if importable,
    else transformers' reference ``torch_chunk_gated_delta_rule``.  Both take q, k, v [B, L, H, D], g, beta
    [B, L, H] and return (out [B, L, H, Dv], final_state [B, H, Dk, Dv])."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore

        return chunk_gated_delta_rule, "fla.chunk_gated_delta_rule"
    except Exception:  # fla missing or broken on this host: the reference implementation is exact, only slower
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        return torch_chunk_gated_delta_rule, "transformers.torch_chunk_gated_delta_rule"


def _is_plain_linear(m: torch.nn.Module) -> bool:
    """A bias-free ``torch.nn.Linear`` itself (not a sharded subclass or replacement) without forward hooks or
    accelerate's ``_hf_hook`` (its device-map/offload wrapper, which moves the weight on call): its weight
    may be read directly."""
    return (type(m) is torch.nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
            and not hasattr(m, "_hf_hook"))


def _is_local_linear(m: torch.nn.Module) -> bool:
    """A projection whose forward is exactly ``x @ m.weight^T`` on this rank's weight [out, in]: a plain
    ``nn.Linear`` (``_is_plain_linear``) or DeepSpeed AutoTP's column-parallel ``LinearLayer`` without bias,
    gathered output or overlapped communication (its forward then only multiplies by the local rows;
    deepspeed/module_inject/layers.py, DeepSpeed 0.19.8), without hooks."""
    if _is_plain_linear(m):
        return True
    w = getattr(m, "weight", None)
    return (is_deepspeed_layer(m, "LinearLayer") and getattr(m, "bias", None) is None
            and not getattr(m, "gather_output", False) and not getattr(type(m), "tp_overlap_comm", False)
            and not m._forward_hooks and not m._forward_pre_hooks and isinstance(w, torch.Tensor) and w.dim() == 2)


def fuse_linears(mods: Sequence[torch.nn.Module]) -> Optional[tuple[torch.Tensor, list[int]]]:
    """Put the weights of projections that read the same input into one matrix, so one GEMM replaces several.

    Applies only when every module computes ``x @ weight^T`` on a local weight (``_is_local_linear``: a plain
    ``torch.nn.Linear`` without bias or hooks, or DeepSpeed AutoTP's column-parallel ``LinearLayer``), all on one
    (real) device and dtype with the same input width (not to hooked or ZeRO-3 modules, nor to
    accelerate-offloaded ones).  The fused matrix
    [sum(out_features), in_features] is built once and each module's ``weight`` is rebound to its row block (a
    view), so the model keeps working unchanged and no memory is added; called again on already-fused modules
    it returns the same storage.

    Returns ``(weight, out_sizes)`` (``F.linear(x, weight).split(out_sizes, -1)`` equals ``[m(x) for m in mods]``)
    or None when the modules cannot be fused.
    """
    if len(mods) < 2 or not all(_is_local_linear(m) for m in mods):
        return None
    ws = [m.weight for m in mods]
    if (len({(w.device, w.dtype, w.shape[1]) for w in ws}) != 1 or ws[0].device.type == "meta"
            or not all(w.is_contiguous() for w in ws)):
        return None
    sizes = [int(w.shape[0]) for w in ws]
    n_in = int(ws[0].shape[1])
    storage = ws[0].untyped_storage()
    offsets = [ws[0].storage_offset() + n_in * sum(sizes[:j]) for j in range(len(ws))]
    with torch.no_grad():
        if all(w.untyped_storage().data_ptr() == storage.data_ptr() and w.storage_offset() == o
               for w, o in zip(ws, offsets)):  # fused before (another runner on the same model)
            fused = ws[0].new_empty(0).set_(storage, offsets[0], (sum(sizes), n_in), (n_in, 1))
            return fused, sizes
        fused = torch.cat([w.detach() for w in ws], dim=0)
        start = 0
        for m, n in zip(mods, sizes):
            m.weight = torch.nn.Parameter(fused[start:start + n], requires_grad=m.weight.requires_grad)
            start += n
    return fused, sizes


def _is_zero3(model: torch.nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 has partitioned the parameters (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


class ModelRunner:
    """Qwen3.5 forward over static per-slot state (see the module docstring).

    Args:
        model: a loaded ``transformers`` ``Qwen3_5ForConditionalGeneration`` (plain, AutoTP-sharded or ZeRO-3),
            in eval mode, on ``device``.
        num_slots: number of sequences that can be live at once.
        max_context: tokens per sequence (prompt + reply); the KV cache is allocated for this length.
        device: torch device of the model.
        dtype: dtype of activations and KV cache; default: the dtype of the model's parameters.
        use_cuda_graphs: capture the decode step in CUDA graphs; None = on for CUDA unless ZeRO-3.
        compile_glue: fuse the decode step's element-wise glue with ``torch.compile`` (qwen_chat.engine.model.glue);
            None = same as ``use_cuda_graphs``.
        fast_gemv: run the projections of batches of <= ``gemv.MAX_ROWS`` rows through the Triton kernels of
            ``qwen_chat.engine.model.gemv`` (plain ``nn.Linear`` modules only); None = same as ``use_cuda_graphs``
            when Triton is importable.
        comm: the ``collectives.TensorParallelComm`` for the decode step's all-reduces under tensor parallelism;
            None = one from ``collectives.tp_comm_for`` when the model holds row-parallel layers (collective:
            every rank builds its runner at the same time).
        gdn_kernel: run each Gated DeltaNet decode token as one Triton kernel (``gdn.gdn_decode``) instead of the
            glue's ``gdn_step``; None = on with ``fast_gemv`` where ``gdn.supports`` every layer.  True needs
            ``gdn.supports`` (CUDA, or Triton's interpreter on CPU for tests), else ValueError.

    Attributes: ``num_slots``, ``max_context``, ``vocab_size`` (logits width), ``impl`` (dict: which
    implementation each op resolved to, for the start-up log).

    State memory per slot: 8 layers x 2 x kv_heads x max_context x head_dim x dtype bytes of KV cache
    (32 KiB per token of context for the full bf16 config) plus 24 x 32 x 128 x 128 x 4 bytes = 48 MiB of
    recurrent state (stored value-major, S^T [v_heads, dv, dk]).  One extra scratch slot absorbs the padding rows of graph-padded batches.
    """

    def __init__(self, model, *, num_slots: int, max_context: int, device, dtype=None,
                 use_cuda_graphs: Optional[bool] = None, compile_glue: Optional[bool] = None,
                 fast_gemv: Optional[bool] = None, comm: Optional[TensorParallelComm] = None,
                 gdn_kernel: Optional[bool] = None):
        if num_slots < 1 or max_context < 1:
            raise ValueError(f"num_slots and max_context must be >= 1 (got {num_slots}, {max_context})")
        self.model = model
        self.device = torch.device(device)
        self.num_slots = int(num_slots)
        self.max_context = int(max_context)
        zero3 = _is_zero3(model)
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda" and not zero3
        if use_cuda_graphs and (self.device.type != "cuda" or zero3):
            raise ValueError("CUDA graphs need a CUDA device and cannot be used under ZeRO-3")
        self.use_cuda_graphs = bool(use_cuda_graphs)
        if compile_glue is None:
            compile_glue = self.use_cuda_graphs
        self._glue = glue_functions(bool(compile_glue))
        self._fused_attention = bool(compile_glue)

        core = model.model
        lm = core.language_model
        self.config = model.config
        tc = model.config.text_config
        self.dtype = dtype or lm.embed_tokens.weight.dtype
        self.vocab_size = int(tc.vocab_size)
        self.image_token_id = int(model.config.image_token_id)
        self._core, self._lm = core, lm
        self._layers = list(lm.layers)
        self._embed, self._final_norm, self._lm_head = lm.embed_tokens, lm.norm, model.lm_head
        self._chunk_rule, chunk_name = _resolve_chunk_rule()
        self.impl = {"chunk_delta_rule": chunk_name, "recurrent_delta_rule": "torch", "conv1d": "torch",
                     "attention": "torch.sdpa", "cuda_graphs": self.use_cuda_graphs,
                     "decode_glue": "torch.compile" if compile_glue else "eager"}

        self._groups: list[dict[str, list]] = []
        self._fused: list[dict[str, tuple[torch.Tensor, list[int]]]] = []
        for layer in self._layers:
            if hasattr(layer, "linear_attn"):
                la = layer.linear_attn
                groups = {"mix": [la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a]}
            else:
                at = layer.self_attn
                groups = {"mix": [at.q_proj, at.k_proj, at.v_proj]}
            groups["mlp"] = [layer.mlp.gate_proj, layer.mlp.up_proj]
            self._groups.append(groups)
            self._fused.append({} if zero3 else {k: f for k, mods in groups.items()
                                                 if (f := fuse_linears(mods)) is not None})
        self.impl["fused_projection_groups"] = sum(len(f) for f in self._fused)
        if fast_gemv is None:
            fast_gemv = self.use_cuda_graphs and gemv.triton is not None
        if fast_gemv and (self.device.type != "cuda" or gemv.triton is None):
            raise ValueError("fast_gemv needs a CUDA device and Triton")
        self._fast_gemv = bool(fast_gemv)
        # Tensor parallel: the all-reduce of the row-parallel projections and the vocabulary-split embedding and
        # the all-gather of the split lm_head run through ``self._comm`` in decode (symmetric memory when it works).
        self._comm = comm if comm is not None else (None if zero3 else tp_comm_for(model, self.device, self.dtype))
        # Single projections the decode step runs itself: id(module) -> (this rank's weight, how to finish:
        # None, "all_reduce" for row-parallel layers, "all_gather" for the vocabulary-split lm_head).
        singles = [model.lm_head]
        for layer in self._layers:
            mixer = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj
            singles += [mixer, layer.mlp.down_proj]
        self._direct: dict[int, tuple[torch.Tensor, Optional[str]]] = {}
        for m in ([] if zero3 else singles):
            if _is_plain_linear(m):
                self._direct[id(m)] = (m.weight, None)
            elif self._comm is not None and (w := row_parallel_weight(m)) is not None:
                self._direct[id(m)] = (w, "all_reduce")
            elif self._comm is not None and isinstance(m, GatheredColumnLinear):
                self._direct[id(m)] = (m.weight_rows, "all_gather")
        self.impl["projections"] = "triton gemv (<= %d rows)" % gemv.MAX_ROWS if self._fast_gemv else "torch"
        self.impl["tp_all_reduce"] = self._comm.kind if self._comm is not None else None
        # Under TP with symmetric memory: each row-parallel projection writes its partial result into the comm's
        # staging slot and one kernel does all-reduce + residual add + the next RMSNorm (collectives
        # .all_reduce_add_norm), when every layer qualifies (all or none, so every step ends with the reduction
        # that carries the end barrier).
        norms = [lm.norm] + [n for layer in self._layers
                             for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        rowpar = [self._direct.get(id(m), (None, None))[1] == "all_reduce" for m in singles[1:]]
        self._fused_ar = (self._comm is not None and self._fast_gemv and self.use_cuda_graphs
                          and self._comm.fused_rows(tc.hidden_size) > 0 and all(rowpar)
                          and isinstance(self._embed, VocabParallelEmbedding)
                          and all(type(n).__name__ == "Qwen3_5RMSNorm" and hasattr(n, "eps") for n in norms))
        self._step_fused = False  # set while a decode step that uses it is traced or run
        self.impl["tp_fused_all_reduce_norm"] = self._fused_ar
        self._silu_mlp = getattr(tc, "hidden_act", None) == "silu"

        self._build_state(tc)
        # The Gated DeltaNet decode token as one Triton kernel (gdn.gdn_decode) where it applies to every layer.
        gdn_ok = not zero3 and all(
            gdn.supports(self.conv_state[i], self.rec_state[i], g["dk"], g["dv"],
                         self._layers[i].linear_attn.activation)
            and type(self._layers[i].linear_attn.norm).__name__ == "Qwen3_5RMSNormGated"
            for i, g in enumerate(self._geo) if self._kinds[i] == "linear")
        if gdn_kernel and not gdn_ok:
            raise ValueError("gdn_kernel needs Triton, CUDA (or TRITON_INTERPRET=1), SiLU, Qwen3_5RMSNormGated and "
                             "power-of-two head dims")
        self._gdn_kernel = gdn_ok and (self._fast_gemv if gdn_kernel is None else bool(gdn_kernel))
        self.impl["gdn_decode"] = ("triton (one kernel)" if self._gdn_kernel
                                   else "torch.compile" if compile_glue else "eager")
        # M-RoPE for decode: text tokens have equal t/h/w positions, so cos/sin depend on one index only.
        # Table built with the model's own rotary module over positions 0..max_context-1 (plus the largest
        # shift a decode position can take: rope deltas are <= 0 for images, so max_context suffices).
        pos = torch.arange(self.max_context, device=self.device).view(1, 1, -1).expand(3, 1, -1)
        probe = torch.zeros(1, 1, tc.hidden_size, device=self.device, dtype=self.dtype)
        cos, sin = lm.rotary_emb(probe, pos)
        self._cos_table, self._sin_table = cos[0].contiguous(), sin[0].contiguous()  # [T, rotary_dim]
        self._ctx_range = torch.arange(self.max_context, device=self.device)

        self.lengths = [0] * (self.num_slots + 1)      # tokens in each slot's cache (python ints)
        self.rope_deltas = [0] * (self.num_slots + 1)  # M-RoPE position shift of each slot
        self._active = [False] * (self.num_slots + 1)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._prefill_out: dict[int, torch.Tensor] = {}
        self.impl["prefill"] = "cuda graphs (bucketed)" if self.use_cuda_graphs else "eager"
        if self.use_cuda_graphs:
            self._alloc_static_buffers()
        log.info("ModelRunner: %d slots x %d tokens, dtype %s, impl %s", self.num_slots, self.max_context,
                 self.dtype, self.impl)

    # ------------------------------------------------------------------ state
    @torch.no_grad()
    def _build_state(self, tc) -> None:
        """Probe local widths through the real (possibly sharded) submodules and allocate the slot state."""
        S = self.num_slots + 1  # + scratch slot for padding rows
        T = self.max_context
        x = torch.zeros(1, tc.hidden_size, device=self.device, dtype=self.dtype)
        self._kinds: list[str] = []
        self._geo: list[dict] = []
        self.k_cache: dict[int, torch.Tensor] = {}
        self.v_cache: dict[int, torch.Tensor] = {}
        self.conv_state: dict[int, torch.Tensor] = {}
        self.rec_state: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self._layers):
            if hasattr(layer, "linear_attn"):
                la = layer.linear_attn
                dk, dv, K = la.head_k_dim, la.head_v_dim, la.conv_kernel_size
                conv_dim = la.in_proj_qkv(x).shape[-1]
                value_dim = la.in_proj_z(x).shape[-1]
                key_dim = (conv_dim - value_dim) // 2
                geo = dict(dk=dk, dv=dv, K=K, conv_dim=conv_dim, key_dim=key_dim, value_dim=value_dim,
                           nk=key_dim // dk, nv=value_dim // dv)
                w = la.conv1d.weight
                if w.numel() == 0 or la.A_log.numel() == 0:
                    raise RuntimeError(
                        "Gated DeltaNet conv1d/A_log are partitioned (ZeRO-3): raise "
                        "stage3_param_persistence_threshold above their size so they stay resident")
                if w.shape[0] != conv_dim or la.A_log.numel() != geo["nv"] or la.dt_bias.numel() != geo["nv"]:
                    raise RuntimeError(
                        f"layer {i}: conv1d/A_log/dt_bias ({w.shape[0]}, {la.A_log.numel()}) do not match the "
                        f"projection widths ({conv_dim}, {geo['nv']} value heads): unsupported sharding")
                self._kinds.append("linear")
                # ring of the last K conv inputs per channel (kernels.gdn_step)
                self.conv_state[i] = torch.zeros(S, conv_dim, K, device=self.device, dtype=self.dtype)
                # value-major S^T (see kernels.gdn_step)
                self.rec_state[i] = torch.zeros(S, geo["nv"], dv, dk, device=self.device, dtype=torch.float32)
            else:
                at = layer.self_attn
                hd = at.head_dim
                nq = at.q_proj(x).shape[-1] // (2 * hd)
                nkv = at.k_proj(x).shape[-1] // hd
                geo = dict(hd=hd, nq=nq, nkv=nkv, groups=nq // nkv, scale=at.scaling)
                self._kinds.append("full")
                self.k_cache[i] = torch.zeros(S, nkv, T, hd, device=self.device, dtype=self.dtype)
                self.v_cache[i] = torch.zeros(S, nkv, T, hd, device=self.device, dtype=self.dtype)
            self._geo.append(geo)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")

    def free(self, slot: int) -> None:
        """Release ``slot``; its state is overwritten by the next prefill (no memory is returned)."""
        self._check_slot(slot)
        self._active[slot] = False
        self.lengths[slot] = 0
        self.rope_deltas[slot] = 0

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, slot: int, prompt: PreparedPrompt, pad_to: Optional[int] = None) -> torch.Tensor:
        """Run the whole prompt through the model into ``slot`` (replacing whatever it held).

        Images: features from the model's own vision tower (``model.model.get_image_features``) replace the
        embeddings at the image-pad positions; M-RoPE positions from ``model.model.get_rope_index``, whose
        delta is kept for the slot's decode positions.

        With CUDA graphs a prompt of L <= max(``prefill_buckets()``) tokens replays the graph of the smallest
        bucket >= L: the prompt is padded at the end and the padding changes nothing the slot keeps (see
        ``_prefill_forward``).  ``pad_to`` forces that padded form eagerly (tests compare it with the unpadded
        one); it must be >= the prompt length and <= ``max_context``.

        Returns: fp32 logits [vocab_size] of the last prompt position.
        Raises: ContextTooLong if the prompt does not fit ``max_context``; InvalidInput for an empty prompt, token
        ids outside the embedding table, or a pad-token count that does not match the image features;
        ValueError for a ``pad_to`` outside L..max_context.
        """
        self._check_slot(slot)
        ids = prompt.input_ids.to(self.device, torch.long).reshape(-1)
        L = int(ids.numel())
        if L == 0:
            raise InvalidInput("empty prompt")
        if L >= self.max_context:
            raise ContextTooLong(f"prompt of {L} tokens does not fit the context of {self.max_context} tokens "
                                 "(one position is needed for the reply)", L, self.max_context)
        if pad_to is not None and not L <= pad_to <= self.max_context:
            raise ValueError(f"pad_to must be in {L}..{self.max_context} (got {pad_to})")
        lo, hi = int(ids.min()), int(ids.max())  # an out-of-range id would be a device-side assert on CUDA
        if lo < 0 or hi >= self._embed.num_embeddings:
            raise InvalidInput(f"prompt token ids must be in 0..{self._embed.num_embeddings - 1} (got {lo}..{hi})")
        if prompt.pixel_values is not None and prompt.image_grid_thw is None:
            raise InvalidInput("pixel_values given without image_grid_thw")
        self._active[slot] = False
        emb = self._embed(ids[None]).to(self.dtype)  # [1, L, H]
        delta = 0
        if prompt.pixel_values is not None:
            grid = prompt.image_grid_thw.to(self.device, torch.long)
            out = self._core.get_image_features(prompt.pixel_values.to(self.device), grid)
            feats = out.pooler_output if hasattr(out, "pooler_output") else out
            if isinstance(feats, (list, tuple)):
                feats = torch.cat(list(feats), dim=0)
            mask = ids == self.image_token_id
            if int(mask.sum()) != feats.shape[0]:
                raise InvalidInput(f"prompt has {int(mask.sum())} image-pad tokens but the images give "
                                   f"{feats.shape[0]} features")
            emb[0, mask] = feats.to(self.dtype)
            mm = prompt.mm_token_type_ids
            mm = (ids == self.image_token_id).long() if mm is None else mm.to(self.device, torch.long).reshape(-1)
            pos, deltas = self._core.get_rope_index(ids[None], mm_token_type_ids=mm[None], image_grid_thw=grid)
            pos = pos.to(self.device)
            delta = int(deltas.reshape(-1)[0])
        else:
            pos = torch.arange(L, device=self.device).view(1, 1, -1).expand(3, 1, -1)
        cos, sin = self._lm.rotary_emb(emb, pos)  # [1, L, rotary_dim]
        bucket = self._prefill_bucket(L) if pad_to is None else None
        if bucket is not None:
            logits = self._prefill_graph(slot, emb, cos, sin, L, bucket)
        else:
            if pad_to is not None and pad_to > L:
                emb, cos, sin = (F.pad(t, (0, 0, 0, pad_to - L)) for t in (emb, cos, sin))
            logits = self._prefill_forward(emb, cos, sin, torch.tensor([slot], device=self.device),
                                           torch.tensor([L], device=self.device))
        self.lengths[slot] = L
        self.rope_deltas[slot] = delta
        self._active[slot] = True
        return logits.reshape(-1)

    def _prefill_forward(self, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_t: torch.Tensor,
                         n_t: torch.Tensor) -> torch.Tensor:
        """The prefill forward of one prompt, padded or not, with tensor ops only (capturable in a CUDA graph).

        emb: [1, P, hidden] input embeddings (model dtype); cos/sin: [1, P, rotary_dim]; slot_t: int64 [1], the
        slot to fill; n_t: int64 [1], the real prompt length n <= P.  Positions n..P-1 are padding and leave no
        trace in what the slot keeps: the Gated DeltaNet layers see them with beta = 0 and log-decay g = 0, so
        S_t = S_{t-1} exactly (the delta rule's update is scaled by beta, its decay is exp(g)); the conv state
        ring is filled from the last real positions (kernels.conv_ring_from_tail); attention is causal, so real
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
        (``fuse_linears``), else one module call each.  Returns a tuple of [..., out_features] tensors (views
        into one output when fused)."""
        fused = self._fused[i].get(group)
        if fused is None:
            return tuple(m(x) for m in self._groups[i][group])
        w, sizes = fused
        return (gemv.linear(x, w) if self._fast_gemv else F.linear(x, w)).split(sizes, dim=-1)

    def _linear(self, mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``mod(x)`` for x [B, in] in decode.  A module of ``self._direct`` (a plain ``nn.Linear``, a row-parallel
        projection or the vocabulary-split lm_head) is run here: its local weight through the Triton GEMV when
        enabled (else ``F.linear``), then the all-reduce or all-gather of ``self._comm``; any other module is
        called.  In a step with the fused all-reduce (``_step_fused``) a row-parallel projection returns its
        partial result in the comm's staging slot, which the next ``_add_norm`` reduces."""
        direct = self._direct.get(id(mod))
        if direct is None or (direct[1] is None and not self._fast_gemv):
            return mod(x)
        w, finish = direct
        return self._row_out(w, finish, x.shape[0], lambda out: self._matmul(x, w, out))

    def _matmul(self, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, in] @ w[out, in]^T, into ``out`` [B, out] when given: the Triton GEMV when enabled and it
        applies, else cuBLAS."""
        if self._fast_gemv and gemv.supports(x, w):
            return gemv.gemv(x, w, out=out)
        return F.linear(x, w) if out is None else torch.matmul(x, w.t(), out=out)

    def _row_out(self, w: torch.Tensor, finish: Optional[str], rows: int,
                 compute: Callable[[Optional[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """Run ``compute(out)`` (a local projection with weight w [N, in], writing into ``out`` when it is not
        None) and complete it (``_finish``); in a fused step a row-parallel output goes to the comm's staging
        slot [rows, N] instead and is returned unreduced; with the fused kernels, the vocabulary-split lm_head's
        output is staged and gathered by one kernel (``all_gather_staged``, fp32)."""
        if finish == "all_reduce" and self._step_fused:
            out = self._comm.staging(rows, w.shape[0])
            compute(out)
            return out
        if finish == "all_gather" and self._fused_ar and rows <= self._comm.gather_rows(w.shape[0]):
            out = self._comm.staging(rows, w.shape[0])
            compute(out)
            return self._comm.all_gather_staged(out)                # fp32 [rows, W * N]
        return self._finish(compute(None), finish)

    def _finish(self, y: torch.Tensor, finish: Optional[str]) -> torch.Tensor:
        """Complete a local projection output y [B, out_local]: sum over the TP ranks ("all_reduce"), concatenate
        them ("all_gather": [B, W * out_local]) or nothing (None)."""
        if finish == "all_reduce":
            return self._comm.all_reduce(y)
        if finish == "all_gather":
            return self._comm.all_gather_last(y)
        return y

    def _add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: torch.nn.Module,
                  last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add and the next RMSNorm after a token mixer or MLP: (h + x, norm(h + x)), [B, hidden].  In a
        fused step x is the staged partial result and one kernel also sums it over the ranks (``last``: the
        step's final reduction, which waits for the peers to finish reading)."""
        if self._step_fused:
            return self._comm.all_reduce_add_norm(x, h, norm.weight, norm.eps, end_barrier=last)
        return self._glue["add_norm"](h, x, norm)

    def _embed_decode(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings h [B, hidden] of int64 tokens [B] and the first layer's normed input x.  The
        vocabulary-split table's partial lookups are summed through ``self._comm`` (with the norm in one kernel
        in a fused step)."""
        norm = self._layers[0].input_layernorm
        if self._comm is not None and isinstance(self._embed, VocabParallelEmbedding):
            part = self._embed.partial(tokens).to(self.dtype)
            if self._step_fused:
                staged = self._comm.staging(*part.shape)
                staged.copy_(part)
                return self._comm.all_reduce_add_norm(staged, None, norm.weight, norm.eps)
            h = self._comm.all_reduce(part)
        else:
            h = self._embed(tokens).to(self.dtype)
        return h, norm(h)

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
        # ceil(L * heads / 65536), so every further 2,048 tokens of prompt cost ~9 s of one-off tuning on an H200
        # (measured 2026-11-30); this is the same formula (kernels.l2norm, fp32) at no such cost.
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
    @torch.no_grad()
    def decode(self, slots: Sequence[int], tokens: Optional[torch.Tensor],
               token_table: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Feed one token to each of ``slots`` (all prefilled, distinct) and return their next-token logits.

        tokens: int64 [B] (any device), or None to feed each slot ``token_table[slot]`` (int64 [num_slots] on
        the runner's device, e.g. ``Sampler.last_tokens``: read on the device, so the host need not wait for the
        previous step's tokens).  With CUDA graphs the only wait is for the previous step's input copy (queued
        before that step's graph, so already done when steps are launched one ahead).  Returns fp32 logits
        [B, vocab_size] on the runner's device.
        Raises ContextTooLong when a slot's cache is full (the scheduler should stop it one token earlier);
        ValueError for empty, duplicate or unprefilled slots, or tokens that do not match them.
        """
        slots = [int(s) for s in slots]
        B = len(slots)
        if B == 0:
            raise ValueError("decode needs at least one slot")
        if tokens is None:
            if token_table is None or token_table.dim() != 1 or token_table.numel() < self.num_slots:
                raise ValueError("decode without tokens needs a token_table of num_slots entries")
        elif tokens.numel() != B:
            raise ValueError(f"{B} slots but {tokens.numel()} tokens")
        if len(set(slots)) != B:
            raise ValueError(f"duplicate slots in a decode batch: {slots}")
        for s in slots:
            self._check_slot(s)
            if not self._active[s]:
                raise ValueError(f"slot {s} is not prefilled")
            if self.lengths[s] >= self.max_context:
                raise ContextTooLong(f"sequence in slot {s} reached the context of {self.max_context} tokens",
                                     self.lengths[s], self.max_context)
        pos = [self.lengths[s] for s in slots]
        rope = [p + self.rope_deltas[s] for p, s in zip(pos, slots)]
        ctx = self._context_bucket(max(pos) + 1)
        if self.use_cuda_graphs and B <= BATCH_LADDER[-1]:
            logits = self._decode_graph(slots, tokens, pos, rope, ctx, token_table)
        else:
            dev = self.device
            slot_t = torch.tensor(slots, device=dev)
            tok_t = token_table[slot_t] if tokens is None else tokens.to(dev, torch.long).reshape(-1)
            logits = self._decode_step(slot_t, tok_t, torch.tensor(pos, device=dev), torch.tensor(rope, device=dev),
                                       ctx)
        for s in slots:
            self.lengths[s] += 1
        return logits

    def _context_bucket(self, n: int) -> int:
        """Smallest bucket (MIN_CONTEXT_BUCKET doubling, capped at max_context) holding n positions."""
        b = MIN_CONTEXT_BUCKET
        while b < n:
            b *= 2
        return min(b, self.max_context)

    def _decode_step(self, slot_idx, tokens, pos, rope_pos, ctx: int) -> torch.Tensor:
        """One batched decode forward.  slot_idx/tokens/pos/rope_pos: int64 [B] on device; ctx: attention
        window (static per graph).  Returns fp32 logits [B, V].  Only tensor ops: safe to capture."""
        B = tokens.shape[0]
        self._step_fused = self._fused_ar and B <= self._comm.fused_rows(self._embed.embedding_dim)
        try:
            h, x = self._embed_decode(tokens)                               # [B, H] each
            cos, sin = self._cos_table[rope_pos], self._sin_table[rope_pos]  # [B, rot]
            n = len(self._layers)
            for i, layer in enumerate(self._layers):
                if self._kinds[i] == "linear":
                    x = self._linear_decode(i, layer.linear_attn, slot_idx, pos, x)
                else:
                    x = self._attn_decode(i, layer.self_attn, slot_idx, pos, x, cos, sin, ctx)
                h, x = self._add_norm(h, x, layer.post_attention_layernorm)
                x = self._mlp_decode(i, layer.mlp, x)
                nxt = self._layers[i + 1].input_layernorm if i + 1 < n else self._final_norm
                h, x = self._add_norm(h, x, nxt, last=i + 1 == n)
        finally:
            self._step_fused = False
        return self._linear(self._lm_head, x).float()

    def _mlp_decode(self, i: int, mlp, x: torch.Tensor) -> torch.Tensor:
        """Qwen3_5MLP for decode rows x [B, hidden]: down(act(gate(x)) * up(x)).  For one row, with the Triton
        GEMV, a fused gate/up weight, a plain down projection and SiLU, the SwiGLU is computed inside the down
        projection's kernel as it loads its input (``gemv.gemv(..., swiglu=True)``: one kernel fewer per layer,
        graph replay 4.92 -> 4.84 ms per step on an H200); otherwise the compiled glue does it.  Only for one
        row: in the tensor-core kernel for 2..16 rows it halved the throughput at 4 and 16 streams (H200,
        2026-11-30, bench/results/2026-11-30-NVIDIA-H200-single-run7.json)."""
        fused = self._fused[i].get("mlp")
        down = self._direct.get(id(mlp.down_proj))
        if self._fast_gemv and fused is not None and self._silu_mlp and down is not None and x.shape[0] == 1:
            gate_up = gemv.linear(x, fused[0])                                   # [B, 2 * intermediate]
            if gemv.supports(gate_up, down[0], swiglu=True):
                return self._row_out(down[0], down[1], 1,
                                     lambda out: gemv.gemv(gate_up, down[0], out=out, swiglu=True))
            gate, up = gate_up.split(fused[1], dim=-1)
        else:
            gate, up = self._project(i, "mlp", x)
        return self._linear(mlp.down_proj, self._glue["swiglu"](gate, up, mlp.act_fn))

    def _attn_decode(self, i, at, slot_idx, pos, x, cos, sin, ctx):
        g = self._geo[i]
        B = x.shape[0]
        kc, vc = self.k_cache[i], self.v_cache[i]
        qg, kx, vx = self._project(i, "mix", x)
        q, gate = self._glue["attn_pre"](qg, kx, vx, at.q_norm, at.k_norm, cos, sin, kc, vc, slot_idx, pos,
                                         g["hd"], g["nkv"])
        if self._fused_attention:
            o = self._glue["attn_core"](q, kc, vc, slot_idx, pos, ctx, g["scale"])
        else:  # eager: gathered copy + SDPA (cheaper than the broadcast form without a compiler)
            keys, vals = kc[slot_idx, :, :ctx], vc[slot_idx, :, :ctx]              # [B, nkv, ctx, hd]
            mask = (self._ctx_range[:ctx][None, :] <= pos[:, None]).view(B, 1, 1, ctx)
            # The query heads of one KV group act as that group's "query positions": no KV head expansion.
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=g["scale"])
        return self._linear(at.o_proj, self._glue["attn_post"](o, gate))

    def _linear_decode(self, i, la, slot_idx, pos, x):
        g = self._geo[i]
        qkv, z, b, a = self._project(i, "mix", x)
        if self._gdn_kernel:
            core = gdn.gdn_decode(qkv, z, b, a, self.conv_state[i], self.rec_state[i], slot_idx, pos,
                                  la.conv1d.weight[:, 0, :], la.A_log, la.dt_bias, la.norm.weight,
                                  la.norm.variance_epsilon, g["key_dim"], g["dk"], g["dv"])
        else:
            core = self._glue["gdn_step"](
                qkv, z, b, a, self.conv_state[i], self.rec_state[i], slot_idx, pos, la.conv1d.weight[:, 0, :],
                la.A_log, la.dt_bias, la.norm, la.activation, g["key_dim"], g["dk"], g["dv"])
        return self._linear(la.out_proj, core)

    # ------------------------------------------------------------------ CUDA graphs
    def _alloc_static_buffers(self) -> None:
        n = BATCH_LADDER[-1]
        dev = self.device
        self._scratch = self.num_slots
        # Graph inputs, rows: slot, token, position, rope position.  Filled on the host in a pinned buffer and
        # sent with one asynchronous copy per step; the event guards the pinned buffer against reuse too early.
        self._s_in = torch.zeros(4, n, dtype=torch.long, device=dev)
        self._s_slots, self._s_tokens, self._s_pos, self._s_rope = self._s_in.unbind(0)
        self._h_in = torch.zeros(4, n, dtype=torch.long, pin_memory=True)
        self._h_in_np = self._h_in.numpy()
        self._in_copied = torch.cuda.Event()
        self._s_out: dict[tuple[int, int], torch.Tensor] = {}

    def _capture(self, bp: int, ctx: int) -> None:
        """Capture the decode step for padded batch ``bp`` and context bucket ``ctx`` (inputs point at the
        scratch slot during warm-up and capture, so no live sequence is touched)."""
        self._s_in.zero_()
        self._s_slots.fill_(self._scratch)
        args = (self._s_slots[:bp], self._s_tokens[:bp], self._s_pos[:bp], self._s_rope[:bp], ctx)
        self._graphs[(bp, ctx)], self._s_out[(bp, ctx)] = self._warm_and_capture(self._decode_step, args)

    def _warm_and_capture(self, fn: Callable, args: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run ``fn(*args)`` twice on a side stream (Inductor compilation, Triton autotuning and cuBLAS
        workspaces happen there, outside the capture), then capture one call into a CUDA graph that shares the
        runner's memory pool.  Returns (graph, the captured call's output tensor, rewritten by each replay)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = fn(*args)
        return graph, out

    @torch.no_grad()
    def graph_batch_sizes(self) -> list[int]:
        """Padded batch sizes a decode can run at: the ladder up to the first size >= num_slots."""
        out = []
        for b in BATCH_LADDER:
            out.append(b)
            if b >= self.num_slots:
                break
        return out

    def context_buckets(self) -> list[int]:
        """Attention windows of the decode graphs: MIN_CONTEXT_BUCKET doubling, the last one max_context."""
        out, b = [], MIN_CONTEXT_BUCKET
        while True:
            out.append(min(b, self.max_context))
            if b >= self.max_context:
                return out
            b *= 2

    @torch.no_grad()
    def capture_all(self, batch_sizes: Sequence[int] | None = None,
                    context_buckets: Sequence[int] | None = None,
                    prefill_buckets: Sequence[int] | None = None) -> int:
        """Compile and capture decode and prefill graphs ahead of serving (otherwise each is captured, and the
        glue compiled or fla's kernels tuned, on first use: about 30 s for the first decode graph on the 9B).
        Defaults: every padded batch size x every context bucket, and every prefill bucket.  Every rank of a
        tensor-parallel group must call this with the same arguments.  Returns the number of graphs held (0
        without CUDA graphs)."""
        if not self.use_cuda_graphs:
            return 0
        for bp in batch_sizes or self.graph_batch_sizes():
            for ctx in context_buckets or self.context_buckets():
                if (bp, ctx) not in self._graphs:
                    self._capture(bp, ctx)
        for P in prefill_buckets or self.prefill_buckets():
            if P not in self._prefill_graphs:
                self._capture_prefill(P)
        return len(self._graphs) + len(self._prefill_graphs)

    def _decode_graph(self, slots, tokens, pos, rope, ctx, token_table=None) -> torch.Tensor:
        B = len(slots)
        bp = next(b for b in BATCH_LADDER if b >= B)
        key = (bp, ctx)
        if key not in self._graphs:
            self._capture(bp, ctx)
        h = self._h_in_np
        self._in_copied.synchronize()  # the previous step's copy has read the pinned buffer
        h[:, B:bp] = 0
        h[0, :bp] = self._scratch
        h[0, :B], h[2, :B], h[3, :B] = slots, pos, rope
        on_host = tokens is not None and tokens.device.type == "cpu"
        if on_host:
            h[1, :B] = tokens.reshape(-1).numpy()
        self._s_in.copy_(self._h_in, non_blocking=True)
        self._in_copied.record()
        if tokens is None:
            torch.index_select(token_table, 0, self._s_slots[:B], out=self._s_tokens[:B])
        elif not on_host:
            self._s_tokens[:B].copy_(tokens.reshape(-1))
        self._graphs[key].replay()
        return self._s_out[key][:B].clone()

    # ------------------------------------------------------------------ prefill graphs
    def prefill_buckets(self) -> list[int]:
        """Prompt lengths with a captured prefill graph (``PREFILL_BUCKETS`` up to ``max_context``); empty
        without CUDA graphs."""
        if not self.use_cuda_graphs:
            return []
        return [b for b in PREFILL_BUCKETS if b <= self.max_context]

    def _prefill_bucket(self, n: int) -> Optional[int]:
        """The bucket a prompt of n tokens is padded to, or None when it runs eagerly."""
        return next((b for b in self.prefill_buckets() if b >= n), None)

    def _alloc_prefill_buffers(self) -> None:
        if hasattr(self, "_p_emb"):
            return
        P = max(self.prefill_buckets())
        dev, hidden, rot = self.device, self._embed.embedding_dim, self._cos_table.shape[-1]
        self._p_emb = torch.zeros(1, P, hidden, device=dev, dtype=self.dtype)
        self._p_cos = torch.zeros(1, P, rot, device=dev, dtype=self._cos_table.dtype)
        self._p_sin = torch.zeros(1, P, rot, device=dev, dtype=self._sin_table.dtype)
        self._p_slot = torch.zeros(1, dtype=torch.long, device=dev)
        self._p_n = torch.ones(1, dtype=torch.long, device=dev)

    def _capture_prefill(self, P: int) -> None:
        """Capture the prefill forward padded to P tokens (run into the scratch slot while capturing)."""
        self._alloc_prefill_buffers()
        self._p_slot.fill_(self._scratch)
        self._p_n.fill_(P)
        args = (self._p_emb[:, :P], self._p_cos[:, :P], self._p_sin[:, :P], self._p_slot, self._p_n)
        self._prefill_graphs[P], self._prefill_out[P] = self._warm_and_capture(self._prefill_forward, args)

    def _prefill_graph(self, slot: int, emb, cos, sin, n: int, P: int) -> torch.Tensor:
        """Copy the prompt into the static buffers (zero padding up to P) and replay bucket P's graph."""
        if P not in self._prefill_graphs:
            self._capture_prefill(P)
        for buf, src in ((self._p_emb, emb), (self._p_cos, cos), (self._p_sin, sin)):
            buf[:, :n].copy_(src)
            buf[:, n:P].zero_()
        self._p_slot.fill_(slot)
        self._p_n.fill_(n)
        self._prefill_graphs[P].replay()
        return self._prefill_out[P].clone()
