"""CPU parity of the engine's ModelRunner against the reference transformers model (fp32, small config).

The reference is a full forward of ``Qwen3_5ForConditionalGeneration`` over the whole sequence so far (prompt,
image inputs and every token fed in), compared at the last position.  Relative error = max |ours - ref| /
max |ref| over the vocabulary; the bound 1e-4 is the parity the engine must keep with transformers.
"""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from qwen_chat.chat_types import ContextTooLong, InvalidInput
from qwen_chat.engine.model.glue import attn_core
from qwen_chat.engine.types import PreparedPrompt
from qwen_chat.engine.model.fusion import fuse_linears
from qwen_chat.engine.model.options import RunnerOptions
from qwen_chat.engine.model.paged import OutOfBlocks
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PrefillItem
from qwen_chat.engine.parallel.tp_decode import LocalDecode
from tests.support.small_model import (IMAGE, TOL, VOCAB, LiveBatch, Seq, decode_steps, image_seq, rel_err,
                                       small_config, small_model, text_ids)


@pytest.fixture(scope="module")
def model():
    return small_model()


def run_decode_parity(model, seq: Seq, steps: int, gen: torch.Generator) -> list[float]:
    runner = ModelRunner(model, num_slots=2, max_context=256, device="cpu")
    errs = [rel_err(runner.prefill(1, seq.prompt()), seq.reference(model))]
    for _ in range(steps):
        tok = int(torch.randint(0, 290, (1,), generator=gen))
        seq.ids.append(tok)
        errs.append(rel_err(runner.decode([1], torch.tensor([tok]))[0], seq.reference(model)))
    return errs


def test_text_prefill_and_32_decode_steps_match_reference(model):
    gen = torch.Generator().manual_seed(1)
    errs = run_decode_parity(model, Seq(text_ids(gen, 37)), 32, gen)
    assert len(errs) == 33
    assert max(errs) <= TOL, errs


def test_image_prefill_and_32_decode_steps_match_reference(model):
    gen = torch.Generator().manual_seed(2)
    seq = image_seq(gen)
    runner_probe = ModelRunner(model, num_slots=1, max_context=64, device="cpu")
    runner_probe.prefill(0, seq.prompt())
    # A 4x6 patch grid merges to 2x3 tokens: the image spans max(2, 3) = 3 positions for 6 tokens -> delta -3.
    assert runner_probe.rope_deltas[0] == -3
    errs = run_decode_parity(model, seq, 32, gen)
    assert max(errs) <= TOL, errs


def test_image_changes_logits(model):
    """The vision path is really used: other pixels, other logits (guards against ignoring the image)."""
    gen = torch.Generator().manual_seed(3)
    a = image_seq(gen)
    b = Seq(a.ids, (torch.randn(a.image[0].shape, generator=gen), a.image[1]))
    runner = ModelRunner(model, num_slots=2, max_context=64, device="cpu")
    la, lb = runner.prefill(0, a.prompt()), runner.prefill(1, b.prompt())
    assert rel_err(la, lb) > 1e-3


def test_batch_of_sequences_joining_and_leaving(model):
    """Slots of different lengths decode together; sequences join, leave and a freed slot is reused."""
    gen = torch.Generator().manual_seed(4)
    runner = ModelRunner(model, num_slots=3, max_context=128, device="cpu")
    assert runner.vocab_size == VOCAB
    batch = LiveBatch(runner, model, gen)
    join, step, leave, errs = batch.join, batch.step, batch.leave, batch.errs

    join(0, Seq(text_ids(gen, 9)))
    step(3)
    join(2, Seq(text_ids(gen, 30)))
    step(4)
    join(1, image_seq(gen))
    step(3)
    leave(0)
    step(2)
    join(0, Seq(text_ids(gen, 4)))  # reuse of a freed slot: no stale KV / conv / recurrent state
    step(4)
    leave(2)
    step(2)
    assert len(errs) == 4 + 3 + 2 * 4 + 3 * 3 + 2 * 2 + 3 * 4 + 2 * 2
    assert max(errs) <= TOL, max(errs)


