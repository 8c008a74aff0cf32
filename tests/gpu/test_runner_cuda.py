"""GPU-only checks of the runner's CUDA path: graph-captured decode (with and without the compiled glue)
against the reference transformers model in fp32, padded batches, and the sampler on CUDA.  Skipped without
CUDA.  Run on a GPU host: ``python -m pytest -q tests/gpu``.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from qwen_chat.engine.types import SamplingParams
from qwen_chat.engine.model.options import RunnerOptions
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from tests.support.small_model import TOL, LiveBatch, Seq, image_seq, rel_err, small_config, small_model, text_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fla_installed() -> bool:
    try:
        import fla  # noqa: F401
        return True
    except Exception:
        return False


# With fla-core installed, transformers' reference forward runs the chunked delta rule in fla's Triton kernels,
# whose fp32 dots use TF32: the reference itself then differs from our exact fp32 decode recurrence by up to
# 2e-4 on an H200 (measured: docs/performance.md; prefill, also through fla, matches exactly).  Without fla the
# bound is the CPU parity tests' TOL.
GPU_TOL = 1e-3 if _fla_installed() else TOL


@pytest.fixture(scope="module")
def model():
    # The reference's conv1d goes through cuDNN, which uses TF32 by default (~1e-4 relative error on its own).
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return small_model().to("cuda")


class CudaSeq(Seq):
    @torch.no_grad()
    def reference(self, model):
        ids = torch.tensor([self.ids], device="cuda")
        kw = {}
        if self.image is not None:
            kw = dict(pixel_values=self.image[0].cuda(), image_grid_thw=self.image[1].cuda(),
                      mm_token_type_ids=(ids == 300).long())
        return model(input_ids=ids, **kw).logits[0, -1]


@pytest.mark.parametrize("compile_glue", [False, True])
def test_graph_decode_matches_reference_with_joins_and_leaves(model, compile_glue):
    gen = torch.Generator().manual_seed(7)
    runner = ModelRunner(model, num_slots=4, max_context=1100, device="cuda",
                         options=RunnerOptions(compile_glue=compile_glue))
    assert runner.use_cuda_graphs
    batch = LiveBatch(runner, model, gen)
    join, step, errs = batch.join, batch.step, batch.errs

    join(0, CudaSeq(text_ids(gen, 9)))
    step(4)
    img = image_seq(gen)
    join(2, CudaSeq(img.ids, img.image))
    join(3, CudaSeq(text_ids(gen, 520)))  # crosses into the 1024 context bucket
    step(6)  # batch of 3 runs padded to 4
    batch.leave(0)
    join(0, CudaSeq(text_ids(gen, 3)))
    step(5)
    assert len(runner.graphs.decode_shapes()) >= 2
    assert max(errs) <= GPU_TOL, max(errs)


def test_packed_and_chunked_prefill_on_cuda_match_the_reference(model):
    """fla's packed (varlen) chunk kernel, a later chunk through the lower-right causal attention over the
    slot's cached blocks, an image prompt and a short one in one prefill: all match the reference in fp32, and
    decode continues correctly."""
    from qwen_chat.engine.types import PrefillItem

    gen = torch.Generator().manual_seed(17)
    img = image_seq(gen)
    a, b, c = CudaSeq(text_ids(gen, 100)), CudaSeq(img.ids, img.image), CudaSeq(text_ids(gen, 5))
    runner = ModelRunner(model, num_slots=3, max_context=300, device="cuda", block_tokens=16)
    first = runner.prefill_batch([PrefillItem(0, a.prompt(), start=0, end=37), PrefillItem(1, b.prompt()), PrefillItem(2, c.prompt())])
    last = runner.prefill_batch([PrefillItem(0, a.prompt(), start=37)])
    errs = [rel_err(first[0], b.reference(model)), rel_err(first[1], c.reference(model)),
            rel_err(last[0], a.reference(model))]
    for _ in range(4):
        toks = torch.randint(0, 290, (3,), generator=gen)
        for s, t in zip((a, b, c), toks.tolist()):
            s.ids.append(t)
        out = runner.decode([0, 1, 2], toks.cuda())
        errs += [rel_err(out[r], s.reference(model)) for r, s in enumerate((a, b, c))]
    assert max(errs) <= GPU_TOL, errs


def test_kept_prefixes_with_the_packed_kernel_match_the_reference(model):
    """Keep points inside packed chunks (fla's varlen kernel in two calls) next to a chunk without one; the
    follow-ups restored from the kept states (one in the kept row itself, taken over in place) match the
    reference in fp32."""
    from qwen_chat.engine.types import PrefillItem

    gen = torch.Generator().manual_seed(19)
    img = image_seq(gen)
    a, b, c = CudaSeq(text_ids(gen, 90)), CudaSeq(img.ids, img.image), CudaSeq(text_ids(gen, 7))
    runner = ModelRunner(model, num_slots=6, max_context=300, device="cuda", block_tokens=16)
    pa, pb = len(a.ids) - 3, len(b.ids) - 2
    out = runner.prefill_batch([PrefillItem(0, a.prompt(), keeps=((pa, 3),)), PrefillItem(1, b.prompt(), keeps=((pb, 4),)),
                                PrefillItem(2, c.prompt())])
    errs = [rel_err(out[0], a.reference(model)), rel_err(out[1], b.reference(model)),
            rel_err(out[2], c.reference(model))]
    for src, slot, seq, p in ((3, 5, a, pa), (4, 2, b, pb)):
        runner.free(slot)
        follow = CudaSeq(seq.ids[:p] + text_ids(gen, 11), seq.image)
        runner.restore(src, slot)
        errs.append(rel_err(runner.prefill_batch([PrefillItem(slot, follow.prompt(), start=p)])[0], follow.reference(model)))
    follow = CudaSeq(a.ids[:pa] + text_ids(gen, 5))
    runner.restore(3, 3)  # the kept row taken over in place (the scheduler does so when no other row is free)
    errs.append(rel_err(runner.prefill_batch([PrefillItem(3, follow.prompt(), start=pa)])[0], follow.reference(model)))
    assert max(errs) <= GPU_TOL, errs


def test_two_keep_points_in_one_chunk_with_fla_agree_with_plain_prefills(model):
    """bf16 (fla's varlen kernel in three rounds): a 300-token prompt keeping its state at 150 (a system block's
    end: the 140-token tail goes through the chunked kernel) and 296 (a turn's end: the fused recurrent one);
    its logits and those of follow-ups restored from either kept state agree with plain prefills."""
    from qwen_chat.engine.types import PrefillItem

    gen = torch.Generator().manual_seed(23)
    m16 = model.to(torch.bfloat16)
    try:
        ids = text_ids(gen, 300)
        runner = ModelRunner(m16, num_slots=6, max_context=512, device="cuda", block_tokens=16)
        plain = ModelRunner(m16, num_slots=1, max_context=512, device="cuda", block_tokens=16)
        kept = runner.prefill_batch([PrefillItem(0, Seq(ids).prompt(), keeps=((150, 3), (296, 4)))])
        errs = [rel_err(plain.prefill(0, Seq(ids).prompt()), kept[0])]
        for row, p, slot in ((3, 150, 1), (4, 296, 2)):
            follow = Seq(ids[:p] + text_ids(gen, 20)).prompt()
            runner.restore(row, slot)
            got = runner.prefill_batch([PrefillItem(slot, follow, start=p)])[0]
            plain.free(0)
            errs.append(rel_err(plain.prefill(0, follow), got))
        assert max(errs) < 2e-2, errs
    finally:
        model.to(torch.float32)


def test_chunked_prefill_in_bf16_agrees_with_the_whole_prompt(model):
    """bf16 (flash attention, fla's kernels): a 300-token prompt in chunks of 130 + 170 gives the logits of the
    whole prompt and the same decode, up to bf16 rounding."""
    from qwen_chat.engine.types import PrefillItem

    gen = torch.Generator().manual_seed(18)
    m16 = model.to(torch.bfloat16)
    try:
        p = Seq(text_ids(gen, 300)).prompt()
        whole = ModelRunner(m16, num_slots=1, max_context=512, device="cuda")
        parts = ModelRunner(m16, num_slots=1, max_context=512, device="cuda")
        ref = whole.prefill(0, p)
        assert parts.prefill_batch([PrefillItem(0, p, start=0, end=130)]) is None
        errs = [rel_err(ref, parts.prefill_batch([PrefillItem(0, p, start=130)])[0])]
        for _ in range(4):
            tok = torch.randint(0, 290, (1,), generator=gen).cuda()
            errs.append(rel_err(whole.decode([0], tok), parts.decode([0], tok)))
        assert max(errs) < 2e-2, errs
    finally:
        model.to(torch.float32)


def test_graph_and_eager_decode_agree_in_bf16(model):
    gen = torch.Generator().manual_seed(8)
    m16 = model.to(torch.bfloat16)
    try:
        a = ModelRunner(m16, num_slots=2, max_context=256, device="cuda", options=RunnerOptions(cuda_graphs=True))
        b = ModelRunner(m16, num_slots=2, max_context=256, device="cuda", options=RunnerOptions(cuda_graphs=False))
        seqs = [Seq(text_ids(gen, 12)), Seq(text_ids(gen, 30))]
        for s, q in enumerate(seqs):
            a.prefill(s, q.prompt())
            b.prefill(s, q.prompt())
        for _ in range(8):
            toks = torch.randint(0, 290, (2,), generator=gen).cuda()
            assert rel_err(a.decode([0, 1], toks), b.decode([0, 1], toks)) < 2e-2
    finally:
        model.to(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_graphs_replay_what_the_pieces_compute_eagerly(model, dtype):
    """The piecewise prefill graphs (``prefill_graph``) against the same pieces run eagerly and against the
    packed eager prefill: a new prompt, a keep point, a later chunk of the slot, a restored follow-up and an
    image prompt, then decode steps.  fp32: the graphs give exactly the eager pieces' logits and states; both
    paths match the reference; bf16: within bf16 rounding of the packed path."""
    from qwen_chat.engine.types import PrefillItem

    gen = torch.Generator().manual_seed(19)
    m = model.to(dtype)
    try:
        def make(**opts):
            return ModelRunner(m, num_slots=5, max_context=600, device="cuda", block_tokens=16,
                               options=RunnerOptions(**opts))

        runners = {"graphs": make(), "pieces": make(cuda_graphs=False, prefill_graphs=True),
                   "packed": make(cuda_graphs=False, prefill_graphs=False)}
        assert runners["graphs"].graph_prefill is not None and runners["graphs"].graphs is not None
        assert runners["graphs"].capture_prefill() > 0
        img = image_seq(gen)
        a, b = CudaSeq(text_ids(gen, 70)), CudaSeq(img.ids, img.image)
        follow = CudaSeq(a.ids[:60] + text_ids(gen, 25))
        out = {}
        for name, r in runners.items():
            rows = [r.prefill_batch([PrefillItem(0, a.prompt(), start=0, end=40, resume=True)]),
                    r.prefill_batch([PrefillItem(0, a.prompt(), start=40, keeps=((60, 4),))])[0]]
            r.restore(4, 1)
            rows.append(r.prefill_batch([PrefillItem(1, follow.prompt(), start=60)])[0])
            rows.append(r.prefill(2, b.prompt()))
            for _ in range(3):
                toks = torch.randint(0, 290, (3,), generator=torch.Generator().manual_seed(len(rows)))
                rows.append(r.decode([0, 1, 2], toks.cuda()))
            out[name] = rows
        g, pcs, pk = out["graphs"], out["pieces"], out["packed"]
        assert g[0] is None
        if dtype == torch.float32:
            for x, y in zip(g[1:4], pcs[1:4]):
                assert torch.equal(x, y)
            errs = [rel_err(g[1], a.reference(m)), rel_err(g[2], follow.reference(m)), rel_err(g[3], b.reference(m))]
            assert max(errs) <= GPU_TOL, errs
        errs = [rel_err(x, y) for x, y in zip(g[1:], pk[1:])]
        assert max(errs) < (GPU_TOL if dtype == torch.float32 else 2e-2), errs
    finally:
        model.to(torch.float32)


def test_sampler_on_cuda_is_reproducible():
    logits = torch.randn(3, 1000, device="cuda")
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=1.0, seed=42, max_new_tokens=8,
                       stop_token_ids=())
    runs = []
    for _ in range(2):
        s = Sampler(3, 1000, "cuda")
        for slot in range(3):
            s.start(slot, p)
        runs.append([s.sample([0, 1, 2], logits) for _ in range(10)])
    assert runs[0] == runs[1]


def test_compiled_top_k_sampling_matches_the_general_path_on_cuda():
    """On CUDA the fused top-k path is ``torch.compile``d: it must draw what the general path draws."""
    gen = torch.Generator().manual_seed(3)
    p = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=5, max_new_tokens=8,
                        stop_token_ids=()),
         SamplingParams(temperature=0.0, top_p=1.0, top_k=20, presence_penalty=0.0, seed=6, max_new_tokens=8,
                        stop_token_ids=())]
    fused, general = Sampler(2, 248320, "cuda"), Sampler(2, 248320, "cuda", fused_top_k=0)
    for s in (fused, general):
        for slot, q in enumerate(p):
            s.start(slot, q)
    for n in (2, 1):  # a batch of two, then one row (another compiled shape)
        for _ in range(20):
            logits = (torch.randn(n, 248320, generator=gen) * 3).cuda()
            assert fused.sample(list(range(n)), logits) == general.sample(list(range(n)), logits)


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_triton_gemv_matches_fp32_reference(rows):
    """The decode projections' Triton kernels (qwen_chat.engine.model.gemv) against an fp32 matmul: no worse than
    cuBLAS in bf16, for tuned shapes, a shape that leaves a partial tile of rows, and a TP-halved shape."""
    from qwen_chat.engine.model import gemv

    gen = torch.Generator(device="cuda").manual_seed(rows)
    for N, K in ((12352, 4096), (4096, 12288), (1000, 384), (6176, 2048)):
        x = torch.randn(rows, K, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        assert gemv.supports(x, w)
        ref = x.float() @ w.float().T
        ours = gemv.linear(x, w)
        assert ours.shape == (rows, N) and ours.dtype == torch.bfloat16
        err = (ours.float() - ref).abs().max().item()
        cublas = (torch.nn.functional.linear(x, w).float() - ref).abs().max().item()
        assert err <= 2 * cublas + 1e-3, (N, K, err, cublas)


@pytest.mark.parametrize("rows", [1, 3])
def test_triton_gemv_with_swiglu_input_matches_the_mlp(rows):
    """``gemv(gate_up, w, swiglu=True)`` is Qwen3_5MLP's down(silu(gate) * up) for the fused gate/up output,
    within bf16 rounding of an fp32 reference, no worse than cuBLAS on the bf16 SwiGLU."""
    from qwen_chat.engine.model import gemv

    gen = torch.Generator(device="cuda").manual_seed(10 + rows)
    K, N = 12288, 4096
    gate_up = torch.randn(rows, 2 * K, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    g, u = gate_up.float().split(K, dim=-1)
    ref = (torch.nn.functional.silu(g) * u) @ w.float().T
    ours = gemv.gemv(gate_up, w, swiglu=True)
    cublas = torch.nn.functional.linear((torch.nn.functional.silu(g) * u).to(torch.bfloat16), w)
    err, err_cublas = ((ours.float() - ref).abs().max().item(), (cublas.float() - ref).abs().max().item())
    assert ours.shape == (rows, N) and err <= 2 * err_cublas + 1e-3, (err, err_cublas)


def test_fast_gemv_decode_matches_cublas_decode_in_bf16():
    """A bf16 model whose widths the Triton GEMV serves (multiples of 128): graph decode with and without it
    gives the same logits within bf16 rounding, for one row and for a padded batch of three."""
    from transformers import Qwen3_5ForConditionalGeneration

    cfg = small_config()
    tc = cfg.text_config
    tc.hidden_size, tc.intermediate_size, tc.head_dim = 256, 512, 64
    tc.linear_key_head_dim, tc.linear_value_head_dim = 64, 64
    tc.rope_parameters["mrope_section"] = [4, 2, 2]  # rotary dim 16 of head_dim 64
    cfg.vision_config.out_hidden_size = 256
    torch.manual_seed(1)
    m = Qwen3_5ForConditionalGeneration(cfg).eval().to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    fast = ModelRunner(m, num_slots=4, max_context=512, device="cuda", options=RunnerOptions(fast_gemv=True))
    plain = ModelRunner(m, num_slots=4, max_context=512, device="cuda", options=RunnerOptions(fast_gemv=False))
    assert "triton" in fast.impl["projections"] and plain.impl["projections"] == "torch"
    prompts = [Seq(text_ids(gen, n)).prompt() for n in (7, 40, 13)]
    for slots in ([0], [0, 1, 2]):
        for r in (fast, plain):
            for s in slots:
                r.free(s)
                r.prefill(s, prompts[s])
        for _ in range(6):
            toks = torch.randint(0, 290, (len(slots),), generator=gen)
            a, b = fast.decode(slots, toks), plain.decode(slots, toks)
            assert rel_err(a, b) < 3e-2


@pytest.mark.parametrize("overlap", [False, True])
def test_scheduler_streams_on_cuda_equal_solo_streams(model, overlap):
    """Through the scheduler on the GPU (graphs, pinned token buffers, the device token table when steps are
    launched ahead): three sampled requests decoded together give exactly their solo streams."""
    from qwen_chat.chat_types import CancelToken
    from qwen_chat.engine.parallel.executors import LocalExecutor
    from qwen_chat.engine.types import PreparedPrompt
    from qwen_chat.engine.core.scheduler import Scheduler

    runner = ModelRunner(model, num_slots=3, max_context=256, device="cuda")
    sched = Scheduler(LocalExecutor(runner, Sampler(3, runner.vocab_size, "cuda")), num_slots=3, max_queue=4,
                      eos_ids=(), max_context=256, overlap=overlap)  # no stop id: every stream runs to its limit
    try:
        g = torch.Generator().manual_seed(2)
        prompts = [PreparedPrompt(input_ids=torch.randint(0, 290, (n,), generator=g)) for n in (5, 17, 9)]
        sps = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20 * i, presence_penalty=0.5, seed=i,
                              max_new_tokens=12 + 6 * i, stop_token_ids=()) for i in range(3)]
        solo = [list(sched.submit(p, s, CancelToken())) for p, s in zip(prompts, sps)]
        assert [len(t) for t in solo] == [12, 18, 24]
        handles = [sched.submit(p, s, CancelToken()) for p, s in zip(prompts, sps)]
        assert [list(h) for h in handles] == solo
    finally:
        sched.shutdown()


def test_launching_a_decode_step_does_not_wait_for_the_gpu(model):
    """The point of launching ahead: queueing a decode step (inputs, graph replay, sampling, the copy of the
    tokens to the host) makes no call that waits for the GPU, for greedy, fused top-k and general rows."""
    from qwen_chat.engine.parallel.executors import LocalExecutor
    from qwen_chat.engine.types import PrefillItem, PreparedPrompt, StepPlan

    runner = ModelRunner(model, num_slots=3, max_context=256, device="cuda")
    sampler = Sampler(3, runner.vocab_size, "cuda")
    ex = LocalExecutor(runner, sampler)
    g = torch.Generator().manual_seed(4)
    for slot, (temp, top_k) in enumerate(((0.0, 0), (0.8, 20), (0.8, 0))):
        sp = SamplingParams(temperature=temp, top_p=0.9, top_k=top_k, presence_penalty=0.5, seed=slot,
                            max_new_tokens=64, stop_token_ids=())
        ex.execute(StepPlan(prefills=[PrefillItem(slot, PreparedPrompt(
            input_ids=torch.randint(0, 290, (6,), generator=g)), sp)]))
    for slots in ([0], [1], [2], [0, 1, 2]):
        plan = StepPlan(decode_slots=slots, tokens_on_device=True)
        ex.collect(ex.launch(plan))  # first use of this shape: graph capture and compilation may synchronise
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first = ex.launch(plan)
                second = ex.launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        assert syncs == [], (slots, syncs)
        a, b = ex.collect(first), ex.collect(second)
        assert sorted(a) == sorted(b) == sorted(slots)
        assert all(0 <= t < runner.vocab_size for t in list(a.values()) + list(b.values()))


@pytest.mark.parametrize("rows,key_heads", [(1, 16), (5, 16), (16, 8)])
def test_gdn_kernel_matches_the_reference_step_in_bf16(rows, key_heads):
    """The one-kernel Gated DeltaNet decode (gdn.gdn_decode) on the 9B's head sizes (dk = dv = 128, 2 value
    heads per key head; 8 key heads = one rank of TP=2) against glue.gdn_step in bf16, both measured
    against the step in fp32: the kernel must be as close as the reference (bf16 rounding), over 6 tokens."""
    from tests.support.triton_checks import check_against_reference

    r = check_against_reference(torch.bfloat16, B=rows, nk=key_heads, rep=2, dk=128, dv=128, slots=20,
                                device="cuda")
    assert r["conv_equal"], r
    assert r["kernel_out"] <= 1.5 * r["ref_out"] + 1e-3 and r["kernel_state"] <= 1.5 * r["ref_state"] + 1e-4, r


def test_gdn_kernel_equals_the_reference_step_in_fp32_on_cuda():
    from tests.support.triton_checks import check_against_reference

    r = check_against_reference(torch.float32, B=4, nk=4, rep=2, dk=128, dv=128, device="cuda")
    assert r["conv_equal"] and r["kernel_out"] <= 1e-5 and r["kernel_state"] <= 1e-5, r
