"""The engine process's host cost per generated token, measured without a GPU: the real engine core
(``ChatEngine``, its ``Scheduler`` in overlap mode, the link's ``serve_engine``: input, step output, msgpack and
ZeroMQ sending) driven through the real wire by a minimal front, with a synthetic executor in the model's place
that takes a step's time in a sleep (the GPU's time, which costs the host no CPU) and samples a fixed sentence.
What it isolates: the engine's Python per token (planning each step, routing its tokens, the step message), the
part of ``host_cpu_us_per_token["engine"]`` that is not the model's kernel launches, on this machine's CPU.

Usage (repository root, any machine; the built-in tiny checkpoint's tokenizer, built once into ``--cache-dir``)::

    python bench/engine_host_bench.py                      # 32 and 128 streams, 600-token prompts, 256 out, x3
    python bench/engine_host_bench.py --streams 128 --step-ms 20 --repeat 5
    python bench/engine_host_bench.py --out bench/results/DATE-HOST-engine-host.json

Each burst submits ``--streams`` requests at once (random prompt ids, ``max_tokens`` = ``--tokens``, sampling
at temperature 0.7 as the API's default request would, no stop token is ever drawn) and waits until every one
has finished.  The synthetic executor charges ``--step-ms`` per decode step plus ``--prefill-us-per-token`` per
prompt token of the step (defaults: 20 ms, about an H200's 128-row decode step, and 5 us, about 200k prompt
tokens/s), queued as a GPU queues them (a launched step starts when the previous one ends).  Recorded per burst:
``tokens`` (ids the minimal front received in ``step`` events), ``steps``, ``wall_s``, ``engine_cpu_s`` and
``engine_us_per_token`` (user + system CPU of the engine's threads: scheduler, input, sender, status; the minimal
front's own thread excluded, psutil per thread), ``scheduler_us_per_token`` (its scheduler thread alone),
``us_per_step`` (engine CPU per step); the run with the median ``engine_us_per_token`` of ``--repeat`` is reported.
Where the time goes: ``py-spy record --pid PID --native`` on this process during a burst.

Not a measure of the service: of the engine process's own Python, which the service pays on every step on top
of launching the model's kernels (graph replays: a few per decode step).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from qwen_chat.chat_types import GenerationSettings  # noqa: E402
from qwen_chat.engine import wire  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt, SampledTokens  # noqa: E402

#: The ids the synthetic executor samples, in turn per slot (any ordinary ids of the tiny tokenizer's vocabulary).
SENTENCE = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13, 576, 3974, 13876]


class SyntheticExecutor:
    """Executes step plans without a model: which slots get a token follows ``LocalExecutor.launch`` (the last
    chunk of a prompt, not a resumed one, samples for its slot and its copies; every decode slot samples); the
    step's time (``step_s`` per decode step, ``prefill_s_per_token`` per prompt token) passes in ``collect``'s
    sleep, after the previous launched step's."""

    def __init__(self, step_s: float, prefill_s_per_token: float) -> None:
        self.step_s, self.prefill_s = step_s, prefill_s_per_token
        self._free_at = 0.0
        self._next: dict[int, int] = {}
        self.steps = 0

    def launch(self, plan):
        slots = []
        tokens = 0
        for item in plan.prefills:
            tokens += item.stop() - item.start
            if item.last and not item.resume:
                slots += [item.slot] + [s for s, _ in item.copies]
        slots += list(plan.decode_slots)
        for slot in plan.free_slots:
            self._next.pop(slot, None)
        busy = (self.step_s if plan.decode_slots else 0.0) + tokens * self.prefill_s
        self._free_at = max(time.monotonic(), self._free_at) + busy
        self.steps += 1
        return slots, self._free_at

    def collect(self, launched) -> SampledTokens:
        slots, done_at = launched
        wait = done_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        out = []
        for slot in slots:
            i = self._next.get(slot, 0)
            self._next[slot] = i + 1
            out.append((slot, SENTENCE[i % len(SENTENCE)]))
        return SampledTokens(out)

    def execute(self, plan) -> SampledTokens:
        return self.collect(self.launch(plan))