def test_decode_batch_order_does_not_matter(model):
    gen = torch.Generator().manual_seed(5)
    runner = ModelRunner(model, num_slots=2, max_context=64, device="cpu")
    a, b = Seq(text_ids(gen, 6)), Seq(text_ids(gen, 11))
    runner.prefill(0, a.prompt())
    runner.prefill(1, b.prompt())
    runner2 = ModelRunner(model, num_slots=2, max_context=64, device="cpu")
    runner2.prefill(0, a.prompt())
    runner2.prefill(1, b.prompt())
    out = runner.decode([0, 1], torch.tensor([7, 8]))
    out2 = runner2.decode([1, 0], torch.tensor([8, 7]))
    assert torch.allclose(out[0], out2[1], atol=1e-5) and torch.allclose(out[1], out2[0], atol=1e-5)


def test_context_limits_raise_clear_errors(model):
    runner = ModelRunner(model, num_slots=1, max_context=16, device="cpu")
    with pytest.raises(ContextTooLong) as exc:
        runner.prefill(0, PreparedPrompt(input_ids=torch.arange(16)))
    assert exc.value.prompt_tokens == 16 and exc.value.context_length == 16
    runner.prefill(0, PreparedPrompt(input_ids=torch.arange(14)))
    runner.decode([0], torch.tensor([1]))  # writes position 14
    runner.decode([0], torch.tensor([2]))  # writes position 15, the last one
    with pytest.raises(ContextTooLong):
        runner.decode([0], torch.tensor([3]))
    runner.free(0)
    with pytest.raises(ValueError, match="not prefilled"):
        runner.decode([0], torch.tensor([3]))
    with pytest.raises(InvalidInput, match="token ids"):
        runner.prefill(0, PreparedPrompt(input_ids=torch.tensor([1, VOCAB])))
    with pytest.raises(InvalidInput, match="3 image-pad tokens but the images give 4 features"):  # 3 pads, but a 4x4 grid gives 4 features
        runner.prefill(0, PreparedPrompt(input_ids=torch.tensor([1, IMAGE, IMAGE, IMAGE]),
                                         pixel_values=torch.randn(16, 1536), image_grid_thw=torch.tensor([[1, 4, 4]])))


def test_state_shapes_follow_the_model():
    """State sized from the probed widths: a paged KV cache [blocks + 1 (null block), block_tokens, kv_heads,
    head_dim] in the model dtype for full layers (default blocks: every slot at max_context), a conv ring
    [slots+1, conv_dim, K] and fp32 value-major recurrent state [slots+1, v_heads, dv, dk]."""
    torch.manual_seed(0)
    m = Qwen3_5ForConditionalGeneration(small_config()).eval()
    runner = ModelRunner(m, num_slots=3, max_context=40, device="cpu", block_tokens=16)
    assert runner.vocab_size == VOCAB
    assert sorted(runner.k_cache) == [3, 7]
    assert runner.num_blocks == 3 * 3  # ceil(40 / 16) blocks per slot
    assert runner.k_cache[3].shape == (10, 16, 2, 32) and runner.k_cache[3].dtype == torch.float32
    assert runner.tables.device_table.shape == (4, 3)
    assert runner.conv_state[0].shape == (4, 2 * 2 * 16 + 4 * 16, 4)  # ring of K = 4 conv inputs
    assert runner.rec_state[0].shape == (4, 4, 16, 16) and runner.rec_state[0].dtype == torch.float32
    assert runner.use_cuda_graphs is False


def test_fused_decode_attention_matches_sdpa():
    """glue.attn_core (the compiled GPU path) reads each row's own blocks, through its block table, up to its
    position (and from its ``start`` when given), like SDPA over that sequence's keys and values with a length
    mask."""
    gen = torch.Generator().manual_seed(6)
    blocks, bt, nkv, hd, G = 9, 8, 2, 16, 3
    kc, vc = torch.randn(blocks, bt, nkv, hd, generator=gen), torch.randn(blocks, bt, nkv, hd, generator=gen)
    q = torch.randn(3, nkv, G, hd, generator=gen)
    table = torch.tensor([[4, 0, 7, 8], [2, 8, 8, 8], [5, 1, 3, 6]])  # 8 = unused (the null block)
    pos = torch.tensor([17, 0, 31])
    ours = attn_core(q, kc, vc, table, pos, 0.25)
    for b in range(3):
        n = int(pos[b]) + 1
        keys = kc[table[b]].flatten(0, 1)[:n].transpose(0, 1)[None]   # [1, nkv, n, hd]
        vals = vc[table[b]].flatten(0, 1)[:n].transpose(0, 1)[None]
        ref = torch.nn.functional.scaled_dot_product_attention(q[b:b + 1], keys, vals, scale=0.25)
        assert torch.allclose(ours[b], ref[0], atol=1e-5)
    # ``start`` (the MTP layer's context): positions before it are not attended to
    start = torch.tensor([9, 0, 30])
    ours = attn_core(q, kc, vc, table, pos, 0.25, start=start)
    for b in range(3):
        lo, n = int(start[b]), int(pos[b]) + 1
        keys = kc[table[b]].flatten(0, 1)[lo:n].transpose(0, 1)[None]
        vals = vc[table[b]].flatten(0, 1)[lo:n].transpose(0, 1)[None]
        ref = torch.nn.functional.scaled_dot_product_attention(q[b:b + 1], keys, vals, scale=0.25)
        assert torch.allclose(ours[b], ref[0], atol=1e-5)


