"""The model runner: our own Qwen3.5 text-decoder forward over static, preallocated per-slot state.

A *slot* holds one running sequence: its KV cache in the 8 (full config) gated full-attention layers, its
depthwise-conv state and fp32 recurrent state in the 24 Gated DeltaNet layers (``state.SlotState``), its length
and its M-RoPE delta.  ``prefill`` fills one slot from a prompt (text and images); ``decode`` advances any set of
slots by one token in one batched forward; ``free`` releases a slot.  Slots are independent, so sequences of
different lengths join and leave the batch at any step (continuous batching is the scheduler's job).

The runner owns the slots and the public calls; the other concerns live next to it:

- ``forward``: the maths (``ModelForward``: the prefill forward of one prompt, one batched decode step),
  following transformers' ``modeling_qwen3_5.py`` through the model's own submodules, so the same code runs
  unsharded, under DeepSpeed AutoTP (sharded submodules) and under ZeRO-3 (hooked submodules);
- ``state``: the slot state, sized from the local widths probed through the (possibly sharded) projections;
- ``fusion``: projections that read the same input run as one GEMM over a fused weight (``fuse_linears``);
- ``qwen_chat.engine.parallel.tp_decode``: the decode step's single projections (token-mixer output, MLP down,
  lm_head), run on their local weight and completed across the tensor-parallel ranks (the identity at world
  size 1); prefill calls the sharded modules;
- ``graphs``: on CUDA (not ZeRO-3) the decode step is captured in CUDA graphs, one per (batch size, context
  bucket), and the prefill of a prompt of up to ``max(PREFILL_BUCKETS)`` tokens replays a graph too, padded at
  the end to its bucket (the padding is masked out of every state the slot keeps: ``ModelForward.prefill``);
- ``glue``: the element-wise glue between the projections, fused with ``torch.compile`` on CUDA;
- ``options``: which of these run (``RunnerOptions``; the defaults are production's).

On CPU the same steps run eagerly.  Measured speed: docs/performance.md.  Run the CPU parity tests with
``python -m pytest -q tests/engine/test_runner.py``.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from qwen_chat.chat_types import ContextTooLong, InvalidInput
from qwen_chat.engine.model import gemv, graphs
from qwen_chat.engine.model.forward import ModelForward
from qwen_chat.engine.model.fusion import Fused, fuse_layers
from qwen_chat.engine.model.glue import glue_functions
from qwen_chat.engine.model.options import RunnerOptions, resolve_options
from qwen_chat.engine.model.state import SlotState
from qwen_chat.engine.parallel.sharding import is_zero3_partitioned
from qwen_chat.engine.parallel.tp_decode import decode_projections
from qwen_chat.engine.serving.requests import PreparedPrompt

log = logging.getLogger(__name__)


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


class ModelRunner:
    """Qwen3.5 forward over static per-slot state (see the module docstring).

    Args:
        model: a loaded ``transformers`` ``Qwen3_5ForConditionalGeneration`` (plain, AutoTP-sharded or ZeRO-3),
            in eval mode, on ``device``.
        num_slots: number of sequences that can be live at once.
        max_context: tokens per sequence (prompt + reply); the KV cache is allocated for this length.
        device: torch device of the model.
        dtype: dtype of activations and KV cache; default: the dtype of the model's parameters.
        options: implementation switches (``RunnerOptions``; default: what production runs).  Under tensor
            parallelism construction is collective: every rank builds its runner at the same time.

    Attributes: ``num_slots``, ``max_context``, ``vocab_size`` (logits width), ``options`` (resolved: no auto
    left), ``use_cuda_graphs``, ``graphs`` (``graphs.CudaGraphs``, or None without CUDA graphs), ``impl`` (dict:
    which implementation each op resolved to, for the start-up log), ``lengths`` and ``rope_deltas`` (per slot),
    ``k_cache``, ``v_cache``, ``conv_state``, ``rec_state`` (``state.SlotState``).

    Raises: ValueError for ``num_slots`` or ``max_context`` < 1 and for options that cannot work here
    (``options.resolve_options``); RuntimeError for a state the sharding breaks (``state.SlotState``).
    """

    def __init__(self, model, *, num_slots: int, max_context: int, device, dtype=None,
                 options: RunnerOptions = RunnerOptions()):
        if num_slots < 1 or max_context < 1:
            raise ValueError(f"num_slots and max_context must be >= 1 (got {num_slots}, {max_context})")
        self.model = model
        self.device = torch.device(device)
        self.num_slots = int(num_slots)
        self.max_context = int(max_context)
        zero3 = is_zero3_partitioned(model)
        core = model.model
        lm = core.language_model
        self.config = model.config
        tc = model.config.text_config
        self.dtype = dtype or lm.embed_tokens.weight.dtype
        self.vocab_size = int(tc.vocab_size)
        self.image_token_id = int(model.config.image_token_id)
        self._core, self._lm = core, lm
        layers = list(lm.layers)
        self._embed = lm.embed_tokens
        chunk_rule, chunk_name = _resolve_chunk_rule()
        groups, self._fused = fuse_layers(layers, enabled=not zero3)
        state = SlotState(layers, num_slots=self.num_slots, max_context=self.max_context,
                          hidden_size=tc.hidden_size, device=self.device, dtype=self.dtype)
        self.k_cache, self.v_cache = state.k_cache, state.v_cache
        self.conv_state, self.rec_state = state.conv_state, state.rec_state
        self.options = opts = resolve_options(options, device=self.device, zero3=zero3,
                                              gdn_fits=state.gdn_kernel_fits(layers, zero3))
        self.use_cuda_graphs = opts.cuda_graphs
        glue = glue_functions(opts.compile_glue)
        self.tp = decode_projections(model, device=self.device, dtype=self.dtype, fast_gemv=opts.fast_gemv,
                                     cuda_graphs=opts.cuda_graphs, add_norm=glue["add_norm"], zero3=zero3,
                                     backend=opts.tp_allreduce, fused=opts.tp_fused)
        self._forward = fwd = ModelForward(
            model, state=state, groups=groups, fused=self._fused, options=opts, glue=glue, tp=self.tp,
            chunk_rule=chunk_rule, max_context=self.max_context, device=self.device, dtype=self.dtype)

        self.lengths = [0] * (self.num_slots + 1)      # tokens in each slot's cache (python ints)
        self.rope_deltas = [0] * (self.num_slots + 1)  # M-RoPE position shift of each slot
        self._active = [False] * (self.num_slots + 1)
        self.graphs: Optional[graphs.CudaGraphs] = None
        if self.use_cuda_graphs:
            self.graphs = graphs.CudaGraphs(
                device=self.device, scratch_slot=self.num_slots, decode_step=fwd.decode,
                prefill_step=fwd.prefill, prefill_buckets=self.prefill_buckets(),
                hidden=self._embed.embedding_dim, dtype=self.dtype,
                rope_dtypes=(fwd.cos_table.dtype, fwd.sin_table.dtype), rot=fwd.cos_table.shape[-1])
        glue_name = "torch.compile" if opts.compile_glue else "eager"
        self.impl = {"chunk_delta_rule": chunk_name, "recurrent_delta_rule": "torch", "conv1d": "torch",
                     "attention": "torch.sdpa", "cuda_graphs": self.use_cuda_graphs, "decode_glue": glue_name,
                     "fused_projection_groups": sum(len(f) for f in self._fused),
                     "projections": "triton gemv (<= %d rows)" % gemv.MAX_ROWS if opts.fast_gemv else "torch",
                     "tp_all_reduce": self.tp.kind, "tp_fused_all_reduce_norm": self.tp.fused,
                     "gdn_decode": "triton (one kernel)" if opts.gdn_kernel else glue_name,
                     "prefill": "cuda graphs (bucketed)" if self.use_cuda_graphs else "eager"}
        log.info("ModelRunner: %d slots x %d tokens, dtype %s, impl %s", self.num_slots, self.max_context,
                 self.dtype, self.impl)

    # ------------------------------------------------------------------ slots and buckets
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")

    def free(self, slot: int) -> None:
        """Release ``slot``; its state is overwritten by the next prefill (no memory is returned)."""
        self._check_slot(slot)
        self._active[slot] = False
        self.lengths[slot] = 0
        self.rope_deltas[slot] = 0

    @torch.no_grad()
    def copy_slot(self, src: int, dst: int) -> None:
        """Make ``dst`` continue from ``src``'s state (its first ``lengths[src]`` KV positions, conv and recurrent
        state, length, M-RoPE delta), queued on the device; used to share one prefill among the n choices of a
        request.  Local tensors only (no collective): under tensor parallelism every rank copies its shard.
        Raises ValueError for a slot out of range, ``src == dst`` or an unprefilled ``src``."""
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst or not self._active[src]:
            raise ValueError(f"copy_slot needs a prefilled source other than the target (got {src} -> {dst})")
        n = self.lengths[src]
        for cache in (self.k_cache, self.v_cache):
            for t in cache.values():
                t[dst, :, :n].copy_(t[src, :, :n])
        for state in (self.conv_state, self.rec_state):
            for t in state.values():
                t[dst].copy_(t[src])
        self.lengths[dst] = n
        self.rope_deltas[dst] = self.rope_deltas[src]
        self._active[dst] = True

    def graph_batch_sizes(self) -> list[int]:
        """Padded batch sizes a decode can run at: ``graphs.BATCH_LADDER`` up to the first size >= num_slots."""
        return graphs.graph_batch_sizes(self.num_slots)

    def context_buckets(self) -> list[int]:
        """Attention windows of the decode graphs: MIN_CONTEXT_BUCKET doubling, the last one max_context."""
        return graphs.context_buckets(self.max_context)

    def context_bucket(self, n: int) -> int:
        """The attention window (a ``context_buckets()`` entry) a decode step with n positions runs in."""
        return graphs.context_bucket(n, self.max_context)

    def prefill_buckets(self) -> list[int]:
        """Prompt lengths with a captured prefill graph (``graphs.PREFILL_BUCKETS`` up to ``max_context``); empty
        without CUDA graphs."""
        if not self.use_cuda_graphs:
            return []
        return [b for b in graphs.PREFILL_BUCKETS if b <= self.max_context]

    def prefill_bucket(self, n: int) -> Optional[int]:
        """The bucket a prompt of n tokens is padded to, or None when it runs eagerly."""
        return next((b for b in self.prefill_buckets() if b >= n), None)

    def fused_projection(self, layer: int, group: str) -> Optional[Fused]:
        """(weight, out sizes) of layer ``layer``'s fused projection group ``group`` ("mix" or "mlp"), or None
        when that group is not fused (``fusion.fuse_linears``)."""
        return self._fused[layer].get(group)

    @torch.no_grad()
    def capture_all(self, batch_sizes: Sequence[int] | None = None,
                    context_buckets: Sequence[int] | None = None,
                    prefill_buckets: Sequence[int] | None = None) -> int:
        """Compile and capture decode and prefill graphs ahead of serving (otherwise each is captured, and the
        glue compiled or fla's kernels tuned, on first use: about 30 s for the first decode graph on the 9B).
        Defaults: every padded batch size x every context bucket, and every prefill bucket.  Every rank of a
        tensor-parallel group must call this with the same arguments.  Returns the number of graphs held (0
        without CUDA graphs)."""
        if self.graphs is None:
            return 0
        for bp in batch_sizes or self.graph_batch_sizes():
            for ctx in context_buckets or self.context_buckets():
                self.graphs.capture_decode(bp, ctx)
        for P in prefill_buckets or self.prefill_buckets():
            self.graphs.capture_prefill(P)
        return self.graphs.count()

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, slot: int, prompt: PreparedPrompt, pad_to: Optional[int] = None) -> torch.Tensor:
        """Run the whole prompt through the model into ``slot`` (replacing whatever it held).

        Images: features from the model's own vision tower (``model.model.get_image_features``) replace the
        embeddings at the image-pad positions; M-RoPE positions from ``model.model.get_rope_index``, whose
        delta is kept for the slot's decode positions.

        With CUDA graphs a prompt of L <= max(``prefill_buckets()``) tokens replays the graph of the smallest
        bucket >= L: the prompt is padded at the end and the padding changes nothing the slot keeps (see
        ``ModelForward.prefill``).  ``pad_to`` forces that padded form eagerly (tests compare it with the unpadded
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
        bucket = self.prefill_bucket(L) if pad_to is None else None
        if bucket is not None:
            logits = self.graphs.prefill(slot, emb, cos, sin, L, bucket)
        else:
            if pad_to is not None and pad_to > L:
                emb, cos, sin = (F.pad(t, (0, 0, 0, pad_to - L)) for t in (emb, cos, sin))
            logits = self._forward.prefill(emb, cos, sin, torch.tensor([slot], device=self.device),
                                           torch.tensor([L], device=self.device))
        self.lengths[slot] = L
        self.rope_deltas[slot] = delta
        self._active[slot] = True
        return logits.reshape(-1)

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
        ctx = self.context_bucket(max(pos) + 1)
        if self.graphs is not None and B <= graphs.BATCH_LADDER[-1]:
            logits = self.graphs.decode(slots, tokens, pos, rope, ctx, token_table)
        else:
            dev = self.device
            slot_t = torch.tensor(slots, device=dev)
            tok_t = token_table[slot_t] if tokens is None else tokens.to(dev, torch.long).reshape(-1)
            logits = self._forward.decode(slot_t, tok_t, torch.tensor(pos, device=dev),
                                          torch.tensor(rope, device=dev), ctx)
        for s in slots:
            self.lengths[s] += 1
        return logits
