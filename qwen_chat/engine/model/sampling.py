"""Batched next-token sampling on the logits' device, with one seeded generator per slot.

Order of operations per row (the OpenAI / vLLM definitions): temperature 0 (any temperature below
``GREEDY_TEMPERATURE_BELOW``, ``is_greedy``) -> argmax of the raw logits (greedy); otherwise presence penalty (subtract ``presence_penalty`` once from the logit of every token already
generated in this reply) -> divide by temperature -> keep the ``top_k`` largest (0 = all) -> keep the smallest
set of most likely tokens whose probability mass is >= ``top_p`` (always at least one) -> draw from the
renormalised distribution.

Randomness: each slot owns a ``torch.Generator`` on the sampler's device, seeded by ``start``.  It fills a block
of uniforms for that slot alone, and every ``sample`` call consumes exactly one uniform per row (inverse-CDF
draw), so a slot's tokens depend only on its seed and its logits, never on which other slots share the batch.
Every rank of a tensor-parallel group therefore samples identical tokens.

The frequency penalty (before the presence penalty; not at temperature 0, like it), the thinking budget (after
the draw) and log-probabilities are the per-slot rules of ``sampling_rules``; they cost nothing in batches
that do not use them.
Grammar masks of structured output (``constraints``, rank 0 only) come first: a constrained row's forbidden
tokens are -inf before everything above, greedy rows included (``qwen_chat.engine.core.constraints``).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from qwen_chat.engine.model.sampling_rules import FrequencyCounts, LogprobRows, ThinkingBudget, logprobs_of
from qwen_chat.engine.types import SamplingParams

log = logging.getLogger(__name__)

#: Uniforms drawn per refill of a slot's block (one per sampled token).
UNIFORM_BLOCK = 256
#: Largest top_k handled with ``torch.topk``; rows without top-k (0) use a full sort.
TOPK_FAST_LIMIT = 1024
#: Batches whose rows all have 0 < top_k <= FUSED_TOPK (Qwen's presets use 20) are sampled by
#: ``draw_top_k``, one fused function (compiled on CUDA) instead of ~40 separate small kernels per step.
FUSED_TOPK = 64
#: Temperatures below this are greedy (argmax), like vLLM's ``_SAMPLING_EPS``: dividing logits by a tinier
#: float32 overflows them to inf (NaN probabilities), and a subnormal one may be flushed to 0 on the device.
GREEDY_TEMPERATURE_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    """True when ``temperature`` (>= 0) means argmax decoding: below ``GREEDY_TEMPERATURE_BELOW``.  The one
    rule: ``Sampler.start`` stores 0 for such slots, so the host check and the logits' scaling agree."""
    return temperature < GREEDY_TEMPERATURE_BELOW


