"""CPU checks of the tensor-parallel collectives' fallback path and of the token sharing that lets every rank
launch steps ahead (``qwen_chat.engine.parallel.collectives``, ``Sampler.token_sync``, ``DistributedExecutor``).

The symmetric-memory kernels need two GPUs: ``tests/gpu/test_tp_cuda.py``.
"""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.types import SamplingParams, StepPlan
from qwen_chat.engine.model.sampling import Sampler
from tests.support.two_ranks import run_two_ranks


def _cpu_body(rank: int, rep: dict) -> None:
    from qwen_chat.engine.parallel.collectives import TensorParallelComm, broadcast_from_rank0

    comm = TensorParallelComm(None, "cpu", torch.float32)
    rep["kind"], rep["fused_rows"], rep["gather_rows"] = comm.kind, comm.fused_rows(64), comm.gather_rows(64)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
    rep["sum"] = comm.all_reduce(x.clone()).tolist()
    local = torch.arange(4, dtype=torch.float32).reshape(2, 2) + 10 * rank        # [B=2, n=2]
    rep["gathered"] = comm.all_gather_last(local).tolist()
    rep["gathered_3d"] = comm.all_gather_last(local.reshape(2, 1, 2)).shape[-1]
    rep["tokens"] = broadcast_from_rank0(torch.tensor([3, 4, 5]) + 100 * rank).tolist()
    try:
        TensorParallelComm(None, "cpu", torch.float32, backend="symm_mem")
        rep["symm_mem_on_cpu"] = "accepted"
    except RuntimeError as exc:
        rep["symm_mem_on_cpu"] = str(exc)


def test_comm_falls_back_to_torch_distributed_on_cpu_and_sums_gathers_broadcasts(tmp_path):
    for rep in run_two_ranks(_cpu_body, tmp_path, "gloo"):
        assert rep["errors"] == [], rep
        assert rep["kind"] == "torch.distributed"
        assert rep["fused_rows"] == 0 and rep["gather_rows"] == 0
        assert rep["sum"] == [[0.0, 3.0, 6.0], [9.0, 12.0, 15.0]]          # (1 + 2) x arange
        # rank 0's columns, then rank 1's, per row
        assert rep["gathered"] == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]
        assert rep["gathered_3d"] == 4
        assert rep["tokens"] == [3, 4, 5]
        assert "needs CUDA devices" in rep["symm_mem_on_cpu"]


def test_comm_rejects_an_unknown_backend(monkeypatch):
    import torch.distributed as dist

    from qwen_chat.engine.parallel.collectives import TensorParallelComm

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="auto, symm_mem or nccl"):
        TensorParallelComm(object(), "cpu", torch.float32, backend="mpi")
    # the kind is an argument (ServiceConfig.tp_allreduce), never read from the environment here
    monkeypatch.setenv("QWEN_CHAT_TP_ALLREDUCE", "mpi")
    assert TensorParallelComm(object(), "cpu", torch.float32).kind == "torch.distributed"


def test_sampler_records_the_shared_tokens_not_its_own_draw():
    sampler = Sampler(2, 50, "cpu")
    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, presence_penalty=0.0, seed=0, max_new_tokens=8,
                            stop_token_ids=())
    sampler.start(1, greedy)
    logits = torch.zeros(1, 50)
    logits[0, 7] = 5.0                              # this rank's own greedy draw would be 7
    sampler.token_sync = lambda t: t.fill_(42)      # rank 0 drew 42
    out = sampler.sample_async([1], logits)
    assert out.tolist() == [42]
    assert int(sampler.last_tokens[1]) == 42
    assert bool(sampler.presence[1, 42]) and not bool(sampler.presence[1, 7])


class _FakeLocal:
    def __init__(self, token_sync):
        self.sampler = type("S", (), {"token_sync": token_sync})()
        self.launched = []

    def launch(self, plan):
        self.launched.append(plan)
        return "handle"

    def collect(self, launched):
        return {0: 1}


def test_distributed_executor_launches_ahead_only_when_ranks_share_tokens(monkeypatch):
    from qwen_chat.engine.parallel import executors as qdist

    sent = []
    monkeypatch.setattr(qdist, "broadcast_plan", lambda plan, group: sent.append(plan) or plan)
    plan = StepPlan(decode_slots=[0], tokens_on_device=True)

    without = qdist.DistributedExecutor(_FakeLocal(None), group=None, timeout_s=3600.0)
    try:
        assert not without.tokens_on_device
        with pytest.raises(ValueError, match="token_sync"):
            without.launch(plan)
        assert sent == []                          # refused before anything reached the other ranks
    finally:
        without.close()

    local = _FakeLocal(lambda t: t)
    shared = qdist.DistributedExecutor(local, group=None, timeout_s=3600.0)
    try:
        assert shared.tokens_on_device
        assert shared.collect(shared.launch(plan)) == {0: 1}
        assert sent[-1] is plan and local.launched == [plan]
    finally:
        shared.close()


def test_worker_launches_each_plan_before_waiting_for_the_previous_one(monkeypatch):
    from qwen_chat.engine.parallel import executors as qdist

    plans = iter([StepPlan(decode_slots=[0], tokens_on_device=True), StepPlan(op=qdist.PING_OP),
                  StepPlan(decode_slots=[0], tokens_on_device=True), StepPlan(op=qdist.EXIT_OP)])
    monkeypatch.setattr(qdist, "broadcast_plan", lambda plan, group: next(plans))
    calls = []

    class Local:
        def launch(self, plan):
            calls.append(("launch", len(calls)))
            return len(calls) - 1

        def collect(self, handle):
            calls.append(("collect", handle))
            return {}

    monkeypatch.setattr(qdist.dist, "get_rank", lambda group=None: 1)
    # off the main thread, so the loop leaves the test process's signal handlers alone
    import threading

    t = threading.Thread(target=qdist.worker_loop, args=(Local(), None))
    t.start()
    t.join(30)
    assert not t.is_alive()
    # the second step is queued before the worker waits for the first; the last one is never waited for
    assert calls == [("launch", 0), ("launch", 1), ("collect", 0)]
