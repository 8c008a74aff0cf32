"""Speculative decoding on the built-in tiny model (fp32, CPU): the verify step's exact state after partial
acceptance, greedy replies equal to plain decoding under every acceptance pattern (oracle drafts right at chosen
rates, the random MTP head), with chunked prefill, preemption and a conversation-cache hit; the acceptance
draw's distribution (chi-square); seeded replies that do not depend on the batch; the MTP head's tensors."""
from __future__ import annotations

import math

import pytest
import torch

from qwen_chat.chat_types import CancelToken, ChatMessage, GenerationSettings
from qwen_chat.engine.core.chat_engine import ChatEngine
from qwen_chat.engine.core.scheduler import Scheduler
from qwen_chat.engine.core.spec_policy import OracleDrafter
from qwen_chat.engine.model import spec_step
from qwen_chat.engine.model.mtp import load_mtp_head
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from qwen_chat.engine.model.spec_sampling import accept_drafts
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.types import PrefillItem, PreparedPrompt, SamplingParams, StepPlan

GREEDY = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0, max_new_tokens=200,
                        stop_token_ids=())


def make_runner(loaded, num_slots=8, k=0, num_blocks=None, max_context=512, block_tokens=16, mtp=True):
    runner = ModelRunner(loaded.model, num_slots=num_slots, max_context=max_context, num_blocks=num_blocks,
                         device="cpu", block_tokens=block_tokens)
    if k:
        head = load_mtp_head(loaded.checkpoint, loaded.model.config.text_config, device="cpu",
                             dtype=torch.float32) if mtp else None
        spec_step.attach(runner, head, k=k, max_batch=num_slots)
    return runner


def prompts(n, lengths=(20, 33, 27, 40, 25, 31, 18, 36)):
    gen = torch.Generator().manual_seed(11)
    return [PreparedPrompt(input_ids=torch.randint(0, 5000, (lengths[i % len(lengths)],), generator=gen))
            for i in range(n)]


def run(loaded, ps, *, k=0, drafter=None, num_blocks=None, budget=16, tokens=200, overlap=True):
    """Greedy replies of ``ps`` submitted together, and the scheduler's totals."""
    runner = make_runner(loaded, num_slots=len(ps), k=k, num_blocks=num_blocks)
    sched = Scheduler(LocalExecutor(runner, Sampler(len(ps), runner.vocab_size, "cpu")), num_slots=len(ps),
                      max_queue=16, eos_ids=(), max_context=512, num_blocks=runner.num_blocks, block_tokens=16,
                      prefill_token_budget=budget, overlap=overlap, speculative_tokens=k, drafter=drafter)
    try:
        sampling = SamplingParams(**{**GREEDY.__dict__, "max_new_tokens": tokens})
        handles = [sched.submit(p, sampling, CancelToken()) for p in ps]
        return [list(h) for h in handles], sched.stats()["totals"]
    finally:
        sched.shutdown()


@pytest.fixture(scope="module")
def plain8(tiny_loaded):
    """Eight prompts and their greedy replies of 200 tokens, decoded plainly (prompts in chunks of 16)."""
    ps = prompts(8)
    return ps, run(tiny_loaded, ps)[0]


# ------------------------------------------------------------------------------------------- the exact state
@pytest.mark.parametrize("k", [1, 3])
def test_the_state_after_partial_acceptance_is_that_of_plain_decoding(tiny_loaded, k):
    """For every number of kept drafts a = 0..k, the slot's length, Gated DeltaNet conv and recurrent state and
    its next logits equal those of a slot that decoded the same a + 1 tokens plainly."""
    prompt = prompts(1)[0]
    for a in range(k + 1):
        runner = make_runner(tiny_loaded, num_slots=2, k=k, mtp=False)
        runner.prefill(0, prompt)
        runner.copy_slot(0, 1)
        fed = [7, 11, 13, 17][:a + 1]
        for t in fed:
            plain = runner.decode([0], torch.tensor([t]))
        wrong = [19, 23, 29][:k - a]
        tokens = torch.tensor([fed + wrong])
        _, _, start = runner.spec.verifier.verify([1], tokens)
        runner.spec.verifier.accept([1], [a + 1])
        assert start == [prompt.num_tokens] and runner.lengths[1] == runner.lengths[0] == prompt.num_tokens + a + 1
        for i in runner.rec_state:
            assert torch.allclose(runner.rec_state[i][1], runner.rec_state[i][0], atol=1e-5), (a, i)
            assert torch.allclose(runner.conv_state[i][1], runner.conv_state[i][0], atol=1e-6), (a, i)
        nxt = runner.decode([0, 1], torch.tensor([31, 31]))
        assert torch.allclose(nxt[1], nxt[0], atol=1e-4), a
        assert plain.shape == (1, runner.vocab_size)