def test_service_tiny_model_with_processed_photo_matches_reference(tiny_loaded):
    """The service's own tiny checkpoint (real vocab, 16/4 heads, 16/32 linear heads) with a photo through its
    real processor: prefill and 8 decode steps match the reference forward."""
    from pathlib import Path

    from PIL import Image

    model, processor = tiny_loaded.model, tiny_loaded.processor
    image = Image.open(Path(__file__).parents[1] / "fixtures" / "images" / "coffee.png").convert("RGB")
    image = image.resize((128, 96))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[image], return_tensors="pt")
    ids = enc["input_ids"][0]
    n_visual = int(enc["image_grid_thw"].prod()) // 4  # one token per 2x2 merged block of 16-px patches
    assert n_visual > 0 and int((ids == model.config.image_token_id).sum()) == n_visual
    prompt = PreparedPrompt(input_ids=ids, pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                            mm_token_type_ids=enc["mm_token_type_ids"][0])
    runner = ModelRunner(model, num_slots=1, max_context=256, device="cpu")
    seq = list(ids.tolist())

    @torch.no_grad()
    def reference():
        full = torch.tensor([seq])
        mm = torch.zeros_like(full)
        mm[0, : ids.numel()] = enc["mm_token_type_ids"][0]
        return model(input_ids=full, pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                     mm_token_type_ids=mm).logits[0, -1]

    errs = [rel_err(runner.prefill(0, prompt), reference())]
    gen = torch.Generator().manual_seed(9)
    for _ in range(8):
        tok = int(torch.randint(0, 248000, (1,), generator=gen))
        seq.append(tok)
        errs.append(rel_err(runner.decode([0], torch.tensor([tok]))[0], reference()))
    assert max(errs) <= TOL, errs


def test_options_default_to_production_and_refuse_what_cannot_work(model):
    """``RunnerOptions()`` resolves to what the service runs on this device (on CPU: no graphs, eager glue, no
    Triton), with the identity tensor-parallel path at world size 1; asking for CUDA-only paths on CPU fails."""
    runner = ModelRunner(model, num_slots=1, max_context=32, device="cpu")
    assert runner.options == RunnerOptions(cuda_graphs=False, compile_glue=False, fast_gemv=False, gdn_kernel=False,
                                           prefill_graphs=False, prefill_kernels=False)
    assert runner.graphs is None and runner.graph_prefill is None
    assert isinstance(runner.tp, LocalDecode) and runner.impl["tp_all_reduce"] is None
    for bad in (RunnerOptions(cuda_graphs=True), RunnerOptions(fast_gemv=True), RunnerOptions(prefill_kernels=True)):
        with pytest.raises(ValueError, match="CUDA"):
            ModelRunner(model, num_slots=1, max_context=32, device="cpu", options=bad)


def test_graph_ladder_and_context_buckets(model):
    runner = ModelRunner(model, num_slots=5, max_context=3000, device="cpu")
    assert runner.graph_batch_sizes() == [1, 2, 4, 8]
    assert runner.context_buckets() == [512, 1024, 2048, 3008]  # the last one in whole 64-token blocks
    assert runner.context_bucket(513) == 1024 and runner.context_bucket(2049) == 3008
    assert runner.capture_all() == 0  # CPU: no graphs, nothing to capture


def test_the_start_up_log_names_the_slowest_decode_graph_captures():
    from qwen_chat.engine.model.graphs import CudaGraphs

    g = CudaGraphs.__new__(CudaGraphs)  # only its record of capture times (capturing needs CUDA)
    g.capture_s = {}
    assert g.slowest_captures() == "none"
    g.capture_s = {(1, 2048): 21.34, (2, 2048): 0.11, (1, 262144): 0.9, (4, 2048): 3.0}
    assert g.slowest_captures(2) == "batch 1 / context 2048 21.3 s, batch 4 / context 2048 3.0 s"


