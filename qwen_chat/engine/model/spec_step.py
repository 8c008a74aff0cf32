"""One speculative decode step on a rank: drafts, the verify forward, acceptance, the exact state after it.

``Speculation`` is attached to a ``ModelRunner`` as ``runner.spec`` (``attach``) when ``--speculative-tokens``
is above 0; ``parallel.executors.LocalExecutor`` runs a plan's decode through ``decode`` when the plan's
``spec_k`` is set (the scheduler decides, ``core.batch``), and tells it about prefills (``chunks``: the MTP
layer's keys and values of the prompt; ``prefilled``: its position after the prompt) and plain decode steps
(``forget``: they leave no hidden states, so the MTP context restarts).
Every rank runs the same plan, so every rank drafts, verifies and accepts the same (``spec_sampling`` takes
rank 0's result under tensor parallelism).
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Optional, Sequence

import torch

from qwen_chat.engine.model.mtp import MtpDrafter
from qwen_chat.engine.model.mtp_graphs import DraftGraphs
from qwen_chat.engine.model.spec_sampling import accept_drafts
from qwen_chat.engine.model.speculative import Verifier, device_ints
from qwen_chat.engine.types import NONFINITE_TOKEN, PreparedPrompt, SamplingParams

log = logging.getLogger(__name__)


class Speculation:
    """The verify step and the drafter of one runner.

    Args: runner (``ModelRunner``), ``k`` (draft tokens per step at most, 1-3), ``max_batch`` (sequences a
    speculative step holds at most), ``drafter`` (an ``mtp.MtpDrafter``, or None: plans must then carry their
    drafts, as the oracle benchmark's and the tests' do).
    """

    def __init__(self, runner, *, k: int, max_batch: int, drafter: Optional[MtpDrafter] = None) -> None:
        self.runner, self.k, self.drafter = runner, int(k), drafter
        self.verifier = Verifier(runner, max_batch=max_batch, k=k)
        self.cost_ratio: Optional[float] = None  # a step with k drafts in plain decode steps (``calibrate``)
        if drafter is not None and runner.graphs is not None:  # the drafting in CUDA graphs too
            drafter.graphs = DraftGraphs(drafter, runner.graphs, scratch_slot=runner.num_slots,
                                         ladder=self.verifier.padded)

    def capture(self, context_buckets: Sequence[int]) -> int:
        """Capture the verify graphs (``Verifier.capture``) and the MTP head's drafting graphs of ``self.k``
        drafts for every padded batch and the context buckets given, ahead of serving.  Returns the graphs held
        (0 without CUDA graphs)."""
        held = self.verifier.capture(context_buckets)
        graphs = self.drafter.graphs if self.drafter is not None else None
        if graphs is not None:
            for b in self.verifier.padded:
                for ctx in context_buckets:
                    graphs.capture(b, ctx, self.k)
            held += graphs.count()
        return held

    @torch.no_grad()
    def step_time(self, sampler, k: int = 0, *, given: bool = False, steps: int = 8, warmup: int = 2,
                  prompt: Optional[PreparedPrompt] = None) -> float:
        """Median seconds of one decode step of one sequence (slot 0, after ``prompt``, default 16 tokens;
        greedy) over ``steps`` steps after ``warmup`` unmeasured ones: plain (k = 0), or speculative with k
        drafts from the MTP head, or ``given`` fixed drafts (the verify forward, acceptance and state rollback
        alone).  Slot 0 is free again afterwards.  Raises ValueError for k outside 0..``self.k``, RuntimeError
        for drafting without an MTP head, and what the steps raise."""
        if not 0 <= k <= self.k:
            raise ValueError(f"k must be in 0..{self.k}, got {k}")
        if k and not given and self.drafter is None:
            raise RuntimeError("no MTP head: a speculative step's cost with drafting cannot be measured")
        r = self.runner
        sync = torch.cuda.synchronize if r.device.type == "cuda" else (lambda: None)
        params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0,
                                max_new_tokens=10 ** 6, stop_token_ids=())
        tok = min(1000, r.vocab_size - 1)  # any id inside the vocabulary (a small test model has a few hundred)
        times = []
        try:
            r.free(0)
            self.forget([0])
            sampler.start(0, params)
            r.prefill(0, prompt or PreparedPrompt(input_ids=torch.arange(tok - 15, tok + 1)))
            for _ in range(warmup + steps):
                sync()
                t0 = time.perf_counter()
                if k:
                    self.decode(sampler, [0], [tok], k, drafts=[[tok] * k] if given else None)
                else:
                    sampler.sample_async([0], r.decode([0], torch.tensor([tok])))
                sync()
                times.append(time.perf_counter() - t0)
        finally:
            r.free(0)
            self.forget([0])
        return statistics.median(times[warmup:])

    def calibrate(self, sampler, steps: int = 8) -> float:
        """Measure what a step of ``self.k`` drafts from the MTP head costs in plain decode steps for one sequence
        (``step_time`` of each) and keep it as ``cost_ratio``.  Returns the ratio.  Raises as ``step_time``."""
        spec = self.step_time(sampler, self.k, steps=steps)
        self.cost_ratio = spec / self.step_time(sampler, 0, steps=steps)
        return self.cost_ratio

    def forget(self, slots: Sequence[int]) -> None:
        """These slots were freed, restarted or decoded without hidden states: their MTP context restarts."""
        if self.drafter is not None:
            for s in slots:
                self.drafter.forget(s)

    def chunks(self, items: Sequence) -> None:
        """The prompt chunks (``types.PrefillItem``) of the last ``prefill_batch``, in its order: the MTP layer's
        keys and values of their positions (``mtp.MtpDrafter.fill``)."""
        if self.drafter is None:
            return
        offset = 0
        dev = self.runner.device
        for item in items:
            if item.first:
                self.drafter.forget(item.slot)
            end = item.stop()
            ids = item.prompt.input_ids.reshape(-1)
            nxt = device_ints(ids[item.start + 1:min(end + 1, item.prompt.num_tokens)].tolist(), dev)
            self.drafter.fill(item.slot, item.start, end - item.start, offset, nxt, item.first)
            offset += end - item.start

    def prefilled(self, slots: Sequence[int], last_pos: int, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """A prompt ended at position ``last_pos`` with final hidden state ``hidden`` [H]; ``slots`` (the prompt's
        slot and its copies) drew their first ``tokens`` (int64 [g]): the MTP head's next position."""
        if self.drafter is None:
            return
        for s in slots[1:]:
            self.drafter.share(slots[0], s)
        g = len(slots)
        self.drafter.record(slots, [last_pos] * g, hidden.reshape(1, 1, -1).expand(g, 1, -1),
                            tokens.reshape(g, 1), [1] * g)

    def decode(self, sampler, slots: Sequence[int], last_tokens: Sequence[int], k: int,
               drafts: Optional[list] = None, plain: Sequence[int] = ()
               ) -> tuple[dict[int, list[int]], list[int], Optional[torch.Tensor]]:
        """One speculative step of ``slots``, each feeding its ``last_tokens`` entry and k drafts (``drafts``
        given, else the MTP head's).  The slots in ``plain`` take no drafts: they keep only their first verified
        token's logits, for the caller to draw as in a plain step (``Sampler.sample_async``, with everything a
        plain draw supports).  Returns ({slot: the 1 .. k + 1 ids it emits, ``[NONFINITE_TOKEN]`` when its verify
        logits were not all finite} for the speculating slots, the plain slots in order, their logits fp32 [P, V]
        or None).  Waits for the device (the host needs the accepted counts).  Raises ValueError for k outside
        1..``self.k`` or drafts of the wrong shape, and as ``Verifier.verify``."""
        if not 1 <= k <= self.k:
            raise ValueError(f"a speculative step takes 1..{self.k} drafts, got {k}")
        slots = [int(s) for s in slots]
        dev = self.runner.device
        last = device_ints([int(t) for t in last_tokens], dev)
        self.verifier.prepare(slots, k + 1)
        plain = set(int(s) for s in plain)
        spec = [b for b, s in enumerate(slots) if s not in plain]
        flat = [b for b, s in enumerate(slots) if s in plain]
        pick = device_ints(spec, dev) if spec else None
        grammar = getattr(sampler, "constraints", None)  # rank 0's grammar masks (core.constraints.ConstraintTable), or None
        constrained = grammar is not None and any(slots[b] in grammar.slots for b in spec)
        if drafts:
            if len(drafts) != len(slots) or any(len(d) < k for d in drafts):
                raise ValueError(f"{len(slots)} slots need {k} drafts each")
            guess = device_ints([[int(t) for t in d[:k]] for d in drafts], dev)
        else:  # the MTP head drafts for the speculating slots; the others' rows only need some token
            guess = last[:, None].repeat(1, k)
            if self.drafter is not None and spec:
                # a grammar masks the head's draws too, on one rank (under tensor parallelism every rank must
                # chain the same drafts through the sharded head, and only rank 0 has the grammar: unmasked)
                masked = constrained and sampler.token_sync is None
                guess[pick] = self.drafter.propose([slots[b] for b in spec], last[pick], k,
                                                   mask=grammar.mask_next_draft if masked else None)
                if sampler.token_sync is not None:  # every rank verifies rank 0's drafts (as it feeds its tokens)
                    guess = sampler.token_sync(guess.contiguous())
        if constrained:  # the drafts go to the host while the verify runs: the matchers walk them
            drafted = _to_host(guess[pick])
        logits, hidden, start = self.verifier.verify(slots, torch.cat([last[:, None], guess], dim=1))
        counts = torch.ones(len(slots), dtype=torch.long, device=dev)
        if spec:  # everything up to the one host wait below is queued on the device (with a grammar: two)
            verified = logits[pick]
            if constrained:  # every verified position masked as a plain draw is (constraints.mask_drafts)
                verified = grammar.mask_drafts([slots[b] for b in spec], verified, drafted())
            tokens, kept = accept_drafts(sampler, [slots[b] for b in spec], verified, guess[pick])
            counts[pick] = kept
            if self.drafter is not None:
                self.drafter.stage([slots[b] for b in spec], hidden[pick], tokens)
        self.verifier.restore(counts)
        if spec:  # each row's verify window finite (one row sum, as ``sampling_rules.mark_nonfinite``) or not
            finite = torch.isfinite(logits[pick].sum(dim=(1, 2), dtype=torch.float32)).long()
        host = torch.cat([tokens.reshape(-1), kept, finite]).tolist() if spec else []
        runs: dict[int, list[int]] = {}
        if spec:
            T, n = k + 1, len(spec)
            kept_h, finite_h = host[n * T:n * T + n], host[n * T + n:]
            for i, b in enumerate(spec):
                runs[slots[b]] = host[i * T:i * T + kept_h[i]] if finite_h[i] else [NONFINITE_TOKEN]
            if self.drafter is not None:
                self.drafter.note([slots[b] for b in spec], [start[b] for b in spec], kept_h)
            if constrained:
                grammar.emitted(runs)
        self.verifier.advance(slots, [len(runs.get(s, (0,))) for s in slots])
        if not flat:
            return runs, [], None
        self.forget([slots[b] for b in flat])
        return runs, [slots[b] for b in flat], logits[device_ints(flat, dev), 0]


def _to_host(t: torch.Tensor):
    """Start copying ``t`` to the host (pinned, without waiting, on CUDA); returns a function that waits for
    that copy alone (not for the work queued after it) and gives its values as nested lists."""
    if t.device.type != "cuda":
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> list:
        copied.synchronize()
        return host.tolist()
    return wait


def attach(runner, head, *, k: int, max_batch: int) -> Speculation:
    """Give ``runner`` its ``Speculation`` (``runner.spec``) drafting with ``head`` (an ``mtp.MtpHead`` from
    ``mtp.load_mtp_head``), or without a drafter (plans must carry their drafts) when ``head`` is None."""
    if head is None:
        log.warning("speculative decoding: the checkpoint has no MTP head; only drafts given with the plan work")
    drafter = MtpDrafter(head, runner, k=k) if head is not None else None
    runner.spec = Speculation(runner, k=k, max_batch=max_batch, drafter=drafter)
    log.info("speculative decoding: %d draft token(s) per step from %s, batches of up to %d sequences", k,
             "the checkpoint's MTP head" if head is not None else "the plans", max_batch)
    return runner.spec