# ------------------------------------------------------------------------------------------- greedy = plain
@pytest.mark.slow  # 8 sequences x 200 tokens, twice (about 40 s on 2 CPU cores)
def test_greedy_oracle_drafts_at_mixed_acceptance_give_the_plain_tokens(tiny_loaded, plain8):
    """Eight concurrent sequences, k = 2, oracle drafts right with probability 0 .. 1 per sequence (so steps
    keep none, some or all of their drafts), prompts in chunks of 16: every reply equals plain decoding for 200
    tokens, and the counters show both full and zero acceptance."""
    ps, want = plain8
    rates = [0.0, 0.3, 0.5, 0.7, 0.85, 0.9, 1.0, 1.0]
    cont = {tuple(p.input_ids.tolist()): w for p, w in zip(ps, want)}
    correct = {tuple(p.input_ids.tolist()): r for p, r in zip(ps, rates)}
    got, totals = run(tiny_loaded, ps, k=2, drafter=OracleDrafter(cont, correct, seed=3))
    assert got == want
    assert totals["spec_steps"] > 0 and 0 < totals["spec_accepted"] < totals["spec_drafted"]


@pytest.mark.slow  # 8 sequences x 200 tokens (about 25 s on 2 CPU cores)
def test_greedy_with_the_random_mtp_head_gives_the_plain_tokens(tiny_loaded, plain8):
    """The tiny checkpoint's random MTP head drafts (near-zero acceptance): the replies still equal plain
    decoding, and the sequences stop speculating after a few steps (probing again later)."""
    ps, want = plain8
    got, totals = run(tiny_loaded, ps, k=3)
    assert got == want
    assert 0 < totals["spec_steps"] and totals["spec_accepted"] <= totals["spec_drafted"] // 10


def test_preempted_and_resumed_sequences_keep_the_plain_tokens(tiny_loaded, plain8):
    """Under 12 KV blocks of 16 tokens for four sequences the newest are preempted and recomputed while others
    speculate (k = 3, all drafts right): every reply equals its plain one."""
    ps, want = plain8
    ps, want = ps[:4], [w[:40] for w in want[:4]]
    cont = {tuple(p.input_ids.tolist()): w for p, w in zip(ps, want)}
    got, totals = run(tiny_loaded, ps, k=3, drafter=OracleDrafter(cont, 1.0), num_blocks=12, tokens=40)
    assert totals["preemptions"] > 0 and totals["spec_steps"] > 0
    assert got == want


def test_a_stop_token_or_max_tokens_inside_a_kept_run_ends_the_reply_there(tiny_loaded, plain8):
    """k = 3 with every draft right (runs of 4 tokens): a stop token in the middle of a run ends the reply right
    after it (the run's later tokens are dropped) and max_new_tokens = 7 gives exactly 7 tokens, as plain
    decoding does."""
    ps, want = plain8
    p, w = ps[0], want[0]
    i = next(i for i in range(5, len(w)) if w[i] not in w[:i] and i % 4 not in (0, 3))  # inside a run
    cont = {tuple(p.input_ids.tolist()): w}
    runner = make_runner(tiny_loaded, num_slots=1, k=3)
    sched = Scheduler(LocalExecutor(runner, Sampler(1, runner.vocab_size, "cpu")), num_slots=1, max_queue=4,
                      eos_ids=(), max_context=512, num_blocks=runner.num_blocks, block_tokens=16, overlap=True,
                      speculative_tokens=3, drafter=OracleDrafter(cont, 1.0))
    try:
        stop = SamplingParams(**{**GREEDY.__dict__, "stop_token_ids": (w[i],)})
        h = sched.submit(p, stop, CancelToken())
        assert list(h) == w[:i] and h.finish_reason == "stop"  # the stop id itself is not streamed
        h = sched.submit(p, SamplingParams(**{**GREEDY.__dict__, "max_new_tokens": 7}), CancelToken())
        assert list(h) == w[:7] and h.finish_reason == "length"
        assert sched.stats()["totals"]["spec_accepted"] > 0
    finally:
        sched.shutdown()


