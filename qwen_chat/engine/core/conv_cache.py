"""The conversation cache's index on the scheduler: which kept prefix states exist, which prompt may continue
which, and which to evict.

What is kept (the chat template decides what a follow-up shares): Qwen3.5's template renders an earlier reply
as its text only, without the reasoning and without the empty ``<think></think>`` block a reply generated with
thinking off starts with, so the next prompt of a conversation shares the previous prompt up to the end of its
last ``<|im_start|>assistant\\n`` header, and no further (``PreparedPrompt.shared_prefix``).  The state at that
position is kept while the prompt is prefilled (a keep point: ``types.PrefillItem.keeps``); a follow-up then
prefills the previous reply's text, its own message and the generation prompt.  A Regenerate sends the same
prompt again and prefills only the generation prompt; an edited earlier message falls back to the prefix of an
earlier turn, when still kept, or to a full prefill.

Conversations that share a system prompt (and tools block) share its state too: a prompt whose system block
is at least ``SYSTEM_KEEP_MIN_TOKENS`` long also keeps the state where that block ends
(``PreparedPrompt.system_prefix``), unless a kept prefix already holds exactly those tokens, so the next
conversation with the same system prompt prefills only its own messages.  Such an entry is counted apart
(``system_hits``); it is kept, matched and evicted like any other.

Matching is by token ids (the longest kept prefix that equals the prompt's first tokens and leaves at least one
token to prefill) and by image content: image-pad ids are the same for every image, so each image inside a
prefix is also compared by a digest of its pixel values and grid.

Each kept prefix takes a state row that no running sequence uses and shares KV blocks (``kv_budget``); rows and
blocks go to running sequences first: the least recently used prefix is evicted when a new sequence needs a row
or blocks; when the only row to be had holds the very prefix a waiting prompt starts from, the prompt takes that
row over and the prefix is no longer kept (``prefill_plan``).  A prefix restored by the plan being built is
pinned until that plan is sent (a running sequence
that started from a prefix holds its own copy of the state and its own references to the shared blocks).
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Collection, Optional

import torch

from qwen_chat.engine.types import PreparedPrompt


#: Shortest system block (tokens) whose state is kept for other conversations.  A kept prefix takes a state
#: row of its own (the Gated DeltaNet state of every layer: about 50 MiB for Qwen3.5-9B, docs/facts.md)
#: that a running sequence could use; a shorter block costs little to prefill again.  The template's tools
#: block alone is about 330 tokens, so every request with tools qualifies.
SYSTEM_KEEP_MIN_TOKENS = 128


@dataclass(frozen=True)
class PromptKey:
    """What matching compares: ``ids`` int64 [L] (host), ``images``: (first pad position, digest) per image in
    order, ``keeps``: the positions to keep the state at, increasing (the system block's end when long enough,
    ``PreparedPrompt.system_prefix``; the end of the last assistant header, ``PreparedPrompt.shared_prefix``);
    ``system_at``: the system block's end when it is among ``keeps``, else 0."""

    ids: torch.Tensor
    images: tuple[tuple[int, bytes], ...]
    keeps: tuple[int, ...]
    system_at: int = 0

    def images_before(self, n: int) -> tuple[tuple[int, bytes], ...]:
        """The images among the first ``n`` tokens (what a kept prefix of ``n`` tokens holds)."""
        return tuple(im for im in self.images if im[0] < n)

    def extended(self, ids: torch.Tensor) -> "PromptKey":
        """The key of a longer sequence with the same images (a preempted sequence's prompt and fed tokens)."""
        return PromptKey(ids, self.images, self.keeps, self.system_at)


