"""Tensor-level request types passed between prompt building, the scheduler, the executor and the runner.

Everything in a ``StepPlan`` is what rank 0 broadcasts to the worker ranks (tensors on CPU), so that every
rank runs exactly the same forward passes and samples exactly the same tokens.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class PreparedPrompt:
    """A fully processed prompt, ready for prefill.

    ``input_ids``: int64 [L] (image pads already expanded to one id per visual token).
    ``pixel_values``: float32 [num_patches, 3 * temporal_patch * patch * patch] or None.
    ``image_grid_thw``: int64 [num_images, 3] (t, h, w in patches) or None.
    ``mm_token_type_ids``: int64 [L] (1 at image-pad positions) or None.
    ``max_new_tokens``: tokens the reply may take after the context policy (may be clamped).
    ``notice``: user-facing description of what the context policy did ('' if nothing).
    ``dropped_messages``: messages the context policy left out (whole oldest turns), 0 if none.
    ``shared_prefix``: tokens the next prompt of the same conversation will share (``text_ids.shared_prefix``;
    the conversation cache keeps the state there), 0 if unknown.
    ``system_prefix``: tokens of the system block at the prompt's start (the tools block and system message,
    through its ``<|im_end|>\n``: what other conversations with the same system prompt and tools share;
    ``text_ids.system_prefix``), 0 without one.
    """

    input_ids: torch.Tensor
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    mm_token_type_ids: Optional[torch.Tensor] = None
    max_new_tokens: int = 2048
    notice: str = ""
    dropped_messages: int = 0
    shared_prefix: int = 0
    system_prefix: int = 0

    @functools.cached_property
    def num_tokens(self) -> int:
        """Tokens of the prompt (``input_ids.numel()``, read once: the scheduler asks for it per request and
        step)."""
        return int(self.input_ids.numel())


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling parameters (see ``qwen_chat.chat_types.GenerationSettings`` for units).

    ``temperature == 0`` means greedy.  ``seed`` is always set here (rank 0 draws one when the user gave none)
    so that every rank's generator starts from the same state.  ``frequency_penalty``: subtracted per earlier
    occurrence of a token in this reply.  ``logprobs``: None, or k: report each sampled token's log-probability
    and the k (0-20) most likely tokens (``SampledTokens.logprobs``).  ``reasoning_budget``: None, or the
    reasoning tokens allowed before the sampler emits ``think_end_id`` (``</think>``, 248069 in Qwen3.5:
    docs/facts.md, "Tokens") in place of the drawn token; a ``think_end_id`` the model samples itself ends
    the budget.
    """

    temperature: float
    top_p: float
    top_k: int
    presence_penalty: float
    seed: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    frequency_penalty: float = 0.0
    logprobs: Optional[int] = None
    reasoning_budget: Optional[int] = None
    think_end_id: int = 248069


@dataclass
class PrefillItem:
    """One prompt chunk of a step: the slot it goes into (0 .. num_slots-1), the prompt, its sampling settings,
    and which tokens: ``start``..``end``-1 (``end`` None: to the end of the prompt).

    A chunk with ``start == 0`` starts the sequence (its sampler state too); later chunks continue it.  The
    chunk that ends the prompt samples the sequence's first token.  ``copies``: ``(slot, sampling)`` of sibling
    sequences (the other choices of a request with n > 1) that start from this prefill, on its last chunk: the
    slot's state is copied into theirs (``ModelRunner.copy_slot``) and each draws its own first token from the
    same logits.  ``resume``: a preempted sequence recomputing its cache (``prompt`` = its prompt and the
    tokens it was fed); its sampler state is kept and nothing is sampled.  ``restore``: the state row of a kept
    prefix this sequence starts from (its first chunk then starts at that prefix's length; ``prefix_cache``),
    or None; it equals ``slot`` when the sequence takes the kept row over in place.  ``keeps``: (position p, row) pairs, p increasing: also keep the state at each position p
    (start < p <= end) in the empty state row ``row``, for later prompts that share the first p tokens
    (``prefix_cache``): a system prompt's end, a conversation turn's end.

    The one prompt-chunk type of every layer: the scheduler plans it, the executor broadcasts it, the runner's
    ``prefill_batch`` runs it (``sampling`` None: a chunk the runner alone is given, as the tests and the
    self-check do); ``forward.PrefillRows`` is only where its tokens sit in one packed forward.
    """

    slot: int
    prompt: PreparedPrompt
    sampling: Optional[SamplingParams] = None
    copies: list[tuple[int, SamplingParams]] = field(default_factory=list)
    start: int = 0
    end: Optional[int] = None
    resume: bool = False
    restore: Optional[int] = None
    keeps: tuple[tuple[int, int], ...] = ()

    @property
    def first(self) -> bool:
        """True for the chunk that starts the sequence (at 0, or right after the kept prefix it restores)."""
        return self.start == 0 or self.restore is not None

    def stop(self) -> int:
        """The end position of the chunk (``end``, or the prompt's length)."""
        return self.prompt.num_tokens if self.end is None else int(self.end)

    @property
    def last(self) -> bool:
        """True when this chunk ends the prompt."""
        return self.stop() == self.prompt.num_tokens

    @property
    def logits(self) -> bool:
        """Whether the runner returns the logits of the prompt's last token (not for a preempted sequence
        recomputing its cache: it needs no new token)."""
        return not self.resume