def test_a_conversation_cache_hit_with_speculation_gives_the_plain_reply(tiny_loaded):
    """Two turns of one conversation through the engine, speculation on (random MTP head, k = 2) and off: the
    second turn reuses the first's state and both replies equal the plain ones."""
    def engine(k):
        runner = make_runner(tiny_loaded, num_slots=2, k=k, max_context=1024)
        ex = LocalExecutor(runner, Sampler(2, runner.vocab_size, "cpu"))
        return ChatEngine(tiny_loaded, runner, ex, image_token_budget=64, max_context=1024, max_queue=4,
                          num_slots=2, conversation_cache=True, speculative_tokens=k)

    settings = GenerationSettings.preset(False, temperature=0.0, max_new_tokens=24)
    replies = []
    for k in (0, 2):
        eng = engine(k)
        try:
            msgs = [ChatMessage(role="system", text="Be brief."), ChatMessage(role="user", text="Hello there.")]
            first = list(eng.stream_chat(msgs, settings, CancelToken()))[-1]
            msgs += [ChatMessage(role="assistant", text=first.answer), ChatMessage(role="user", text="And then?")]
            second = list(eng.stream_chat(msgs, settings, CancelToken()))[-1]
            replies.append((first.answer, second.answer, second.completion_tokens, second.cached_tokens))
            totals = eng.scheduler.stats()["totals"]
            assert (totals["spec_steps"] > 0) == (k > 0)
        finally:
            eng.close()
    assert replies[1][:3] == replies[0][:3] and replies[1][3] == replies[0][3] > 0


# ------------------------------------------------------------------------------------------- sampling
#: Chi-square critical value for 4 degrees of freedom at p = 0.001 (any statistics table, e.g. NIST/SEMATECH
#: e-Handbook of Statistical Methods, 1.3.6.7.4): a correct sampler fails this test once in a thousand seeds.
CHI2_4DF_P001 = 18.467


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_kept_drafts_and_corrections_have_the_target_distribution():
    """Speculative sampling at temperature 0.8, top-k 5 and presence penalty 0.5 over synthetic logits, 6,400
    seeded draws: the first emitted token follows the target's p_0 and, given that the draft d_1 was kept, the
    second follows p_1 with d_1 penalised as already present (chi-square below the p = 0.001 critical value for
    4 degrees of freedom)."""
    V, slots, rounds = 32, 256, 25
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, V, generator=gen) * 2
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=5, presence_penalty=0.5, seed=0, max_new_tokens=9,
                            stop_token_ids=())
    d1 = int(torch.topk(logits[0, 0], 5).indices[1])
    after = logits[0].clone()
    after[1, d1] -= 0.5  # at position 1, d_1 was emitted
    top = [torch.topk(after[j], 5) for j in range(3)]
    p = [torch.softmax(t.values / 0.8, -1) for t in top]
    drafts = torch.tensor([[d1, int(top[1].indices[1])]]).repeat(slots, 1)
    first, second = torch.zeros(5), torch.zeros(5)
    sampler = Sampler(slots, V, "cpu")
    for r in range(rounds):
        for s in range(slots):
            sampler.start(s, SamplingParams(**{**params.__dict__, "seed": r * slots + s}))
        tokens, counts = accept_drafts(sampler, list(range(slots)), logits.repeat(slots, 1, 1), drafts)
        for row, c in zip(tokens.tolist(), counts.tolist()):
            first[top[0].indices.tolist().index(row[0])] += 1
            if row[0] == int(drafts[0, 0]):
                assert c >= 2
                second[top[1].indices.tolist().index(row[1])] += 1
    assert chi_square(first, p[0]) < CHI2_4DF_P001
    assert second.sum() > 500 and chi_square(second, p[1]) < CHI2_4DF_P001


def test_penalties_count_the_drafts_before_each_position():
    """Presence 0.7 and frequency 0.3 penalties at temperature 0.8: position j's logits are the plain sampler's
    after the slot's earlier tokens and drafts d_1 .. d_j."""
    from qwen_chat.engine.model.spec_sampling import penalised

    V = 16
    sampler = Sampler(2, V, "cpu")
    sampler.start(1, SamplingParams(temperature=0.8, top_p=1.0, top_k=0, presence_penalty=0.7, seed=0,
                                    max_new_tokens=9, stop_token_ids=(), frequency_penalty=0.3))
    sampler.sample_async([1], torch.nn.functional.one_hot(torch.tensor([4]), V).float() * 50)  # emits 4
    logits = torch.randn(1, 3, V, generator=torch.Generator().manual_seed(1))
    got = penalised(sampler, [1], logits, torch.tensor([[4, 9]])).view(3, V)
    for j, seen in enumerate([[4], [4, 4], [4, 4, 9]]):
        counts = torch.bincount(torch.tensor(seen), minlength=V).float()
        want = (logits[0, j] - 0.3 * counts - 0.7 * (counts > 0).float()) / 0.8
        assert torch.allclose(got[j], want), j


