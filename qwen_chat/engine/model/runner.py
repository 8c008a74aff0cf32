"""The model runner: our own Qwen3.5 text-decoder forward over preallocated, budgeted per-sequence state.

A *slot* holds one running sequence: its conv and fp32 recurrent state in the 24 (full config) Gated DeltaNet
layers (``state.SlotState``), its length, its M-RoPE delta and its block table, the list of KV blocks that hold
its keys and values in the 8 gated full-attention layers (``paged.BlockTables``: a sequence holds blocks only
for its own length).  ``prefill`` runs a batch of prompt chunks, each into its slot and continuing from what
the slot already holds, in one packed forward; ``decode`` advances any set of slots by one token in one batched
forward; ``free`` releases a slot and its blocks.  Slots are independent, so sequences of different lengths
join and leave the batch at any step (continuous batching is the scheduler's job).

The runner owns the slots and the public calls; the other concerns live next to it:

- ``forward``: the maths (``ModelForward``: the packed prefill of several chunks, one batched decode step),
  following transformers' ``modeling_qwen3_5.py`` through the model's own submodules, so the same code runs
  unsharded, under DeepSpeed AutoTP (sharded submodules) and under ZeRO-3 (hooked submodules);
- ``state``: the slot and block state, sized from the local widths probed through the (possibly sharded)
  projections; ``paged``: the block tables; ``memory``: how many slots and blocks a memory budget holds;
- ``fusion``: projections that read the same input run as one GEMM over a fused weight (``fuse_linears``);
- ``qwen_chat.engine.parallel.tp_decode``: the decode step's single projections (token-mixer output, MLP down,
  lm_head), run on their local weight and completed across the tensor-parallel ranks (the identity at world
  size 1); prefill calls the sharded modules;
- ``graphs``: on CUDA (not ZeRO-3) the decode step is captured in CUDA graphs, one per (batch size, context
  bucket); ``prefill_graph``: a step's one short prompt chunk runs padded through piecewise prefill graphs,
  other prefills eagerly (their packed shape changes every step);
- ``glue``: the element-wise glue between the projections, fused with ``torch.compile`` on CUDA;
- ``options``: which of these run (``RunnerOptions``; the defaults are production's).

On CPU the same steps run eagerly.  Measured speed: docs/performance.md.  Run the CPU parity tests with
``python -m pytest -q tests/engine/test_runner.py``.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from qwen_chat.chat_types import ContextTooLong
from qwen_chat.engine.model import fp8_gemv, gemv, graphs, int4_gemv, prefix_cache
from qwen_chat.engine.model.delta_rule import resolve_chunk_rule
from qwen_chat.engine.model.forward import ModelForward, PrefillRows, no_cudnn_attention
from qwen_chat.engine.model.fusion import Fused, fuse_layers
from qwen_chat.engine.model.glue import glue_functions
from qwen_chat.engine.model.options import RunnerOptions, resolve_options
from qwen_chat.engine.model.paged import BLOCK_TOKENS, BlockTables, blocks_for
from qwen_chat.engine.model.prefill_graph import PREFILL_BUCKETS, GraphPrefill
from qwen_chat.engine.model.prompt_inputs import PromptInputs
from qwen_chat.engine.model.state import Geometry, SlotState, probe_geometry
from qwen_chat.engine.parallel.sharding import is_zero3_partitioned
from qwen_chat.engine.parallel.tp_decode import decode_projections, is_tensor_parallel
from qwen_chat.engine.types import PrefillItem, PreparedPrompt

log = logging.getLogger(__name__)
EAGER_PREFILL = "eager, prompt chunks packed"  # ``impl["prefill"]`` without the prefill graphs


class ModelRunner:
    """Qwen3.5 forward over per-slot state and a paged KV cache (see the module docstring).

    Args:
        model: a loaded ``transformers`` ``Qwen3_5ForConditionalGeneration`` (plain, AutoTP-sharded or ZeRO-3),
            in eval mode, on ``device``.
        num_slots: sequences that can be live at once (Gated DeltaNet state slots).
        max_context: tokens per sequence at most (prompt + reply).
        num_blocks: KV blocks of ``block_tokens`` positions shared by all slots; default: enough for every slot
            at ``max_context`` (``memory.plan_memory`` picks fewer from a memory budget).
        device: torch device of the model.
        dtype: of activations (and of the KV cache unless ``kv_dtype``: ``kv_quant``); default: the model's.
        options: implementation switches (``RunnerOptions``; default: what production runs).  Under tensor
            parallelism construction is collective: every rank builds its runner at the same time.
        block_tokens: positions per KV block (``paged.BLOCK_TOKENS``).
        geometry: the local widths the caller probed (``state.probe_geometry``: the memory budget); default: here.

    Attributes: ``num_slots``, ``max_context``, ``num_blocks``, ``block_tokens``, ``vocab_size`` (logits
    width), ``options`` (resolved: no auto left), ``use_cuda_graphs``, ``graphs`` (``graphs.CudaGraphs``, or
    None), ``impl`` (dict: which implementation each op resolved to, for the start-up log), ``lengths`` and
    ``rope_deltas`` (per slot), ``tables`` (``paged.BlockTables``), ``k_cache``, ``v_cache``, ``k_scale``,
    ``v_scale``, ``conv_state``, ``rec_state`` (``state.SlotState``).

    Raises: ValueError for ``num_slots``, ``max_context`` or ``num_blocks`` < 1 and for options that cannot
    work here (``options.resolve_options``); RuntimeError for a state the sharding breaks
    (``state.probe_geometry``).
    """

    def __init__(self, model, *, num_slots: int, max_context: int, num_blocks: Optional[int] = None, device,
                 dtype=None, options: RunnerOptions = RunnerOptions(), block_tokens: int = BLOCK_TOKENS,
                 geometry: Optional[Geometry] = None, kv_dtype: Optional[torch.dtype] = None):
        if num_slots < 1 or max_context < 1 or (num_blocks is not None and num_blocks < 1):
            raise ValueError(f"num_slots, max_context and num_blocks must be >= 1 (got {num_slots}, "
                             f"{max_context}, {num_blocks})")
        self.model = model
        self.device = torch.device(device)
        self.num_slots = int(num_slots)
        self.max_context = int(max_context)
        self.block_tokens = int(block_tokens)
        max_blocks = blocks_for(self.max_context, self.block_tokens)
        self.num_blocks = int(num_blocks) if num_blocks is not None else self.num_slots * max_blocks
        zero3 = is_zero3_partitioned(model)
        lm = model.model.language_model
        self.config, tc = model.config, model.config.text_config
        self.dtype = dtype or lm.embed_tokens.weight.dtype
        self.vocab_size = int(tc.vocab_size)
        layers = list(lm.layers)
        self._embed = lm.embed_tokens
        chunk_rule, chunk_name, varlen, tail_rule = resolve_chunk_rule(self.device, self.dtype)
        groups, self._fused = fuse_layers(layers, enabled=not zero3)
        geometry = geometry or probe_geometry(layers, hidden_size=tc.hidden_size, device=self.device,
                                              dtype=self.dtype, kv_dtype=kv_dtype)
        state = SlotState(geometry, num_slots=self.num_slots, num_blocks=self.num_blocks,
                          block_tokens=self.block_tokens, device=self.device)
        self.tables = BlockTables(num_slots=self.num_slots, num_blocks=self.num_blocks, max_blocks=max_blocks,
                                  device=self.device, block_tokens=self.block_tokens)
        self.k_cache, self.v_cache = state.k_cache, state.v_cache
        self.k_scale, self.v_scale = state.k_scale, state.v_scale
        self.conv_state, self.rec_state = state.conv_state, state.rec_state
        self.options = opts = resolve_options(options, device=self.device, zero3=zero3,
                                              gdn_fits=state.gdn_kernel_fits(layers, zero3),
                                              tensor_parallel=is_tensor_parallel(model, zero3))
        self.use_cuda_graphs = opts.cuda_graphs
        glue = glue_functions(opts.compile_glue)
        self.tp = decode_projections(model, device=self.device, dtype=self.dtype, fast_gemv=opts.fast_gemv,
                                     cuda_graphs=opts.cuda_graphs, add_norm=glue["add_norm"], zero3=zero3,
                                     backend=opts.tp_allreduce, fused=opts.tp_fused)
        self._forward = fwd = ModelForward(
            model, state=state, tables=self.tables, groups=groups, fused=self._fused, options=opts, glue=glue,
            tp=self.tp, chunk_rule=chunk_rule, varlen=varlen, max_context=self.max_context, device=self.device,
            dtype=self.dtype, tail_rule=tail_rule)
        self._inputs = PromptInputs(model, device=self.device, dtype=self.dtype)

        self.lengths = [0] * (self.num_slots + 1)      # tokens in each slot's cache (python ints)
        self.rope_deltas = [0] * (self.num_slots + 1)  # M-RoPE position shift of each slot
        self._active = [False] * (self.num_slots + 1)  # decodable: its prompt's last chunk ran
        self._restored: set[int] = set()  # slots started from a kept prefix whose prompt has not started yet
        self.spec = None  # speculative decoding (``spec_step.attach``), or None
        self.graphs: Optional[graphs.CudaGraphs] = None
        if self.use_cuda_graphs:
            self.graphs = graphs.CudaGraphs(device=self.device, scratch_slot=self.num_slots, decode_step=fwd.decode)
        self.graph_prefill: Optional[GraphPrefill] = None
        if opts.prefill_graphs:
            self.graph_prefill = GraphPrefill(fwd, scratch_slot=self.num_slots, max_context=self.max_context,
                                              graphs=self.graphs)
        glue_name = "torch.compile" if opts.compile_glue else "eager"
        self.impl = {"chunk_delta_rule": chunk_name, "recurrent_delta_rule": "torch", "prefill_fused_kernels": opts.prefill_kernels,
                     "attention": "torch.sdpa (prefill), paged %d-token blocks" % self.block_tokens,
                     "cuda_graphs": self.use_cuda_graphs, "decode_glue": glue_name,
                     "fused_projection_groups": sum(len(f) for f in self._fused),
                     "projections": ("triton gemv (<= %d rows, fp8 <= %d, int4 <= %d)"
                                     % (gemv.MAX_ROWS, fp8_gemv.MAX_ROWS, int4_gemv.MAX_ROWS)
                                     if opts.fast_gemv else "torch"),
                     "tp_all_reduce": self.tp.kind, "tp_fused_all_reduce_norm": self.tp.fused,
                     "gdn_decode": "triton (one kernel)" if opts.gdn_kernel else glue_name,
                     "prefill": EAGER_PREFILL + (f"; one chunk of <= {PREFILL_BUCKETS[-1]} tokens in piecewise "
                                                 + ("CUDA graphs" if self.graphs else "padded pieces")
                                                 if self.graph_prefill else "")}
        log.info("ModelRunner: %d slots, %d KV blocks x %d tokens, context %d, dtype %s, impl %s", self.num_slots,
                 self.num_blocks, self.block_tokens, self.max_context, self.dtype, self.impl)

    # ------------------------------------------------------------------ slots and buckets
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")

    def free(self, slot: int) -> None:
        """Release ``slot`` and give its KV blocks back (its Gated DeltaNet state is overwritten by the next
        prefill).  Also what preemption does: the sequence is recomputed into a slot later."""
        self._check_slot(slot)
        self._active[slot] = False
        self.lengths[slot] = 0
        self.rope_deltas[slot] = 0
        self.tables.release(slot)
        self._inputs.done(slot)
        self._restored.discard(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """Make ``dst`` continue from ``src``'s state (``prefix_cache.restore``: full KV blocks shared, the partly
        filled last one copied, conv and recurrent state, length, M-RoPE delta), queued on the device; used to
        share one prefill among the n choices of a request.  Local tensors only (no collective): under tensor
        parallelism every rank copies its shard.  Raises ValueError for a slot out of range, ``src == dst`` or
        an unprefilled ``src``; ``paged.OutOfBlocks`` when no block is free for ``dst``."""
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst or not self._active[src]:
            raise ValueError(f"copy_slot needs a prefilled source other than the target (got {src} -> {dst})")
        n = prefix_cache.restore(self, src, dst)
        if self.tables.following and n % self.block_tokens:  # the plan shared the full blocks only
            full = n // self.block_tokens
            self.copy_blocks([(self.tables.blocks(src)[full], self.tables.blocks(dst)[full])])
        self._active[dst] = True

    def follow_blocks(self, changes, copies) -> None:
        """Take a plan's KV block table changes [(slot, index, block id)] from the scheduler's allocator (from
        the first on, the tables only follow plans: ``paged.BlockTables.follow``), then copy its blocks
        [(source, target)] (``copy_blocks``).  Raises ValueError for an entry out of range."""
        self.tables.follow(changes)
        self.copy_blocks(copies)

    def own_blocks(self) -> None:
        """Allocate KV blocks from the runner's own free list again (after a scheduler: ``paged.BlockTables.own``)."""
        self.tables.own()

    def copy_blocks(self, pairs) -> None:
        """Copy KV blocks (source id, target id) in every attention layer's keys and values (and their FP8
        scales), queued on the device (local shards only: every rank copies its own)."""
        if not pairs:
            return
        src, dst = torch.tensor(list(pairs), dtype=torch.long).T.to(self.device)
        for cache in (self.k_cache, self.v_cache, self.k_scale, self.v_scale):
            for t in cache.values():
                t[dst] = t[src]

    def restore(self, src: int, dst: int) -> int:
        """Start ``dst`` from the prefix state row ``src`` keeps (``prefix_cache.restore``); the next chunk into
        ``dst`` starts at the returned length n and may belong to any prompt whose first n tokens are the
        prefix's; ``dst == src`` takes the kept row over in place.  Raises as ``prefix_cache.restore``, and
        ValueError for a slot out of range."""
        self._check_slot(src)
        self._check_slot(dst)
        n = prefix_cache.restore(self, src, dst)
        self._restored.add(dst)
        return n

    def graph_batch_sizes(self) -> list[int]:
        """Padded batch sizes a decode can run at: ``graphs.BATCH_LADDER`` up to the first size >= num_slots."""
        return graphs.graph_batch_sizes(self.num_slots)

    def context_buckets(self) -> list[int]:
        """Attention windows of the decode graphs: MIN_CONTEXT_BUCKET doubling, the last one max_context (in
        whole blocks)."""
        return graphs.context_buckets(self.max_context, self.block_tokens)

    def context_bucket(self, n: int) -> int:
        """The attention window (a ``context_buckets()`` entry) a decode step with n positions runs in."""
        return graphs.context_bucket(n, self.max_context, self.block_tokens)

    def fused_projection(self, layer: int, group: str) -> Optional[Fused]:
        """(weight, out sizes) of layer ``layer``'s fused projection group ``group`` ("mix" or "mlp"), or None
        when that group is not fused (``fusion.fuse_linears``)."""
        return self._fused[layer].get(group)

    @torch.no_grad()
    def capture_all(self, batch_sizes: Sequence[int] | None = None,
                    context_buckets: Sequence[int] | None = None, why: str = "") -> int:
        """Compile and capture decode graphs ahead of serving (otherwise each is captured, and the glue
        compiled, on first use).  Defaults: every padded batch size x every context bucket; ``why``: for the log
        (``CudaGraphs.capture_decode``).  Every rank of a tensor-parallel group must call this with the same
        arguments.  Returns the number of graphs held (0 without CUDA graphs)."""
        if self.graphs is None:
            return 0
        for bp in batch_sizes or self.graph_batch_sizes():
            for ctx in context_buckets or self.context_buckets():
                self.graphs.capture_decode(bp, ctx, why)
        return self.graphs.count()

    @torch.no_grad()
    def capture_prefill(self) -> int:
        """Capture the prefill graphs of every bucket (``prefill_graph``); returns the number held (0: none)."""
        return self.graph_prefill.capture_all() if self.graph_prefill and self.graphs else 0

    def drop_prefill_graphs(self) -> None:
        """Prefill eagerly from now on (capturing the prefill graphs failed); their graphs and pool go too."""
        self.graph_prefill, self.impl["prefill"] = None, EAGER_PREFILL

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    @no_cudnn_attention()
    def prefill_batch(self, chunks: Sequence[PrefillItem]) -> Optional[torch.Tensor]:
        """Run prompt chunks (``types.PrefillItem``), each into its own slot, in one packed forward.

        A first chunk (start 0) resets its slot; a later one continues it.  Images: features from the model's
        own vision tower (``model.model.get_image_features``, once per prompt) replace the embeddings at the
        image-pad positions; M-RoPE positions from ``model.model.get_rope_index``, whose delta is kept for the
        slot's decode positions (``prompt_inputs``).  The slots take the KV blocks their new length needs.

        Returns fp32 logits [m, vocab_size] of the last position of each of the m chunks that end their prompt
        and want logits, in ``chunks`` order, or None when there is none.
        Raises (before any slot changes): ContextTooLong if a prompt does not fit ``max_context``;
        InvalidInput for an empty prompt, token ids outside the embedding table, or a pad-token count that does
        not match the image features; ValueError for a slot out of range or twice in the batch, a chunk that
        does not continue its slot, or a keep point outside its chunk or into a row that is in use.
        ``paged.OutOfBlocks`` when the free blocks do not cover the chunks (the
        scheduler's accounting is then wrong).
        """
        seen = set()
        for c in chunks:
            self._check_slot(c.slot)
            L, end = c.prompt.num_tokens, c.stop()
            if c.slot in seen:
                raise ValueError(f"slot {c.slot} appears twice in one prefill")
            seen.add(c.slot)
            if c.start == 0 or c.slot in self._restored:
                self._inputs.check(c.prompt)
                if L >= self.max_context:
                    raise ContextTooLong.for_prompt(L, self.max_context)
            if c.start > 0 and (self._active[c.slot] or self.lengths[c.slot] != c.start):
                raise ValueError(f"chunk {c.start}..{end} does not continue slot {c.slot} (it holds "
                                 f"{self.lengths[c.slot]} tokens)")
            if not c.start < end <= L:
                raise ValueError(f"chunk {c.start}..{end} is outside the prompt of {L} tokens")
        prefix_cache.check_keeps(self, chunks, seen)
        deltas = {}
        starting = [c for c in chunks if c.start == 0 or c.slot in self._restored]
        try:
            for c in starting:
                deltas[c.slot] = self._inputs.start(c.slot, c.prompt, c.start)
        except BaseException:
            for c in starting:
                self._inputs.done(c.slot)
            raise
        for c in starting:
            self._restored.discard(c.slot)
            self.rope_deltas[c.slot] = deltas[c.slot]
        for c in chunks:
            if c.start == 0:
                self._active[c.slot] = False
                self.lengths[c.slot] = 0
                self.tables.release(c.slot)
        self.tables.ensure_all([(c.slot, c.stop()) for c in chunks])
        seqs = []
        offset = 0
        for c in chunks:
            end = c.stop()
            rows = self.tables.positions(c.slot, 0, end)  # host; the forward sends all indexes in one copy
            last = end == c.prompt.num_tokens
            keeps = tuple((p - c.start, row) for p, row in c.keeps)
            seqs.append(PrefillRows(c.slot, c.start, end - c.start, offset, rows, last and c.logits, keeps))
            offset += end - c.start
        self.tables.flush()
        emb, cos, sin = self._inputs.embed([(c.slot, c.prompt, c.start, c.stop()) for c in chunks])
        if self.graph_prefill is not None and self.graph_prefill.takes(seqs):
            logits = self.graph_prefill.run(emb, cos, sin, seqs[0])
        else:
            logits = self._forward.prefill(emb, cos, sin, seqs)
        for c in chunks:
            for p, row in c.keeps:
                prefix_cache.keep_blocks(self, c.slot, row, p, self.rope_deltas[c.slot])
            self.lengths[c.slot] = c.stop()
            if c.stop() == c.prompt.num_tokens:
                self._active[c.slot] = True
                self._inputs.done(c.slot)
        return logits

    def last_hidden(self, i: int) -> torch.Tensor:
        """The final normed hidden state [hidden] of the i-th logits row of the last ``prefill_batch``."""
        return self._forward.last_hidden[i]

    def prefill(self, slot: int, prompt: PreparedPrompt) -> torch.Tensor:
        """The whole prompt into ``slot`` in one chunk (``prefill_batch``).  Returns fp32 logits [vocab_size] of
        its last position.  Raises as ``prefill_batch``."""
        return self.prefill_batch([PrefillItem(slot, prompt)]).reshape(-1)

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, slots: Sequence[int], tokens: Optional[torch.Tensor],
               token_table: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Feed one token to each of ``slots`` (all prefilled, distinct) and return their next-token logits.

        tokens: int64 [B] (any device), or None to feed each slot ``token_table[slot]`` (int64 [num_slots] on
        the runner's device, e.g. ``Sampler.last_tokens``: read on the device, so the host need not wait for the
        previous step's tokens).  A slot whose length reaches a new block takes one from the free list.  With
        CUDA graphs the only wait is for the previous step's input copy (queued before that step's graph, so
        already done when steps are launched one ahead).  Returns fp32 logits [B, vocab_size] on the runner's
        device.
        Raises ContextTooLong when a slot's cache is full (the scheduler should stop it one token earlier);
        ValueError for empty, duplicate or unprefilled slots, or tokens that do not match them;
        ``paged.OutOfBlocks`` when a slot needs a block and none is free (the scheduler preempts first).
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
        self.tables.ensure_all([(s, self.lengths[s] + 1) for s in slots])
        self.tables.flush()
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