@pytest.mark.parametrize("cuts", [
    [37],              # whole
    [5, 20, 37],       # three chunks, boundaries inside the KV blocks and the delta rule's 64-token chunks
    [2, 3, 37],        # chunks shorter than the conv window (K - 1 = 3)
    [16, 32, 37],      # boundaries on the 16-token KV blocks
])
def test_chunked_prefill_matches_the_whole_prompt(model, cuts):
    """A prompt prefilled in chunks (each continuing the slot's KV blocks, conv ring and recurrent state) gives
    the reference's last-position logits, and 8 decode steps still match, next to a live neighbour."""
    gen = torch.Generator().manual_seed(11)
    seq, other = Seq(text_ids(gen, cuts[-1])), Seq(text_ids(gen, 20))
    runner = ModelRunner(model, num_slots=2, max_context=160, device="cpu", block_tokens=16)
    runner.prefill(1, other.prompt())  # a live neighbour: its state must not be touched
    prompt, start = seq.prompt(), 0
    for end in cuts:
        logits = runner.prefill_batch([PrefillItem(0, prompt, start=start, end=end)])
        assert (logits is None) == (end < cuts[-1])
        start = end
    errs = [rel_err(logits[0], seq.reference(model))]
    assert runner.lengths[0] == len(seq.ids)
    errs += decode_steps(runner, model, {0: seq, 1: other}, gen, 8)
    assert max(errs) <= TOL, errs


def test_chunk_boundary_inside_an_image(model):
    """The image's features are computed once and its rows taken by whichever chunk holds them: a boundary in
    the middle of the image's tokens gives the same logits and decode as the reference."""
    gen = torch.Generator().manual_seed(12)
    seq = image_seq(gen)  # 5 text, vision start, 6 image tokens (positions 6..11), vision end, 7 text
    runner = ModelRunner(model, num_slots=1, max_context=96, device="cpu", block_tokens=16)
    prompt = seq.prompt()
    assert runner.prefill_batch([PrefillItem(0, prompt, start=0, end=9)]) is None
    logits = runner.prefill_batch([PrefillItem(0, prompt, start=9, end=prompt.num_tokens)])
    assert runner.rope_deltas[0] == -3
    errs = [rel_err(logits[0], seq.reference(model))] + decode_steps(runner, model, {0: seq}, gen, 6)
    assert max(errs) <= TOL, errs


def test_batched_prefill_of_different_lengths_matches_each_alone(model):
    """Several prompts of different lengths (text, an image prompt, a later chunk of a long one, one whose
    logits are not wanted) in one packed prefill: each gets the reference's logits, and all decode on
    together correctly."""
    gen = torch.Generator().manual_seed(13)
    a, b, c, d = Seq(text_ids(gen, 3)), image_seq(gen), Seq(text_ids(gen, 50)), Seq(text_ids(gen, 21))
    runner = ModelRunner(model, num_slots=4, max_context=128, device="cpu", block_tokens=16)
    runner.prefill_batch([PrefillItem(2, c.prompt(), start=0, end=30)])
    logits = runner.prefill_batch([PrefillItem(0, a.prompt()), PrefillItem(1, b.prompt()), PrefillItem(2, c.prompt(), start=30),
                                   PrefillItem(3, d.prompt(), resume=True)])
    assert logits.shape == (3, VOCAB)
    errs = [rel_err(logits[i], s.reference(model)) for i, s in enumerate((a, b, c))]
    errs += decode_steps(runner, model, {0: a, 1: b, 2: c, 3: d}, gen, 5)
    assert max(errs) <= TOL, errs


def test_chunks_that_do_not_continue_their_slot_are_refused(model):
    runner = ModelRunner(model, num_slots=2, max_context=64, device="cpu")
    prompt = PreparedPrompt(input_ids=torch.arange(10))
    with pytest.raises(ValueError, match="does not continue slot 0"):
        runner.prefill_batch([PrefillItem(0, prompt, start=4, end=10)])
    with pytest.raises(ValueError, match="twice"):
        runner.prefill_batch([PrefillItem(0, prompt), PrefillItem(0, prompt)])
    with pytest.raises(ValueError, match="outside the prompt"):
        runner.prefill_batch([PrefillItem(1, prompt, start=0, end=11)])