def test_a_seed_gives_the_same_sampled_reply_alone_and_in_a_batch_of_four(tiny_loaded):
    """Temperature 0.8 with the MTP head drafting (k = 2): a seeded request's reply is the same alone and beside
    three others."""
    ps = prompts(4)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, presence_penalty=0.0, seed=42,
                              max_new_tokens=40, stop_token_ids=())

    def replies(batch):
        runner = make_runner(tiny_loaded, num_slots=4, k=2)
        sched = Scheduler(LocalExecutor(runner, Sampler(4, runner.vocab_size, "cpu")), num_slots=4, max_queue=8,
                          eos_ids=(), max_context=512, num_blocks=runner.num_blocks, block_tokens=16,
                          overlap=True, speculative_tokens=2)
        try:
            handles = [sched.submit(p, sampling, CancelToken()) for p in batch]
            return [list(h) for h in handles], sched.stats()["totals"]
        finally:
            sched.shutdown()

    alone, totals = replies(ps[:1])
    together, _ = replies(ps)
    assert totals["spec_steps"] > 0
    assert together[0] == alone[0] and len(alone[0]) == 40


# ------------------------------------------------------------------------------------------- the MTP head
def test_the_mtp_head_loads_the_checkpoint_tensors(tiny_loaded):
    """All 15 ``mtp.*`` tensors of the tiny checkpoint land in the head, as stored."""
    from safetensors import safe_open
    import json

    folder = tiny_loaded.checkpoint
    head = load_mtp_head(folder, tiny_loaded.model.config.text_config, device="cpu", dtype=torch.float32)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    names = [n for n in index if n.startswith("mtp.")]
    assert len(names) == 15 and len(head.state_dict()) == 15
    for name in names:
        with safe_open(str(folder / index[name]), "pt") as fh:
            assert torch.equal(head.state_dict()[name[4:]], fh.get_tensor(name).float()), name
    assert math.isclose(float(head.fc.weight.std()), 0.02, rel_tol=0.2)


def test_an_fp8_mtp_head_is_dequantised(tiny_loaded, tmp_path):
    """A checkpoint whose MTP linear weights are stored in the FP8 block format (F8_E4M3 + ``weight_scale_inv``,
    one file without an index): the head loads them dequantised, as the block format defines (w = fp8 x scale)."""
    from safetensors.torch import save_file

    from qwen_chat.engine.model.fp8 import quantize_blocks

    ref = load_mtp_head(tiny_loaded.checkpoint, tiny_loaded.model.config.text_config, device="cpu",
                        dtype=torch.float32)
    tensors = {}
    for name, t in ref.state_dict().items():
        if t.dim() == 2:
            q = quantize_blocks(t)
            tensors[f"mtp.{name}"], tensors[f"mtp.{name}_scale_inv"] = q.data, q.scale
        else:
            tensors[f"mtp.{name}"] = t.to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    head = load_mtp_head(tmp_path, tiny_loaded.model.config.text_config, device="cpu", dtype=torch.float32)
    for name, t in ref.state_dict().items():
        got = head.state_dict()[name]
        if t.dim() == 2:
            q = quantize_blocks(t)
            assert torch.equal(got, q.dequantize(torch.float32)), name
            assert float((got - t).abs().max()) <= float(t.abs().max()) / 16, name
        else:
            assert torch.equal(got, t), name


# ------------------------------------------------------------------------------------------- the service
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


def spec_engine(loaded, k=2, num_slots=3):
    """A ChatEngine over the tiny model with the MTP head drafting (k drafts), every step recorded."""
    from tests.support.spy_executor import SpyExecutor

    runner = make_runner(loaded, num_slots=num_slots, k=k, max_context=1024)
    spy = SpyExecutor(runner, Sampler(num_slots, runner.vocab_size, "cpu"))
    return ChatEngine(loaded, runner, spy, image_token_budget=64, max_context=1024, max_queue=4,
                      num_slots=num_slots, speculative_tokens=k), spy