def prompt_key(prompt: PreparedPrompt) -> PromptKey:
    """The key of a prompt: its ids, a blake2b digest of each image's pixel rows and grid (the i-th run of
    image-pad positions in ``mm_token_type_ids`` is image i; ``image_grid_thw`` t*h*w rows of
    ``pixel_values`` each; without ``mm_token_type_ids`` one digest of all pixels, at position 0, so that only
    prompts with the same images match), and its keep point."""
    ids = prompt.input_ids.reshape(-1).to(torch.long).cpu()
    images = []
    if prompt.pixel_values is not None and prompt.image_grid_thw is not None and prompt.mm_token_type_ids is not None:
        mm = prompt.mm_token_type_ids.reshape(-1).cpu()
        starts = torch.nonzero((mm[1:] == 1) & (mm[:-1] == 0)).reshape(-1) + 1
        if mm.numel() and int(mm[0]) == 1:
            starts = torch.cat([torch.zeros(1, dtype=torch.long), starts])
        rows = 0
        pixels = prompt.pixel_values.detach().cpu().contiguous()
        for start, grid in zip(starts.tolist(), prompt.image_grid_thw.tolist()):
            n = int(grid[0] * grid[1] * grid[2])
            h = hashlib.blake2b(digest_size=16)
            h.update(str(grid).encode())
            h.update(pixels[rows:rows + n].numpy().tobytes())
            images.append((int(start), h.digest()))
            rows += n
    elif prompt.pixel_values is not None:  # images without their positions: one digest of all, at position 0
        h = hashlib.blake2b(prompt.pixel_values.detach().cpu().contiguous().numpy().tobytes(), digest_size=16)
        images.append((0, h.digest()))
    L = ids.numel()
    system = int(prompt.system_prefix)
    system = system if SYSTEM_KEEP_MIN_TOKENS <= system < L else 0
    keeps = sorted({p for p in (system, int(prompt.shared_prefix)) if 0 < p < L})
    return PromptKey(ids, tuple(images), tuple(keeps), system)


@dataclass
class Entry:
    """One kept prefix: its state ``row``, ``n`` tokens, their ids (int64 [n], host) and the images among them,
    ``used``: the cache's clock at its last use (LRU); ``system``: it is a system block's end (shared by
    conversations), not a conversation turn's."""

    row: int
    n: int
    ids: torch.Tensor
    images: tuple[tuple[int, bytes], ...]
    used: int
    system: bool = False


class ConversationCache:
    """The kept prefixes of one scheduler (see the module docstring).  Not thread-safe: the scheduler's lock
    guards it.  Counters: ``queries`` (prompts looked up), ``hits``, ``cached_tokens`` (prompt tokens not
    prefilled thanks to a hit), ``system_hits`` (hits on a system block's entry)."""

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._clock = itertools.count()
        self.queries = self.hits = self.cached_tokens = self.system_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, row: int) -> bool:
        return row in self._entries

    def holds(self, entry: "Entry") -> bool:
        """True while ``entry`` is kept (not evicted, its row not reused)."""
        return self._entries.get(entry.row) is entry

    def rows(self) -> list[int]:
        """State rows that hold kept prefixes."""
        return list(self._entries)

    def match(self, key: PromptKey, unwritten: Collection[int] = ()) -> Optional[Entry]:
        """The longest kept prefix of ``key``'s prompt that leaves at least one token to prefill, or None;
        marks it used.  ``unwritten``: rows whose prefix the plan being built keeps (its prefill writes them
        when the plan runs, after the plan's restores), which cannot be started from yet."""
        L = key.ids.numel()
        best = None
        for e in self._entries.values():
            if e.n >= L or (best is not None and e.n <= best.n) or e.row in unwritten:
                continue
            if not torch.equal(key.ids[:e.n], e.ids):
                continue
            if key.images_before(e.n) != e.images:
                continue
            best = e
        if best is not None:
            best.used = next(self._clock)
        return best

    def record(self, hit: Optional[Entry]) -> None:
        """Count one admitted prompt and its hit (None: a miss)."""
        self.queries += 1
        if hit is not None:
            self.hits += 1
            self.cached_tokens += hit.n
            self.system_hits += int(hit.system)

    def holds_prefix(self, key: PromptKey, n: int) -> bool:
        """True when a kept prefix holds exactly the first ``n`` tokens of ``key``'s prompt (and its images)."""
        images = key.images_before(n)
        return any(e.n == n and e.images == images and torch.equal(key.ids[:n], e.ids)
                   for e in self._entries.values())

    def add(self, row: int, key: PromptKey, n: int) -> Entry:
        """Register the prefix of ``n`` tokens of ``key``'s prompt as kept in ``row``."""
        e = Entry(row, n, key.ids[:n].clone(), key.images_before(n), next(self._clock),
                  system=n == key.system_at)
        self._entries[row] = e
        return e

    def victim(self, pinned: set) -> Optional[int]:
        """The row of the least recently used prefix not in ``pinned``, or None."""
        free = [e for e in self._entries.values() if e.row not in pinned]
        return min(free, key=lambda e: e.used).row if free else None

    def remove(self, row: int) -> None:
        """Forget the prefix kept in ``row`` (the caller frees the row)."""
        self._entries.pop(row, None)