#: The token id an executor reports (host side only) for a row whose logits were not all finite (NaN or
#: infinity: corrupt weights or a numerical fault); the scheduler ends that request with an error
#: (``core.batch.Batch.deliver``).  Never a real id, and never fed to the model: the device keeps its draw.
NONFINITE_TOKEN = -1
#: What the user reads when a reply is ended that way (the details are in the engine's log).
NONFINITE_MESSAGE = ("the model produced invalid numbers (NaN or infinity) for this reply, so it was ended; "
                     "this points at damaged weights or a numerical fault on the server")


@dataclass(frozen=True)
class SampledLogprob:
    """The log-probabilities (natural log, fp32, under the model's raw logits) of one sampled token:
    ``logprob`` of the sampled id; ``top_ids``/``top_logprobs`` the k most likely ids of that step, most
    likely first."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class SampledTokens(dict):
    """What an executor's ``collect`` returns: ``{slot: sampled token id}`` (for a slot of a speculative step:
    the list of the 1 .. k + 1 ids it emitted, in order), plus ``logprobs`` ({slot: ``SampledLogprob``}) for the
    slots whose ``SamplingParams.logprobs`` is set."""

    def __init__(self, tokens=(), logprobs: Optional[dict] = None) -> None:
        super().__init__(tokens)
        self.logprobs: dict[int, SampledLogprob] = logprobs or {}


@dataclass
class StepPlan:
    """One engine step, identical on every rank.

    op: "step" (free, then prefill, then one decode over ``decode_slots``); the distributed layer adds "ping"
    (heartbeat, no work) and "exit" (the workers leave; ``qwen_chat.engine.parallel.executors``).
    ``free_slots``: sequences that finished, were cancelled or are preempted; their state and KV blocks are
    released first.
    ``prefills``: prompt chunks of this step, prefilled together (a sequence's first token is sampled from the
    logits of its prompt's last chunk).
    ``decode_slots``/``decode_tokens``: running sequences and the token each feeds in (int64 lists, same length).
    ``tokens_on_device``: each decoded slot feeds the last token sampled for it, read on the device
    (``decode_tokens`` is then ignored): the scheduler launches a step before the previous step's tokens
    reached the host.  Broadcast to other ranks only when every rank's sampler records rank 0's tokens
    (``Sampler.token_sync``; ``DistributedExecutor.tokens_on_device``), so that all ranks read equal tables.
    ``capture``: (padded batch, context bucket) decode graphs to capture first (``ModelRunner.capture_all``), sent
    while the engine is idle so that later steps find them ready.
    ``spec_k``: > 0 makes the decode a speculative step (``model.spec_step``): each decoded slot feeds its
    ``decode_tokens`` entry and k = ``spec_k`` draft tokens in one verify forward and may emit 1 .. k + 1
    tokens (then never ``tokens_on_device``).  ``drafts``: the k drafts of each decoded slot given by the
    scheduler (int lists; oracle drafts of the benchmark and tests), or empty: the MTP head drafts.
    ``spec_plain``: decoded slots that take no drafts in that step (sampled as in a plain step).
    ``blocks``: the KV block table entries the scheduler changed since its last plan, (slot, index, block id;
    the null block where an entry was let go), applied first (``paged.BlockTables.follow``), or None: no
    scheduler allocates (a plan built by hand: the runner allocates itself).  ``block_copies``: (source, target)
    KV blocks copied right after (the partly filled last block of a kept prefix a sequence starts from).
    """

    op: str = "step"
    free_slots: list[int] = field(default_factory=list)
    prefills: list[PrefillItem] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    tokens_on_device: bool = False
    capture: list[tuple[int, int]] = field(default_factory=list)
    spec_k: int = 0
    drafts: list[list[int]] = field(default_factory=list)
    spec_plain: list[int] = field(default_factory=list)
    blocks: Optional[list[tuple[int, int, int]]] = None
    block_copies: list[tuple[int, int]] = field(default_factory=list)