def test_structured_output_and_tool_calls_stay_valid_beside_speculating_replies(tiny_loaded):
    """Three requests at once with speculation on: a plain greedy reply (speculating) equals its reply without
    speculation, a JSON-schema reply parses and validates, a required tool call names the tool with valid
    arguments (constrained replies speculate too: their verified positions are masked, test_spec_grammar)."""
    import json

    import jsonschema

    from qwen_chat.chat_types import ToolSpec
    from tests.support.replies import replies_at_once

    tool = ToolSpec("get_time", "", {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                     "required": ["zone"]})
    ask = [ChatMessage(role="user", text="Tell me about the sea.")]

    def greedy(**kw):
        return GenerationSettings.preset(False, **{"temperature": 0.0, "max_new_tokens": 40, **kw})

    plain_engine, _ = spec_engine(tiny_loaded, k=0)
    try:
        alone = list(plain_engine.stream_chat(ask, greedy(), CancelToken()))[-1].answer
    finally:
        plain_engine.close()
    engine, spy = spec_engine(tiny_loaded)
    try:
        results = replies_at_once(engine, ask, {"plain": greedy(), "json": greedy(json_schema=SCHEMA),
                                                "tool": greedy(tools=(tool,), tool_choice="required")})
        assert engine.stats()["spec_steps_total"] > 0
    finally:
        engine.close()
    assert results["plain"].answer == alone
    jsonschema.validate(json.loads(results["json"].answer), SCHEMA)
    call = results["tool"].tool_calls[0]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("utc", "cet")
    assert any(p.spec_k and len(p.decode_slots) == 3 and not p.spec_plain for p in spy.plans)  # all three draft


def test_stop_frees_the_slot_within_one_step_while_speculating(tiny_loaded):
    """Stop after the third update of a long reply that speculates (oracle-free: the MTP head, k = 3): the
    stream ends cancelled, the very next step frees the slot and runs nothing else, and the next request works."""
    from tests.support.waiting import wait_until

    engine, spy = spec_engine(tiny_loaded, k=3, num_slots=1)
    try:
        cancel = CancelToken()
        updates = []
        settings = GenerationSettings.preset(False, temperature=0.0, max_new_tokens=8192)
        for u in engine.stream_chat([ChatMessage(role="user", text="Write a long story.")], settings, cancel):
            updates.append(u)
            if len(updates) == 3:
                steps = len(spy.plans)
                cancel.cancel()
        assert updates[-1].finish_reason == "cancelled" and updates[-1].completion_tokens < 100
        wait_until(lambda: any(p.free_slots == [0] for p in spy.plans[steps:]))
        freeing = next(i for i, p in enumerate(spy.plans) if i >= steps and p.free_slots == [0])
        assert freeing <= steps + 1 and not spy.plans[freeing].decode_slots
        assert any(p.spec_k for p in spy.plans[:steps])
        last = list(engine.stream_chat([ChatMessage(role="user", text="Hi")],
                                       GenerationSettings.preset(False, temperature=0.0, max_new_tokens=16),
                                       CancelToken()))[-1]
        assert last.finish_reason in ("stop", "length") and last.completion_tokens > 0
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------- tensor parallel
def _greedy_steps(ex, prompt, n, k=0, drafts_of=None):
    """Greedy tokens of ``prompt`` through executor steps: plain, or speculative with k drafts from
    ``drafts_of(tokens so far)`` (None: the MTP head)."""
    sampling = SamplingParams(**{**GREEDY.__dict__, "max_new_tokens": n})
    out = [ex.execute(StepPlan(prefills=[PrefillItem(0, prompt, sampling)]))[0]]
    while len(out) < n:
        if k:
            drafts = [drafts_of(out)] if drafts_of is not None else []
            out += ex.execute(StepPlan(decode_slots=[0], decode_tokens=[out[-1]], spec_k=k, drafts=drafts))[0]
        else:
            out.append(ex.execute(StepPlan(decode_slots=[0], decode_tokens=[out[-1]]))[0])
    return out[:n]


def _tp_body(rank: int, report: dict) -> None:
    import os

    from qwen_chat.engine.checkpoints.loading import load_model
    from qwen_chat.engine.checkpoints.tiny import build_tiny_checkpoint
    from qwen_chat.engine.parallel import sharding
    from qwen_chat.engine.parallel.collectives import broadcast_from_rank0
    from qwen_chat.engine.parallel.ranks import unlink_deepspeed_shm

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getppid() % 20000))
    loaded = load_model(build_tiny_checkpoint(os.environ["SPEC_TEST_CACHE"]), "cpu", torch.float32)
    prompt = prompts(1)[0]
    single = make_runner(loaded, num_slots=1)
    want = _greedy_steps(LocalExecutor(single, Sampler(1, single.vocab_size, "cpu")), prompt, 60)
    loaded.model = sharding.shard_model(loaded.model, sharding.read_plan(None, 2, "cpu"), torch.device("cpu"))
    torch.distributed.barrier()
    unlink_deepspeed_shm(rank)
    runner = make_runner(loaded, num_slots=1, k=2)
    sampler = Sampler(1, runner.vocab_size, "cpu")
    sampler.token_sync = broadcast_from_rank0
    ex = LocalExecutor(runner, sampler)
    report["want"] = want
    report["mtp"] = _greedy_steps(ex, prompt, 60, k=2)
    wrong = iter(range(10 ** 6))
    report["oracle"] = _greedy_steps(ex, prompt, 60, k=2, drafts_of=lambda out: [
        t if next(wrong) % 3 else t + 1 for t in want[len(out):len(out) + 2] + [0, 0]][:2])
    report["tp"] = type(runner.tp).__name__


