"""A small random Qwen3.5 (fp32, CPU) and the reference comparisons the runner tests make against transformers.

The reference is a full forward of ``Qwen3_5ForConditionalGeneration`` over the whole sequence so far (prompt,
image inputs and every token fed in), compared at the last position.  Relative error (``rel_err``) =
max |ours - ref| / max |ref| over the vocabulary; ``TOL`` is the bound the CPU fp32 parity tests hold the
runner to (measured: docs/performance.md, "Correctness").

Used by tests/engine/test_runner.py, tests/engine/test_scheduler.py, tests/gpu/test_runner_cuda.py and
tests/support/triton_checks.py; ``tiny_prompts`` (a text and an image prompt for the tiny checkpoint) by
tests/engine/test_lora.py and tests/engine/test_fp8.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from qwen_chat.engine.types import PreparedPrompt

if TYPE_CHECKING:
    from qwen_chat.engine.model.runner import ModelRunner

IMAGE, VSTART, VEND = 300, 302, 303  # image pad, vision start, vision end token ids of ``small_config``
VOCAB = 320
TOL = 1e-4


def small_config() -> Qwen3_5Config:
    """8 text layers (3 linear + 1 full) x 2, so two full-attention layers; GQA 4/2; linear heads 2 key / 4 value
    (grouped like the 9B's 16/32); partial interleaved M-RoPE (rotary dim 8 = sections 2+1+1 pairs)."""
    return Qwen3_5Config(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_kernel_dim=4, vocab_size=VOCAB,
            max_position_embeddings=4096, rms_norm_eps=1e-6, attn_output_gate=True, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, full_attention_interval=4),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           in_channels=3, deepstack_visual_indexes=[]),
        image_token_id=IMAGE, video_token_id=301, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=False)


def small_model() -> Qwen3_5ForConditionalGeneration:
    """The fp32 model of ``small_config`` on CPU with seed 0 and non-trivial norm weights (they initialise to the
    identity), in eval mode."""
    torch.manual_seed(0)
    m = Qwen3_5ForConditionalGeneration(small_config()).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0.0, 0.3)
    return m


def tiny_prompts(loaded, text: str) -> dict[str, PreparedPrompt]:
    """{"text": ``text`` tokenized, "image": a user message with tests/fixtures/images/chelsea.png (64 visual
    tokens) through the chat template} for the tiny checkpoint's ``LoadedModel``."""
    from qwen_chat.chat_types import ChatMessage
    from qwen_chat.engine.text.prompt import build_prompt

    image = Path(__file__).resolve().parents[1] / "fixtures" / "images" / "chelsea.png"
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[0]
    message = ChatMessage("user", "What animal is this?", images=(str(image),))
    return {"text": PreparedPrompt(input_ids=ids),
            "image": build_prompt(loaded, [message], enable_thinking=False, image_token_budget=64,
                                  context_length=4096, max_new_tokens=16)}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|, computed in fp32 (any shapes that broadcast)."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def decode_steps(runner, model, seqs: dict, gen: torch.Generator, steps: int) -> list[float]:
    """``steps`` batched decode steps of every slot in ``seqs`` ({slot: Seq}) with random tokens (< 290); each
    row's relative error against transformers on the whole sequence (``Seq.reference``)."""
    errs = []
    for _ in range(steps):
        slots = list(seqs)
        toks = torch.randint(0, 290, (len(slots),), generator=gen)
        for s, t in zip(slots, toks.tolist()):
            seqs[s].ids.append(t)
        out = runner.decode(slots, toks)
        errs += [rel_err(out[r], seqs[s].reference(model)) for r, s in enumerate(slots)]
    return errs


class Seq:
    """One sequence fed to the runner, with what the reference needs to recompute it from scratch."""

    def __init__(self, ids, image=None):
        self.ids = list(ids)
        self.image = image  # (pixel_values, grid) or None

    def prompt(self) -> PreparedPrompt:
        """The runner's input: int64 token ids, plus pixel values, the t x h x w grid and image-token mask."""
        ids = torch.tensor(self.ids)
        if self.image is None:
            return PreparedPrompt(input_ids=ids)
        pv, grid = self.image
        return PreparedPrompt(input_ids=ids, pixel_values=pv, image_grid_thw=grid,
                              mm_token_type_ids=(ids == IMAGE).long())

    @torch.no_grad()
    def reference(self, model) -> torch.Tensor:
        """The transformers model's logits at the last position, fp32 [vocab]."""
        ids = torch.tensor([self.ids])
        kw = {}
        if self.image is not None:
            kw = dict(pixel_values=self.image[0], image_grid_thw=self.image[1],
                      mm_token_type_ids=(ids == IMAGE).long())
        return model(input_ids=ids, **kw).logits[0, -1]


def text_ids(gen: torch.Generator, n: int) -> list[int]:
    """``n`` random text token ids below 290 (clear of the special ids)."""
    return torch.randint(0, 290, (n,), generator=gen).tolist()


def image_seq(gen: torch.Generator, grid=(1, 4, 6)) -> Seq:
    """Text, one image of grid t x h x w patches (h*w/4 merged tokens), text."""
    t, h, w = grid
    pv = torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=gen)
    n_tok = t * h * w // 4
    ids = text_ids(gen, 5) + [VSTART] + [IMAGE] * n_tok + [VEND] + text_ids(gen, 7)
    return Seq(ids, (pv, torch.tensor([list(grid)])))


class LiveBatch:
    """Sequences joining, decoding together and leaving one runner, each step compared with the reference.

    ``errs`` collects the relative error of every prefill and of every row of every decode step.
    """

    def __init__(self, runner: "ModelRunner", model, gen: torch.Generator):
        self.runner, self.model, self.gen = runner, model, gen
        self.live: dict[int, Seq] = {}
        self.errs: list[float] = []

    def join(self, slot: int, seq: Seq) -> None:
        """Prefill ``seq`` into ``slot`` and compare its logits."""
        self.live[slot] = seq
        self.errs.append(rel_err(self.runner.prefill(slot, seq.prompt()), seq.reference(self.model)))

    def step(self, n: int) -> None:
        """``n`` batched decode steps of every live slot with random tokens, each row compared."""
        for _ in range(n):
            slots = list(self.live)
            toks = torch.randint(0, 290, (len(slots),), generator=self.gen)
            for s, t in zip(slots, toks.tolist()):
                self.live[s].ids.append(t)
            out = self.runner.decode(slots, toks.to(self.runner.device))
            assert out.shape == (len(slots), self.runner.vocab_size) and out.dtype == torch.float32
            self.errs.extend(rel_err(out[r], self.live[s].reference(self.model)) for r, s in enumerate(slots))

    def leave(self, slot: int) -> None:
        """Free ``slot``."""
        self.runner.free(slot)
        del self.live[slot]