def test_blocks_follow_the_length_and_come_back_on_free(model):
    """A sequence holds ceil(length / block_tokens) blocks; decode takes one when it crosses into a new block;
    copy_slot gives the copy blocks of its own; a decode that needs a block when none is free is refused
    before anything runs; free gives every block back."""
    runner = ModelRunner(model, num_slots=3, max_context=64, num_blocks=4, device="cpu", block_tokens=16)
    runner.prefill(0, PreparedPrompt(input_ids=torch.arange(15)))
    assert len(runner.tables.blocks(0)) == 1 and runner.tables.free_blocks == 3
    runner.decode([0], torch.tensor([5]))                  # position 15: still the first block
    assert len(runner.tables.blocks(0)) == 1
    runner.decode([0], torch.tensor([5]))                  # position 16: a second block
    assert len(runner.tables.blocks(0)) == 2 and runner.tables.free_blocks == 2
    runner.prefill(1, PreparedPrompt(input_ids=torch.arange(32)))
    assert runner.tables.free_blocks == 0
    before = list(runner.lengths)
    with pytest.raises(OutOfBlocks):
        runner.decode([0, 1], torch.tensor([1, 2]))        # slot 0 fits its block, slot 1 needs a third
    with pytest.raises(OutOfBlocks):
        runner.copy_slot(0, 2)
    assert runner.lengths == before
    runner.free(1)
    assert runner.tables.free_blocks == 2 and runner.tables.blocks(1) == ()
    runner.decode([0], torch.tensor([3]))
    assert int(runner.tables.device_table[1].min()) == runner.tables.null_block


def test_projections_are_fused_without_extra_memory():
    """Each layer's token-mixer input projections and the MLP's gate/up read one fused weight; the modules keep
    views of it (no copy), a second runner on the same model reuses it, and the model's own forward is
    unchanged."""
    torch.manual_seed(0)
    m = Qwen3_5ForConditionalGeneration(small_config()).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        before = m(input_ids=ids).logits
    n_before = sum(p.numel() for p in m.parameters())
    runner = ModelRunner(m, num_slots=1, max_context=32, device="cpu")
    assert runner.impl["fused_projection_groups"] == 2 * 8
    la = m.model.language_model.layers[0].linear_attn
    (fused, sizes), = runner.fused_projection(0, "mix")  # bf16 layers only: one GEMM
    assert sizes == [la.in_proj_qkv.out_features, la.in_proj_z.out_features, 4, 4]
    assert la.in_proj_a.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert torch.equal(fused[-4:], la.in_proj_a.weight)
    again = ModelRunner(m, num_slots=1, max_context=32, device="cpu")
    assert again.fused_projection(0, "mix")[0][0].data_ptr() == fused.data_ptr()
    assert sum(p.numel() for p in m.parameters()) == n_before
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, before)


def test_hooked_or_sharded_projections_are_not_fused():
    """A module with a forward hook (how ZeRO-3 gathers weights) or of another class (DeepSpeed's sharded
    layers) must keep being called as a module, so fusing is refused for its group."""
    a, b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 6, bias=False)
    assert fuse_linears([a, b]) is not None
    c, d = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 6, bias=False)
    d.register_forward_pre_hook(lambda mod, args: None)
    assert fuse_linears([c, d]) is None

    class Sharded(torch.nn.Linear):
        pass

    assert fuse_linears([torch.nn.Linear(8, 4, bias=False), Sharded(8, 6, bias=False)]) is None
    assert fuse_linears([torch.nn.Linear(8, 4, bias=True), torch.nn.Linear(8, 6, bias=False)]) is None


def test_prefill_attention_runs_without_cudnn_and_restores_the_setting(model):
    """Prefill attention never uses PyTorch's cuDNN backend (it builds a plan for every new length): the switch
    is off while the runner's attention runs, for new and continuing chunks, and as it was afterwards, also after
    a prefill that raised."""
    runner = ModelRunner(model, num_slots=2, max_context=64, device="cpu")
    seen = []
    real = runner._forward.attn_core

    def watching(*args):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args)

    runner._forward.attn_core = watching
    prompt = PreparedPrompt(input_ids=torch.arange(20, dtype=torch.int64) + 10)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    runner.prefill_batch([PrefillItem(0, prompt, end=12)])
    runner.prefill_batch([PrefillItem(0, prompt, start=12)])
    assert seen and not any(seen)              # two attention layers, both chunks
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(ContextTooLong):
        runner.prefill_batch([PrefillItem(1, PreparedPrompt(input_ids=torch.zeros(100, dtype=torch.int64)))])
    assert torch.backends.cuda.cudnn_sdp_enabled()