@pytest.mark.slow  # two processes import deepspeed and load the tiny model (~40 s on 2 CPU cores)
def test_tensor_parallel_speculation_gives_the_tokens_of_one_rank(tmp_path, tiny_checkpoint, monkeypatch):
    """TP = 2 over gloo, the tiny model sharded: speculative steps (MTP head and oracle drafts, some wrong, k = 2)
    give the greedy tokens of plain decoding on one rank, on both ranks."""
    from tests.support.two_ranks import run_two_ranks

    monkeypatch.setenv("SPEC_TEST_CACHE", str(tiny_checkpoint.parent))
    for rep in run_two_ranks(_tp_body, tmp_path, "gloo"):
        assert rep["errors"] == [], rep
        assert rep["tp"] == "TensorParallelDecode"
        assert rep["mtp"] == rep["want"] and rep["oracle"] == rep["want"], rep


def _mtp_reference(runner, ids: list[int], k: int) -> list[int]:
    """The MTP head's k chained drafts after the sequence ``ids``, recomputed from scratch: the target's final
    normed hidden states of ids[:-1] (a fresh prefill), the head's decoder layer over all positions at once
    (transformers' module, explicit causal mask), then k - 1 chained positions."""
    head, fwd = runner.spec.drafter.head, runner._forward
    lm = runner.model.model.language_model
    runner.free(1)
    runner.prefill(1, PreparedPrompt(input_ids=torch.tensor(ids[:-1])))
    hidden = fwd._final_norm(fwd.prefill_hidden)
    runner.free(1)
    tokens = list(ids[1:])
    drafts = []
    for _ in range(k):
        n = hidden.shape[0]
        emb = lm.embed_tokens(torch.tensor(tokens))
        x = head.fc(torch.cat([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden)], -1))[None]
        pos = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = head.norm(head.layers[0](x, position_embeddings=lm.rotary_emb(x, pos), attention_mask=mask))[0]
        drafts.append(int(runner.model.lm_head(y[-1]).argmax()))
        hidden = torch.cat([hidden, y[-1:]])
        tokens.append(drafts[-1])
    return drafts


@torch.no_grad()
def test_mtp_drafts_equal_the_head_run_over_the_whole_sequence(tiny_loaded):
    """The MTP drafter's k = 3 drafts after a prompt prefilled in chunks (its keys and values filled chunk by
    chunk), then after each of three speculative steps, equal the head recomputed over the whole sequence from
    scratch."""
    runner = make_runner(tiny_loaded, num_slots=2, k=3)
    ex = LocalExecutor(runner, Sampler(2, runner.vocab_size, "cpu"))
    drafter = runner.spec.drafter
    seen = []
    propose = drafter.propose
    drafter.propose = lambda *args, **kw: seen.append(propose(*args, **kw)) or seen[-1]
    prompt = prompts(1, (40,))[0]
    ids = prompt.input_ids.tolist()
    for start, end in ((0, 16), (16, 32), (32, 40)):
        got = ex.execute(StepPlan(prefills=[PrefillItem(0, prompt, GREEDY, start=start, end=end)]))
    ids.append(got[0])
    for step in range(3):
        want = _mtp_reference(runner, ids, 3)
        ids += ex.execute(StepPlan(decode_slots=[0], decode_tokens=[ids[-1]], spec_k=3))[0]
        assert seen[step][0].tolist() == want, step