def scaled_logits(logits: torch.Tensor, presence: torch.Tensor, penalty: torch.Tensor,
                  temperature: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Presence penalty, then temperature: float32 [B, V].

    logits: float [B, V]; presence: bool [slots, V]; penalty, temperature: float32 [slots]; idx: int64 [B] (each
    row's slot).  Rows with temperature 0 are left unscaled (they are greedy and never drawn from).
    """
    x = logits.float() - penalty[idx][:, None] * presence[idx].float()
    temp = temperature[idx]
    return x / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]


def nucleus_probs(vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p over candidates sorted in descending order, renormalised.

    vals: float32 [B, n] sorted descending; k: int64 [B] (0 = no top-k); top_p: float32 [B].  Returns float32
    [B, n], rows summing to 1: the k best (all when k = 0), then the smallest prefix whose mass before each kept
    candidate is < top_p (the first candidate always kept), zeros elsewhere.
    """
    rank = torch.arange(vals.shape[-1], device=vals.device)[None, :]
    vals = vals.masked_fill((k[:, None] > 0) & (rank >= k[:, None]), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = probs * ((mass_before < top_p[:, None]) | (rank == 0))
    return probs / probs.sum(dim=-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw ``ids[b, j]`` for the first j whose cumulative probability exceeds ``u[b]`` times the row's mass.

    probs: float32 [B, n]; ids: int64 [B, n]; u: float32 [B] in [0, 1).  Returns int64 [B].  The target stays
    below the row's mass even where ``u * mass`` rounds up to it, so an entry of probability 0 (cut by top-k,
    top-p or a grammar) is never drawn.
    """
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    choice = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
    return ids.gather(1, choice)[:, 0]


def draw_top_k(logits: torch.Tensor, presence: torch.Tensor, penalty: torch.Tensor, temperature: torch.Tensor,
               top_k: torch.Tensor, top_p: torch.Tensor, idx: torch.Tensor, u: torch.Tensor,
               K: int) -> torch.Tensor:
    """One token per row for batches whose rows all have 0 < top_k <= K: the whole draw in one function, which
    ``torch.compile`` fuses into a few kernels on CUDA.

    logits: float [B, V]; presence: bool [slots, V]; penalty, temperature, top_p: float32 [slots]; top_k: int64
    [slots]; idx: int64 [B] (each row's slot); u: float32 [B] uniforms in [0, 1); K: static candidate count
    (<= V).  Returns int64 [B] (greedy rows, temperature 0, are not handled here: ``Sampler.sample_async``
    replaces them by the argmax, which as a separate kernel spreads over many thread blocks, while fused here it
    made the whole pass one block per row; measured: docs/performance.md).
    The same functions as the general path in ``Sampler.sample_async``; the K largest candidates cut to each
    row's own top_k are its top_k largest, in the same order.
    """
    vals, ids = torch.topk(scaled_logits(logits, presence, penalty, temperature, idx), K, dim=-1)
    return inverse_cdf(nucleus_probs(vals, top_k[idx], top_p[idx]), ids, u)



class Sampler:
    """Per-slot sampling state: parameters, generator, uniforms and presence flags.

    Args: num_slots (int); vocab_size (int, logits width V); device (where logits live); fused_top_k (int,
    default ``FUSED_TOPK``): batches whose rows all have 0 < top_k <= fused_top_k are drawn by ``draw_top_k``
    (0: never; tests compare the two paths).
    Memory: a bool [num_slots, V] presence table, a float32 [num_slots, V] frequency table
    (``sampling_rules.FrequencyCounts``) and a float32 [num_slots, UNIFORM_BLOCK] uniform table.
    """

    def __init__(self, num_slots: int, vocab_size: int, device, fused_top_k: int = FUSED_TOPK):
        self.num_slots = int(num_slots)
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        dev = self.device
        self.generators = [torch.Generator(device=dev) for _ in range(self.num_slots)]
        self.params: list[SamplingParams | None] = [None] * self.num_slots
        self.presence = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.bool, device=dev)
        self._uniform = torch.zeros(self.num_slots, UNIFORM_BLOCK, dtype=torch.float32, device=dev)
        self._next = [UNIFORM_BLOCK] * self.num_slots
        self._temperature = torch.zeros(self.num_slots, dtype=torch.float32, device=dev)
        self._top_p = torch.ones(self.num_slots, dtype=torch.float32, device=dev)
        self._top_k = torch.zeros(self.num_slots, dtype=torch.long, device=dev)
        self._penalty = torch.zeros(self.num_slots, dtype=torch.float32, device=dev)
        self._fused_k = min(int(fused_top_k), self.vocab_size)
        self.frequency = FrequencyCounts(self.num_slots, self.vocab_size, dev)
        self.budget = ThinkingBudget(self.num_slots, dev)
        #: The last token sampled for each slot (int64 [num_slots], on the device): the runner reads a decode
        #: step's inputs from here (``ModelRunner.decode(..., token_table=)``) without a trip through the host.
        self.last_tokens = torch.zeros(self.num_slots, dtype=torch.long, device=dev)
        self._true = torch.ones((), dtype=torch.bool, device=dev)
        #: Optional ``f(tokens int64 [B]) -> int64 [B]`` applied to every draw before it is recorded; under tensor
        #: parallelism ``collectives.broadcast_from_rank0``, so that every rank records and
        #: feeds rank 0's tokens (queued on the device, no host wait).
        self.token_sync: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        #: Optional grammar masks (``core.constraints.ConstraintTable``, set on rank 0 only): its
        #: ``mask(slots, logits)`` returns the logits with each constrained row's forbidden tokens at -inf, and
        #: ``drawn(slots, last_tokens)`` learns each draw's tokens (read back when the slot is masked next).
        self.constraints = None
        # Row indices and uniform columns reach the device through pinned buffers and asynchronous copies (a
        # plain torch.tensor(..., device="cuda") waits for the whole stream, so the host could not run ahead of
        # the GPU).  Two buffers: a step's copy may still be queued while the next step fills the other one.
        # (flat, so that the used part is one contiguous block: a strided pinned slice would be copied through
        # pageable memory, which waits for the stream)
        self._staging = ([torch.zeros(2 * self.num_slots, dtype=torch.long, pin_memory=True) for _ in range(2)]
                         if dev.type == "cuda" else None)
        self._staged = [None, None]  # the event after each buffer's copy
        self._stage_turn = 0
        # On CUDA the fused path is compiled (dynamic batch size); on CPU it runs as written.
        self._draw_top_k = (torch.compile(draw_top_k, dynamic=True, fullgraph=True) if dev.type == "cuda"
                            else draw_top_k)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile the fused top-k path (CUDA only) for one row and for a batch (B >= 2 shares one dynamic-shape
        compilation) before serving, so no request waits for it.  Reads the tables, changes nothing."""
        if self._draw_top_k is draw_top_k:
            return
        try:
            for b in (1, 2):
                idx = torch.zeros(b, dtype=torch.long, device=self.device)
                self._draw_top_k(torch.zeros(b, self.vocab_size, device=self.device), self.presence,
                                 self._penalty, self._temperature, self._top_k, self._top_p, idx,
                                 torch.zeros(b, device=self.device), self._fused_k)
        except Exception as exc:  # a compiler that fails on this GPU/driver: same maths, uncompiled
            log.warning("sampler: compiling the fused top-k path failed (%s); it runs uncompiled", exc)
            self._draw_top_k = draw_top_k

    def start(self, slot: int, params: SamplingParams) -> None:
        """Begin a new reply in ``slot``: store ``params``, seed the slot's generator with ``params.seed``
        and clear its presence flags.  Raises ValueError for parameters outside their domain."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
            raise ValueError(f"invalid sampling parameters {params}")
        self.params[slot] = params
        self.generators[slot].manual_seed(int(params.seed))
        self._next[slot] = UNIFORM_BLOCK  # refill from the fresh seed on first use
        self.presence[slot] = False
        self._temperature[slot] = 0.0 if is_greedy(params.temperature) else float(params.temperature)
        self._top_p[slot] = float(params.top_p)
        self._top_k[slot] = int(params.top_k) if 0 < params.top_k < self.vocab_size else 0
        self._penalty[slot] = float(params.presence_penalty)
        self.frequency.start(slot, params.frequency_penalty)
        self.budget.start(slot, params.reasoning_budget, params.think_end_id)

    def _to_device(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """int64 [len(rows), B] on the device from host ints, without waiting for the stream (CUDA: pinned
        double buffer and a non-blocking copy)."""
        if self._staging is None:
            return torch.tensor(rows, dtype=torch.long, device=self.device)
        turn = self._stage_turn
        self._stage_turn ^= 1
        if self._staged[turn] is not None:
            self._staged[turn].synchronize()  # that buffer's previous copy has been read by the GPU
        n = len(rows[0])
        buf = self._staging[turn][:len(rows) * n].view(len(rows), n)
        buf.copy_(torch.tensor(rows, dtype=torch.long))
        out = buf.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._staged[turn] = ev
        return out

    def _rows(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, u): each row's slot (int64 [B]) and one uniform in [0, 1) per row, each from its own slot's
        generator (float32 [B]), on the device."""
        cols = []
        for s in slots:
            if self._next[s] >= UNIFORM_BLOCK:
                self._uniform[s] = torch.rand(UNIFORM_BLOCK, generator=self.generators[s], device=self.device)
                self._next[s] = 0
            cols.append(self._next[s])
            self._next[s] += 1
        idx, col = self._to_device([list(slots), cols]).unbind(0)
        return idx, self._uniform[idx, col]

    def uniforms(self, slots: Sequence[int], m: int) -> torch.Tensor:
        """m (<= ``UNIFORM_BLOCK``) uniforms in [0, 1) per row, each row's the next m of its own slot's stream (a
        block with fewer than m left is refilled first): float32 [B, m] on the device.  Speculative steps draw
        theirs here (``spec_sampling``), so a slot's draws still depend only on its seed and its logits."""
        cols = []
        for s in slots:
            if self._next[s] + m > UNIFORM_BLOCK:
                self._uniform[s] = torch.rand(UNIFORM_BLOCK, generator=self.generators[s], device=self.device)
                self._next[s] = 0
            cols.append(self._next[s])
            self._next[s] += m
        idx, col = self._to_device([list(slots), cols]).unbind(0)
        return self._uniform[idx[:, None], col[:, None] + torch.arange(m, device=self.device)[None, :]]

    def _nucleus(self, slots: Sequence[int], logits: torch.Tensor, idx: torch.Tensor):
        """Penalised, tempered, top-k/top-p filtered distribution of each row, sorted by probability.

        Returns (probs float32 [B, n], token_ids int64 [B, n]); probs rows sum to 1, with zeros for removed
        tokens; n = V, or the largest top_k of the batch when every row has one.
        """
        x = scaled_logits(logits, self.presence, self._penalty, self._temperature, idx)
        ks = [self.params[s].top_k if 0 < self.params[s].top_k < self.vocab_size else 0 for s in slots]
        if min(ks) > 0 and max(ks) <= TOPK_FAST_LIMIT:
            vals, ids = torch.topk(x, max(ks), dim=-1)  # sorted descending
        else:
            vals, ids = torch.sort(x, dim=-1, descending=True)
        return nucleus_probs(vals, self._top_k[idx], self._top_p[idx]), ids

    def _check(self, slots: Sequence[int], logits: torch.Tensor) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(slots) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [{len(slots)}, {self.vocab_size}], got {tuple(logits.shape)}")
        for s in slots:
            if not 0 <= s < self.num_slots or self.params[s] is None:
                raise ValueError(f"slot {s} has no sampling parameters (call start first)")

    def sample(self, slots: Sequence[int], logits: torch.Tensor) -> list[int]:
        """Draw one token per row and mark it as present for its slot (``sample_async``, then wait for the
        result).  slots: B distinct slot ids; logits: float [B, V] on the sampler's device.  Returns B token
        ids."""
        return self.sample_async(slots, logits).tolist()

    @torch.no_grad()  # one grad mode for every caller: the compiled path's guards include it
    def sample_async(self, slots: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Draw one token per row, mark it as present for its slot and store it in ``last_tokens``, all queued
        on the device without waiting for it.  slots: B distinct slot ids; logits: float [B, V] on the
        sampler's device.  Returns int64 [B] on the device.  Raises ValueError for logits of the wrong shape or
        a slot without parameters."""
        slots = [int(s) for s in slots]
        self._check(slots, logits)
        if self.constraints is not None:
            logits = self.constraints.mask(slots, logits)
        idx, u = self._rows(slots)
        counted = self.frequency.active(slots)
        drawn = self.frequency.apply(logits, idx) if counted else logits  # greedy rows keep the raw logits
        if all(is_greedy(self.params[s].temperature) for s in slots):
            tokens = logits.float().argmax(dim=-1)
        else:
            if all(0 < self.params[s].top_k <= self._fused_k for s in slots):
                tokens = self._draw_top_k(drawn, self.presence, self._penalty, self._temperature, self._top_k,
                                          self._top_p, idx, u, self._fused_k)
            else:
                tokens = inverse_cdf(*self._nucleus(slots, drawn, idx), u)
            if any(is_greedy(self.params[s].temperature) for s in slots):
                tokens = torch.where(self._temperature[idx] == 0, logits.float().argmax(dim=-1), tokens)
        budgeted = self.budget.active(slots)
        if budgeted:
            tokens = self.budget.force(idx, tokens)
        if self.token_sync is not None:
            tokens = self.token_sync(tokens)
        self.presence.index_put_((idx, tokens), self._true)  # (a Python True here would synchronise)
        if counted:
            self.frequency.record(idx, tokens)
        if budgeted:
            self.budget.record(idx, tokens)
        self.last_tokens[idx] = tokens
        if self.constraints is not None:
            self.constraints.drawn(slots, self.last_tokens)
        return tokens

    @torch.no_grad()
    def logprobs_async(self, slots: Sequence[int], logits: torch.Tensor,
                       tokens: torch.Tensor) -> Optional[LogprobRows]:
        """Log-probabilities of a draw (``sample_async``'s ``slots``, ``logits`` [B, V] and returned ``tokens``
        int64 [B]) for the rows whose ``SamplingParams.logprobs`` is set, on the device; None (and no work)
        when no row asks.  Under the model's raw logits (``sampling_rules.logprobs_of``)."""
        rows = [(i, int(s)) for i, s in enumerate(slots) if self.params[int(s)].logprobs is not None]
        if not rows:
            return None
        ks = [int(self.params[s].logprobs) for _, s in rows]
        pick = None if len(rows) == len(slots) else self._to_device([[i for i, _ in rows]])[0]
        lg, tk = (logits, tokens) if pick is None else (logits.index_select(0, pick), tokens.index_select(0, pick))
        chosen, values, ids = logprobs_of(lg, tk, max(ks))
        return LogprobRows([s for _, s in rows], ks, chosen, values, ids)
