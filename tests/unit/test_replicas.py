"""Data-parallel replicas without a model: the layout and its one-line refusals, the routing rule, the router
over scripted replicas, and the ``replica`` label of ``/metrics``.  The engine link (the real protocol) is
tested in ``tests/engine/test_engine_link.py``; the service itself in ``tests/service/test_replicas.py``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from qwen_chat.chat_types import (
    Busy,
    CancelToken,
    ChatMessage,
    GenerationSettings,
    NotReady,
)
from qwen_chat.config import ConfigError, ServiceConfig
from qwen_chat.engine.parallel.layout import LayoutError, ReplicaLayout
from qwen_chat.engine.client.router import Load, Router, conversation_key, order_replicas
from qwen_chat.web import ops
from tests.support.fake_backend import FakeBackend
from tests.support.metrics import metric_samples

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "tests" / "fixtures" / "images" / "chelsea.png"
GREEDY = GenerationSettings.preset(False, temperature=0.0, seed=0)


def user(text: str, *images: str) -> ChatMessage:
    return ChatMessage(role="user", text=text, images=tuple(images))


class ReplicaFake(FakeBackend):
    """A scripted replica with what the router reads from an engine: slots and KV blocks in ``stats``, a
    memory report, ``close``."""

    def stats(self) -> dict:
        return {**super().stats(), "num_slots": self.capacity, "max_queue": 0, "kv_blocks": 100,
                "kv_blocks_used": 10}

    def memory_report(self) -> dict:
        return {"state_slots": self.capacity, "max_concurrent_sequences": self.capacity, "kv_blocks": 100,
                "kv_block_tokens": 64, "kv_tokens": 6400, "max_context": self.info.context_length,
                "memory_budget_gib": 0.25}

    def close(self) -> None:
        self.ready = False


# ---- layout ----------------------------------------------------------------------------------------------------
def env(world: int, rank: int = 0) -> dict:
    return {"WORLD_SIZE": str(world), "RANK": str(rank)}


def tp_config(tmp_path: Path, size) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"tensor_parallel": {"autotp_size": size}, "zero_optimization": {"stage": 0}}))
    return path


def test_layout_splits_the_world_into_whole_tp_groups(tmp_path):
    layout = ReplicaLayout.from_env(2, ROOT / "ds_config.json", env(4, rank=3))  # "auto": TP = 4 / 2
    assert (layout.replicas, layout.tp_size, layout.replica, layout.replica_rank, layout.lead_rank) == (2, 2, 1, 1, 2)
    assert not layout.is_lead and list(layout.ranks_of(1)) == [2, 3]
    assert ReplicaLayout.from_env(2, tp_config(tmp_path, 2), env(4, rank=2)).is_lead
    assert ReplicaLayout.from_env(1, None, {}) == ReplicaLayout()  # no launcher: one replica of one rank
    lines = layout.describe({0: "a cuda:0", 1: "a cuda:1", 2: "b cuda:0", 3: "b cuda:1"})
    assert lines == ["replica 0: ranks 0, 1 (a cuda:0, a cuda:1); lead rank 0; serves the web port",
                     "replica 1: ranks 2, 3 (b cuda:0, b cuda:1); lead rank 2"]


@pytest.mark.parametrize("replicas,world,size,message", [
    (2, 3, 2, "the launcher started 3 rank(s), not a multiple of the tensor-parallel degree 2"),
    (1, 4, 2, "--data-parallel 1 x tensor-parallel degree 2 = 2; pass --data-parallel 2"),
    (2, 3, "auto", "the launcher started 3 ranks, which do not split into 2 replicas of equal size"),
    (4, 2, "auto", "--data-parallel 4 needs at least 4 ranks (one GPU each), but the launcher started 2"),
    (2, 4, "two", "tensor_parallel.autotp_size must be \"auto\" or a whole number >= 1, got 'two'"),
])
def test_a_bad_layout_is_refused_in_one_line(tmp_path, replicas, world, size, message):
    with pytest.raises(LayoutError) as info:
        ReplicaLayout.from_env(replicas, tp_config(tmp_path, size), env(world))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_data_parallel_from_the_flag_or_the_environment():
    assert ServiceConfig.from_argv(["--data-parallel", "2"], env={}).data_parallel == 2
    assert ServiceConfig.from_argv([], env={"DATA_PARALLEL": "3"}).data_parallel == 3
    assert ServiceConfig.from_argv([], env={}).data_parallel == 1
    with pytest.raises(ConfigError, match="--data-parallel .* must be >= 1, got 0"):
        ServiceConfig.from_argv(["--data-parallel", "0"], env={}).validate()


# ---- the routing rule ------------------------------------------------------------------------------------------
def load(inflight=0, slots=4, queue=2, blocks=100, used=0, healthy=True) -> Load:
    return Load(inflight, slots, queue, blocks, used, healthy)


def test_most_free_capacity_first_and_the_conversation_replica_while_it_has_room():
    assert order_replicas([load(2), load(1), load(3)]) == [1, 0, 2]
    assert order_replicas([load(1, used=90), load(2)]) == [1, 0]  # KV blocks count as much as slots
    assert order_replicas([load(1), load(1), load(0)]) == [2, 0, 1]  # ties: fewer in flight, then index
    assert order_replicas([load(0), load(3)], preferred=1) == [1, 0]  # its replica has a free slot: kept
    assert order_replicas([load(0), load(4)], preferred=1) == [0, 1]  # no free slot there: most free first
    assert order_replicas([load(0), load(1, used=100)], preferred=1) == [0, 1]  # no free KV block either
    assert order_replicas([load(0, healthy=False), load(5), load(6)]) == [1]  # unhealthy and full skipped
    assert order_replicas([load(0, slots=0, blocks=0)]) == [0]  # nothing known: no limit


def test_a_conversation_is_known_by_its_messages_up_to_the_first_reply():
    first = [ChatMessage(role="system", text="Be brief."), user("hi", "/u/a/images/0f.png")]
    assert conversation_key(first) is None
    turn2 = first + [ChatMessage(role="assistant", text=" Hello! ", reasoning="think"), user("more")]
    turn3 = turn2 + [ChatMessage(role="assistant", text="More."), user("again")]
    key = conversation_key(turn2)
    assert key == conversation_key(turn3)
    moved = [first[0], user("hi", "/elsewhere/0f.png"), ChatMessage(role="assistant", text="Hello!")]
    assert conversation_key(moved) == key  # image files are known by name (their SHA-256), reasoning ignored
    assert conversation_key(first + [ChatMessage(role="assistant", text="Hey!")]) != key  # another reply


# ---- the router over scripted replicas -------------------------------------------------------------------------
def open_stream(router: Router, messages, settings=GREEDY, cancel=None):
    """Start a stream and read its first update (so it is running); returns (stream, first update)."""
    stream = router.stream_chat(messages, settings, cancel or CancelToken())
    return stream, next(stream)


def test_router_spreads_a_burst_keeps_a_conversation_and_passes_busy_on():
    fakes = [ReplicaFake(), ReplicaFake()]
    router = Router(fakes, ranks=[[0], [1]])
    streams = [open_stream(router, [user(f"burst {i}")])[0] for i in range(4)]
    assert [s.replica for s in streams] == [0, 1, 0, 1]
    for s in streams:
        s.close()
    assert [len([c for c in f.calls if c.finish_reason == "cancelled"]) for f in fakes] == [2, 2]

    # a first turn while replica 0 is busier lands on replica 1; its second turn stays there once both are idle
    hold, _ = open_stream(router, [user("long one")])
    first = [user("tell me a story")]
    reply = list(router.stream_chat(first, GREEDY, CancelToken()))
    hold.close()
    assert fakes[1].calls[-1].messages == tuple(first)
    follow = first + [ChatMessage(role="assistant", text=reply[-1].answer), user("and then?")]
    assert router.replica_for(follow) == 1
    assert list(router.stream_chat(follow, GREEDY, CancelToken()))[-1].finish_reason == "stop"
    assert fakes[1].calls[-1].messages == tuple(follow)
    assert router.stats()["replicas"]["1"]["routed_affinity_total"] == 1

    # replica 0 refuses (its queue filled since its last stats): the request goes to replica 1
    fakes[0].capacity, fakes[0].active = 8, 8
    assert router.stream_chat([user("x")], GREEDY, CancelToken()).replica == 1


def test_router_health_and_memory_cover_every_replica():
    fakes = [ReplicaFake(), ReplicaFake()]
    router = Router(fakes, ranks=[[0, 1], [2, 3]])
    health = router.health()
    assert health["ok"] and health["world_size"] == 4 and health["data_parallel"] == 2
    assert [r["ranks"] for r in health["replicas"]] == [[0, 1], [2, 3]]
    assert router.memory_report()["state_slots"] == 8 and router.memory_report()["replicas"] == 2
    fakes[1].ready = False
    health = router.health()
    assert not health["ok"] and health["reason"] == "replica 1: loading model"
    assert router.stream_chat([user("x")], GREEDY, CancelToken()).replica == 0  # the healthy one serves
    fakes[0].ready = False
    with pytest.raises(NotReady, match="no replica is ready"):
        router.stream_chat([user("x")], GREEDY, CancelToken())
    fakes[0].ready = fakes[1].ready = True
    fakes[0].capacity = fakes[1].capacity = 0  # every replica full: 429
    with pytest.raises(Busy):
        router.stream_chat([user("x")], GREEDY, CancelToken())


def test_metrics_label_every_replica_series():
    router = Router([ReplicaFake(gpu_memory_bytes=(5,)), ReplicaFake(gpu_memory_bytes=(7,))])
    list(router.stream_chat([user("x")], GREEDY, CancelToken()))
    registry = CollectorRegistry()
    registry.register(ops._BackendCollector(router))
    m = metric_samples(generate_latest(registry).decode())
    assert m[("qwen_chat_engine_routed_total", (("replica", "0"),))] == 1
    assert m[("qwen_chat_engine_routed_total", (("replica", "1"),))] == 0
    assert m[("qwen_chat_running_sequences", (("replica", "1"),))] == 0
    assert m[("qwen_chat_gpu_memory_bytes", (("rank", "0"), ("replica", "1")))] == 7
    assert m[("qwen_chat_healthy", ())] == 1