@torch.no_grad()
def test_drafting_padded_as_its_cuda_graph_pads_it_gives_the_same_drafts(tiny_loaded):
    """What ``mtp_graphs.DraftGraphs`` runs for 3 slots (padded to 4, the fourth on the scratch slot at position
    0 with one kept position), run eagerly here: the real slots' k = 2 drafts equal those of the unpadded
    ``draft``, after prompts and after a speculative step (drafting on as if the slots kept 1, 2 and 3 of its
    positions); the MTP layer's keys of the real slots are the same either way (to rounding: the rows are
    batched otherwise)."""
    from qwen_chat.engine.model.speculative import device_ints

    runner = make_runner(tiny_loaded, num_slots=4, k=2)
    ex = LocalExecutor(runner, Sampler(4, runner.vocab_size, "cpu"))
    drafter = runner.spec.drafter
    last = ex.execute(StepPlan(prefills=[PrefillItem(s, p, GREEDY) for s, p in enumerate(prompts(3))]))
    for step in range(2):
        rows = [(s, drafter._pending[s][0], drafter._pending[s][1] if step == 0 else 1 + s, drafter._start[s],
                 runner.rope_deltas[s]) for s in range(3)]  # after the step: 1, 2, 3 kept positions
        ctx = runner.context_bucket(max(r[1] for r in rows) + 3 + 2)
        runner.spec.verifier.prepare([0, 1, 2], 3)
        want = drafter.draft(device_ints([list(c) for c in zip(*rows)], "cpu"), ctx, 2)
        keys = drafter.k_cache.clone()
        padded = rows + [(runner.num_slots, 0, 1, 0, 0)]
        got = drafter.draft(device_ints([list(c) for c in zip(*padded)], "cpu"), ctx, 2)
        assert torch.equal(got[:3], want), step
        null = runner.tables.null_block  # the scratch slot's writes land in the null block only
        assert torch.allclose(drafter.k_cache[:null], keys[:null], atol=1e-5), step  # (rows batched otherwise)
        # one speculative step: each slot's verify rows give the MTP layer's inputs of the next draft
        out = ex.execute(StepPlan(decode_slots=[0, 1, 2], decode_tokens=[last[s] for s in range(3)], spec_k=2,
                                  drafts=[[5, 6], [7, 8], [9, 10]]))
        last = [out[s][-1] for s in range(3)]


@torch.no_grad()
def test_a_verify_step_padded_as_its_cuda_graph_pads_it_gives_the_same_rows(tiny_loaded):
    """What ``graphs.CudaGraphs`` runs for 3 sequences x T = 2 on CUDA (padded to 4 sequences, the fourth on
    the scratch slot at position 0), run eagerly here: the real rows' logits and hidden states equal those of
    the unpadded verify forward, and the real slots' states too."""
    from qwen_chat.engine.model.speculative import _graph_step

    outs, states = [], []
    for padded in (False, True):
        runner = make_runner(tiny_loaded, num_slots=4, k=1, mtp=False)
        for s, p in enumerate(prompts(3)):
            runner.prefill(s, p)
        v = runner.spec.verifier
        v.prepare([0, 1, 2], 2)
        rows = [s for s in (0, 1, 2) for _ in range(2)]
        pos = [runner.lengths[s] + j for s in (0, 1, 2) for j in range(2)]
        tokens = [7, 8, 9, 10, 11, 12]
        if padded:
            rows, pos, tokens = rows + [runner.num_slots] * 2, pos + [0, 0], tokens + [0, 0]
        t = torch.tensor([rows, tokens, pos, pos])  # the tiny prompts have no images: rope = position
        outs.append(_graph_step(runner._forward, 2, v.snapshots(1), *t, runner.context_bucket(max(pos) + 1))[:6])
        states.append([runner.rec_state[i][:3].clone() for i in runner.rec_state])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*states))


@pytest.mark.slow  # Triton's interpreter in a subprocess (about 30 s on 2 CPU cores)
def test_verify_through_the_gated_deltanet_kernel_gives_the_plain_tokens():
    """The verify step through the one-kernel Gated DeltaNet decode (``gdn.gdn_decode``, Triton's interpreter on
    CPU), k = 2 with some drafts wrong: the greedy tokens of plain decoding through the same kernel."""
    pytest.importorskip("triton", reason="Triton is installed by deploy/install.sh --test")
    from tests.support.interpreted import run_interpreted

    r = run_interpreted("tests.support.spec_triton_check")
    assert "triton" in r["impl"] and r["spec"] == r["plain"], r


