"""Input embeddings and M-RoPE positions of prompt chunks, with each prompt's image features kept between its
chunks.

A prompt prefilled in several chunks (a long prompt under the per-step token budget) runs the vision tower once,
at its first chunk, over all its images; later chunks take their image rows from the kept features, so a chunk
boundary may fall anywhere, inside an image's tokens too.  A prompt that continues a kept prefix (its first
chunk starts after position 0) skips the images that lie wholly inside that prefix: their features are
already in the kept state.  Positions: ``model.model.get_rope_index`` over the
whole prompt when it has images (its delta is kept for the slot's decode positions), else 0..L-1 on all three
M-RoPE axes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from qwen_chat.chat_types import InvalidInput
from qwen_chat.engine.model import vision_patch
from qwen_chat.engine.types import PreparedPrompt


@dataclass
class _ImagePrompt:
    """What the later chunks of an image prompt need: features [n_image_tokens, hidden] (model dtype), the
    whole prompt's positions int64 [3, L], the count of image tokens before each position int64 [L + 1] (host),
    the M-RoPE delta, and ``skipped``: the image tokens of the images not encoded (inside a kept prefix)."""

    feats: torch.Tensor
    pos: torch.Tensor
    before: torch.Tensor
    delta: int
    skipped: int = 0


class PromptInputs:
    """Embeds prompt chunks for one runner (see the module docstring).

    Args: model (``Qwen3_5ForConditionalGeneration``), device, dtype (of the embeddings).
    """

    def __init__(self, model, *, device: torch.device, dtype: torch.dtype) -> None:
        vision_patch.patch_embed_as_gemm(model)  # no per-image-size convolution plan (vision_patch)
        self._core = model.model
        self._embed = model.model.language_model.embed_tokens
        self._rotary = model.model.language_model.rotary_emb
        self.image_token_id = int(model.config.image_token_id)
        self._merge = int(model.config.vision_config.spatial_merge_size) ** 2
        self.device, self.dtype = device, dtype
        self._images: dict[int, _ImagePrompt] = {}

    def check(self, prompt: PreparedPrompt) -> None:
        """Refuse what the forward cannot take, before any state changes.  Raises InvalidInput: an empty prompt,
        token ids outside the embedding table, pixel_values without image_grid_thw."""
        ids = prompt.input_ids.reshape(-1)
        if ids.numel() == 0:
            raise InvalidInput("empty prompt")
        lo, hi = int(ids.min()), int(ids.max())  # an out-of-range id would be a device-side assert on CUDA
        if lo < 0 or hi >= self._embed.num_embeddings:
            raise InvalidInput(f"prompt token ids must be in 0..{self._embed.num_embeddings - 1} (got {lo}..{hi})")
        if prompt.pixel_values is not None and prompt.image_grid_thw is None:
            raise InvalidInput("pixel_values given without image_grid_thw")

    def start(self, slot: int, prompt: PreparedPrompt, first: int = 0) -> int:
        """A prompt's first chunk, starting at position ``first`` (0, or the length of the kept prefix it
        continues): run the vision tower over its images (kept for its later chunks), except those wholly before
        ``first``, and return its M-RoPE delta (0 without images).  Raises InvalidInput when the image-pad count
        does not match the images' features."""
        self._images.pop(slot, None)
        if prompt.pixel_values is None:
            return 0
        ids = prompt.input_ids.to(self.device, torch.long).reshape(-1)
        grid_host = prompt.image_grid_thw.to(torch.long)
        grid = grid_host.to(self.device)
        before = torch.zeros(ids.numel() + 1, dtype=torch.long)  # on the host: chunks read it without a sync
        before[1:] = (prompt.input_ids.reshape(-1) == self.image_token_id).long().cumsum(0)
        ends = (grid_host.prod(dim=-1) // self._merge).cumsum(0)  # image tokens up to the end of each image
        skip = int((ends <= before[first]).sum()) if first else 0
        skipped = int(ends[skip - 1]) if skip else 0
        patches = int(grid_host[:skip].prod(dim=-1).sum()) if skip else 0
        if skip < grid_host.shape[0]:
            out = self._core.get_image_features(prompt.pixel_values[patches:].to(self.device), grid[skip:])
            feats = out.pooler_output if hasattr(out, "pooler_output") else out
            if isinstance(feats, (list, tuple)):
                feats = torch.cat(list(feats), dim=0)
        else:
            feats = torch.zeros(0, self._embed.embedding_dim, device=self.device)
        mask = ids == self.image_token_id
        if int(before[-1]) - skipped != feats.shape[0]:
            where = " after the kept prefix" if skipped else ""
            raise InvalidInput(f"prompt has {int(before[-1]) - skipped} image-pad tokens{where} but the images "
                               f"give {feats.shape[0]} features")
        mm = prompt.mm_token_type_ids
        mm = mask.long() if mm is None else mm.to(self.device, torch.long).reshape(-1)
        pos, deltas = self._core.get_rope_index(ids[None], mm_token_type_ids=mm[None], image_grid_thw=grid)
        delta = int(deltas.reshape(-1)[0])
        self._images[slot] = _ImagePrompt(feats.to(self.dtype), pos[:, 0].to(self.device), before, delta, skipped)
        return delta

    def embed(self, chunks: Sequence[tuple[int, PreparedPrompt, int, int]]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(emb [T, hidden], cos [T, rot], sin [T, rot]) of prompt chunks ``(slot, prompt, start, end)`` packed in
        order (T = the sum of end - start).  The token ids go to the device in one copy.  ``start`` must have been
        called for each image prompt's slot first."""
        ids_host = torch.cat([p.input_ids.reshape(-1)[a:b].to(torch.long) for _, p, a, b in chunks])
        if self.device.type == "cuda":
            ids = ids_host.pin_memory().to(self.device, non_blocking=True)
        else:
            ids = ids_host
        emb = self._embed(ids).to(self.dtype)
        pos, offset = [], 0
        for slot, _, start, end in chunks:
            n = end - start
            img: Optional[_ImagePrompt] = self._images.get(slot)
            if img is None:
                pos.append(torch.arange(start, end, device=self.device).view(1, -1).expand(3, -1))
            else:
                rows = slice(offset, offset + n)
                mask = ids[rows] == self.image_token_id
                first = int(img.before[start]) - img.skipped
                count = int(img.before[end]) - first
                if count:
                    emb[rows][mask] = img.feats[first:first + count]
                pos.append(img.pos[:, start:end])
            offset += n
        positions = torch.cat(pos, dim=1) if len(pos) > 1 else pos[0]
        cos, sin = self._rotary(emb[None], positions[:, None, :])
        return emb, cos[0], sin[0]

    def done(self, slot: int) -> None:
        """Forget what was kept for ``slot``'s prompt (its last chunk ran, or the slot was freed)."""
        self._images.pop(slot, None)
