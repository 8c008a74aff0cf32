"""The packed gated delta rule with keep points (``delta_rule``): the packed path (as fla's varlen kernel runs
it, two calls) and the per-sequence path give the same outputs, final states and kept states as running the
reference rule on each sequence with a stop at each of its keep points (a chunk may hold several: a system
prompt's end and a turn's end)."""
from __future__ import annotations

import inspect

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as rule

from qwen_chat.engine.model import delta_rule


def varlen_rule(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                cu_seqlens_cpu=None):
    """fla's calling convention (packed sequences, bounds in ``cu_seqlens``) over the reference rule."""
    assert cu_seqlens_cpu is None or torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
    outs, states = [], []
    b = cu_seqlens.cpu().tolist()
    for j, (lo, hi) in enumerate(zip(b, b[1:])):
        o, st = rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi],
                     initial_state=initial_state[j:j + 1], output_final_state=True, use_qk_l2norm_in_kernel=False)
        outs.append(o)
        states.append(st)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


def test_packed_and_per_sequence_paths_agree_with_stopping_at_each_keep_point():
    gen = torch.Generator().manual_seed(5)
    chunks = [(0, 9, (4,)), (9, 5, ()), (14, 11, (11,)), (25, 7, (6,)), (32, 12, (3, 7, 12)), (44, 6, (2, 5))]
    T, H, dk, dv = 50, 2, 8, 6
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, dv, generator=gen)
    g = -torch.rand(1, T, H, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(len(chunks), H, dk, dv, generator=gen)
    want_out, want_final, want_kept = [], [], []
    for j, (off, n, keeps) in enumerate(chunks):
        sl = slice(off, off + n)
        o, st = rule(q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl], initial_state=h0[j:j + 1],
                     output_final_state=True, use_qk_l2norm_in_kernel=False)
        want_out.append(o)
        want_final.append(st)
        for keep in keeps:
            kl = slice(off, off + keep)
            _, kst = rule(q[:, kl], k[:, kl], v[:, kl], g=g[:, kl], beta=beta[:, kl], initial_state=h0[j:j + 1],
                          output_final_state=True, use_qk_l2norm_in_kernel=False)
            want_kept.append(kst)
    want_out, want_final, want_kept = torch.cat(want_out, 1), torch.cat(want_final), torch.cat(want_kept)
    seg = delta_rule.segments(chunks)
    index = delta_rule.host_index(seg)
    assert seg.rounds == 3
    index.update(delta_rule.host_bounds(index))
    tail_calls = []

    def tail_rule(*args, **kwargs):
        tail_calls.append(kwargs["cu_seqlens"].tolist())
        return varlen_rule(*args, **kwargs)

    for fn, varlen, tail in ((varlen_rule, True, None), (varlen_rule, True, tail_rule), (rule, False, None)):
        out, final, kept = delta_rule.packed_delta_rule(fn, varlen, seg, q, k, v, g, beta, h0, index, tail)
        assert kept.shape[0] == 8
        for got, want in ((out, want_out), (final, want_final), (kept, want_kept)):
            assert torch.allclose(got, want, atol=1e-5), (varlen, (got - want).abs().max())
    # the two later rounds (tails of 5, 1, 4 and 3 tokens; then 5 and 1) went through the short-tail rule
    assert tail_calls == [[0, 5, 6, 10, 13], [0, 5, 6]]


def test_a_long_tail_goes_through_the_chunked_rule():
    """A tail after a system prompt's keep point (the first user message) is longer than
    ``TAIL_RECURRENT_MAX``: the chunked rule runs it, not the token-by-token one."""
    n = delta_rule.TAIL_RECURRENT_MAX + 10
    seg = delta_rule.segments([(0, n + 5, (5,))])
    index = delta_rule.host_index(seg)
    index.update(delta_rule.host_bounds(index))
    H, dk, dv = 1, 4, 4
    q = k = torch.nn.functional.normalize(torch.randn(1, n + 5, H, dk), dim=-1)
    v, g, beta = torch.randn(1, n + 5, H, dv), -torch.rand(1, n + 5, H), torch.rand(1, n + 5, H)

    def never(*args, **kwargs):
        raise AssertionError("the token-by-token rule ran a long tail")

    out, final, kept = delta_rule.packed_delta_rule(varlen_rule, True, seg, q, k, v, g, beta,
                                                    torch.zeros(1, H, dk, dv), index, never)
    want, st = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                    use_qk_l2norm_in_kernel=False)
    assert torch.allclose(out, want, atol=1e-5) and torch.allclose(final, st, atol=1e-5)


def test_the_reference_rule_is_the_pytorch_function_not_transformers_dispatcher(monkeypatch):
    """transformers wraps ``torch_chunk_gated_delta_rule`` in a dispatcher that runs fla's Triton kernel when
    fla is installed (TF32 ``tl.dot`` in fp32).  The rule an fp32 or fla-less engine gets must be the PyTorch
    function itself, whichever the module attribute is when the runner is built: here a dispatcher that would
    call another kernel stands in the module."""
    import functools

    from transformers.models.qwen3_5 import modeling_qwen3_5

    pure = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    calls = []

    @functools.wraps(pure)
    def dispatcher(*args, **kwargs):
        calls.append(1)
        raise AssertionError("the dispatcher ran: the engine would use fla's kernel")

    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", dispatcher)
    for device, dtype in ((torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.bfloat16)):
        chosen, name, varlen, tail = delta_rule.resolve_chunk_rule(device, dtype)
        assert chosen is pure and name.startswith("transformers.") and not varlen and tail is None
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    v, g, beta = torch.randn(1, 8, 2, 16), -torch.rand(1, 8, 2), torch.rand(1, 8, 2)
    out, state = chosen(q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert out.shape == (1, 8, 2, 16) and state.shape == (1, 2, 16, 16) and not calls