class MiniFront:
    """The front's end of the link, minimal: binds the PULL socket the engine sends to, sends prompts to the
    engine's input socket, counts each request's tokens from ``step`` events and notes when all finished."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.push = None
        self.hello = threading.Event()
        self.lock = threading.Lock()
        self.tokens: dict[int, int] = {}
        self.finished: set[int] = set()
        self.refused: list = []
        self.all_done = threading.Event()
        self.expect = 0
        self.steps = 0
        self.native_id = None
        self.stop = False

    def run(self) -> None:
        self.native_id = threading.get_native_id()
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self.stop:
            if not poller.poll(100):
                continue
            _, events = wire.loads(self.pull.recv())
            for event in events:
                kind = event[0]
                if kind == "hello":
                    self.push = self.ctx.socket(zmq.PUSH)
                    self.push.connect(event[2])
                    self.hello.set()
                elif kind == "step":
                    with self.lock:
                        self.steps += 1
                        for entry in event[1]:
                            rid = entry[0]
                            self.tokens[rid] = self.tokens.get(rid, 0) + len(entry[2])
                            if entry[4] is not None:
                                self.finished.add(rid)
                        if self.expect and len(self.finished) >= self.expect:
                            self.all_done.set()
                elif kind == "refused":
                    self.refused.append(event[1:])
                    self.all_done.set()

    def burst(self, rids: list[int], prompts: list[dict], settings: dict) -> None:
        with self.lock:
            self.tokens.clear()
            self.finished.clear()
            self.expect = len(rids)
            self.all_done.clear()
        for rid, prompt in zip(rids, prompts):
            self.push.send(wire.dumps(["prompt", rid, prompt, settings]))


def thread_cpu(exclude: set) -> tuple[float, dict]:
    """(user + system CPU seconds of this process's threads except the native ids in ``exclude``, {thread name:
    seconds} for the named Python threads)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    total, by_name = 0.0, {}
    for t in psutil.Process().threads():
        if t.id in exclude:
            continue
        s = t.user_time + t.system_time
        total += s
        by_name[names.get(t.id, "native")] = by_name.get(names.get(t.id, "native"), 0.0) + s
    return total, by_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--step-ms", type=float, default=20.0, help="synthetic decode step time")
    ap.add_argument("--prefill-us-per-token", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("QWEN_CHAT_CACHE_DIR",
                                                                         "~/.cache/qwen_chat")).expanduser())
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    from qwen_chat.engine.checkpoints.loading import load_model, resolve_checkpoint
    from qwen_chat.engine.core.chat_engine import ChatEngine
    from qwen_chat.engine.core.link import serve_engine
    from qwen_chat.engine.text.prompt_worker import pack_prompt

    loaded = load_model(resolve_checkpoint("tiny", args.cache_dir), "cpu", torch.float32)
    slots = max(args.streams)
    context = args.prompt_tokens + args.tokens + 64
    blocks_per_seq = -(-context // 64)
    runner = SimpleNamespace(max_context=context, num_blocks=slots * blocks_per_seq * 2, block_tokens=64, spec=None)
    executor = SyntheticExecutor(args.step_ms / 1e3, args.prefill_us_per_token / 1e6)
    engine = ChatEngine(loaded, runner, executor, image_token_budget=256, max_context=context,
                        max_queue=4 * slots, num_slots=slots, overlap=True)
    front = MiniFront()
    threading.Thread(target=front.run, name="mini-front", daemon=True).start()
    gen = torch.Generator().manual_seed(0)
    settings = wire.pack_settings(GenerationSettings(max_new_tokens=args.tokens, temperature=0.7, top_p=0.8,
                                                     top_k=20, presence_penalty=0.0, seed=1))
    doc = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
           "command": " ".join(["python", "bench/engine_host_bench.py"] + list(argv or sys.argv[1:])),
           "step_ms": args.step_ms, "prefill_us_per_token": args.prefill_us_per_token,
           "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "bursts": {}}
    result = {}

    def drive() -> None:
        try:
            if not front.hello.wait(30):
                raise RuntimeError("the engine never said hello")
            rid = 0
            for streams in args.streams:
                runs = []
                for r in range(args.repeat):
                    prompts = [pack_prompt(PreparedPrompt(input_ids=torch.randint(
                        1000, 20000, (args.prompt_tokens,), generator=gen), max_new_tokens=args.tokens))
                               for _ in range(streams)]
                    rids = list(range(rid, rid + streams))
                    rid += streams
                    steps0 = executor.steps
                    cpu0, names0 = thread_cpu({front.native_id, threading.get_native_id()})
                    t0 = time.perf_counter()
                    front.burst(rids, prompts, settings)
                    if not front.all_done.wait(600):
                        raise RuntimeError("a burst did not finish in 600 s")
                    wall = time.perf_counter() - t0
                    cpu1, names1 = thread_cpu({front.native_id, threading.get_native_id()})
                    if front.refused:
                        raise RuntimeError(f"refused: {front.refused[:1]}")
                    tokens = sum(front.tokens[i] for i in rids)
                    steps = executor.steps - steps0
                    sched = names1.get("qwen-chat-scheduler", 0.0) - names0.get("qwen-chat-scheduler", 0.0)
                    runs.append({"tokens": tokens, "steps": steps, "wall_s": round(wall, 3),
                                 "tok_s": round(tokens / wall, 1), "engine_cpu_s": round(cpu1 - cpu0, 4),
                                 "engine_us_per_token": round((cpu1 - cpu0) / tokens * 1e6, 2),
                                 "scheduler_us_per_token": round(sched / tokens * 1e6, 2),
                                 "us_per_step": round((cpu1 - cpu0) / max(steps, 1) * 1e6, 1),
                                 "cpu_s_by_thread": {k: round(v - names0.get(k, 0.0), 4) for k, v in names1.items()
                                                     if v - names0.get(k, 0.0) > 1e-3}})
                    print(f"{streams:4d} streams run {r + 1}: {runs[-1]['engine_us_per_token']:7.2f} us/token "
                          f"(scheduler {runs[-1]['scheduler_us_per_token']:.2f}), {runs[-1]['us_per_step']:.0f} "
                          f"us/step, {runs[-1]['tok_s']:.0f} tok/s", flush=True)
                med = statistics.median(x["engine_us_per_token"] for x in runs)
                best = next(x for x in runs if x["engine_us_per_token"] == med)
                doc["bursts"][str(streams)] = dict(best, engine_us_per_token_runs=[x["engine_us_per_token"]
                                                                                   for x in runs])
            result["ok"] = True
        except Exception as exc:  # noqa: BLE001 - reported, and the engine is let go
            result["error"] = repr(exc)
        finally:
            front.stop = True

    threading.Thread(target=drive, name="bench-driver", daemon=True).start()
    serve_engine(engine, front.address, secrets.token_hex(8), replica=0, ranks=[0], host="127.0.0.1",
                 until=lambda: front.stop)
    if "error" in result:
        print("FAILED:", result["error"], file=sys.stderr)
        return 1
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(f"{'streams':>8} {'engine us/token':>16} {'scheduler us/token':>19} {'us/step':>8} {'tok/s':>7}")
    for streams, b in doc["bursts"].items():
        print(f"{streams:>8} {b['engine_us_per_token']:>16.2f} {b['scheduler_us_per_token']:>19.2f} "
              f"{b['us_per_step']:>8.0f} {b['tok_s']:>7.0f}")
    return 0


if __name__ == "__main__":
    from qwen_chat.lifecycle import leave

    leave(main())  # as the service's processes end: no interpreter teardown under ZeroMQ's threads