def test_n_choices_share_one_prefill_and_equal_their_solo_replies_while_speculating(tiny_loaded):
    """n = 2 sampled choices (temperature 1, seed 21) with the MTP head drafting: they share one prefill (the
    slot and the MTP head's keys and values copied) and choice i is the reply a request with seed 21 + i gets
    alone."""
    from dataclasses import replace

    engine, spy = spec_engine(tiny_loaded, k=2, num_slots=2)
    ask = [ChatMessage(role="user", text="Say something")]
    settings = GenerationSettings.preset(False, seed=21, max_new_tokens=24, temperature=1.0)
    try:
        lasts = {}
        for u in engine.stream_chat(ask, replace(settings, n=2), CancelToken()):
            if u.finish_reason is not None:
                lasts[u.index] = u
        assert [len(item.copies) for plan in spy.plans for item in plan.prefills] == [1]
        assert any(p.spec_k for p in spy.plans)
        for i in range(2):
            alone = list(engine.stream_chat(ask, replace(settings, seed=21 + i), CancelToken()))[-1]
            assert (lasts[i].answer, lasts[i].completion_tokens) == (alone.answer, alone.completion_tokens)
    finally:
        engine.close()


def test_a_checkpoint_without_an_mtp_head_serves_without_speculation(tiny_loaded, tmp_path, caplog):
    """``--speculative-tokens 2`` on a checkpoint folder whose index lists no ``mtp.*`` tensor: the runner is
    built without speculation and the log says why (the service keeps serving)."""
    import json
    import logging
    import shutil
    from dataclasses import replace as dc_replace

    from qwen_chat.config import ServiceConfig
    from qwen_chat.engine.startup.runner_setup import build_runner

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_loaded.checkpoint, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.startswith("mtp.")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = ServiceConfig(model=str(folder), speculative_tokens=2, device="cpu")
    with caplog.at_level(logging.WARNING):
        runner, *_ = build_runner(dc_replace(tiny_loaded, checkpoint=folder), cfg)
    assert runner.spec is None
    assert "speculative decoding is off" in caplog.text and "no MTP head" in caplog.text


# ------------------------------------------------------------------------------------------- never slower
def test_a_sequence_speculates_only_while_its_kept_share_pays_for_the_measured_step():
    """``break_even``: a step of k drafts costing c plain steps pays above (c - 1) / k kept drafts (clamped);
    a sequence keeping half its drafts speculates on at the given-drafts cost (1.29, K = 1) and pauses at the
    cost with the head drafting eagerly (1.86), probing again after ``PROBE_TOKENS`` plain tokens."""
    from qwen_chat.engine.core.spec_policy import PROBE_TOKENS, SpecStats, break_even

    assert break_even(1.29, 1) == pytest.approx(0.29)
    assert break_even(1.86, 1) == pytest.approx(0.86) and break_even(2.83, 3) == pytest.approx(0.61)
    assert break_even(0.9, 1) == 0.05 and break_even(5.0, 2) == 1.0
    with pytest.raises(ValueError):
        break_even(float("nan"), 1)
    cheap, dear = SpecStats(break_even(1.29, 1)), SpecStats(break_even(1.86, 1))
    for i in range(40):
        for stats in (cheap, dear):
            if stats.wants():
                stats.spec_step(1, i % 2)  # every other draft kept
            else:
                stats.plain_step()
    assert cheap.wants() and cheap.drafted == 40
    assert not dear.wants() and dear.drafted < 10
    for _ in range(PROBE_TOKENS):
        dear.plain_step()
    assert dear.wants()


def test_the_engine_measures_its_speculative_step_and_sets_the_threshold_from_it(tiny_loaded):
    """``Speculation.calibrate`` times plain and speculative steps (the MTP head drafting) and leaves slot 0
    free; the ChatEngine built on that runner gives its requests the break-even of the measured ratio."""
    from qwen_chat.engine.core.spec_policy import break_even

    engine, _ = spec_engine(tiny_loaded, k=2)
    try:
        assert engine.runner.spec.cost_ratio is None
    finally:
        engine.close()
    runner = make_runner(tiny_loaded, num_slots=3, k=2, max_context=1024)
    sampler = Sampler(3, runner.vocab_size, "cpu")
    ratio = runner.spec.calibrate(sampler, steps=3)
    assert ratio == runner.spec.cost_ratio and 0 < ratio < float("inf")  # CPU timings: only a number
    assert runner.lengths[0] == 0 and runner.tables.count(0) == 0
    engine = ChatEngine(tiny_loaded, runner, LocalExecutor(runner, sampler), image_token_budget=64,
                        max_context=1024, max_queue=4, num_slots=3, speculative_tokens=2)
    try:
        assert engine.scheduler._batch.spec_min == pytest.approx(break_even(ratio, 2))
        sampling = SamplingParams(**{**GREEDY.__dict__, "max_new_tokens": 8})
        assert len(list(engine.scheduler.submit(prompts(1)[0], sampling, CancelToken()))) == 8
    finally:
        engine.close()
