"""The web front's host cost per generated token, measured without a model: the real front process
(``python -m qwen_chat.front_process``: uvicorn, Gradio, the API, output processing) served by a synthetic engine
that speaks the real link (``engine.core.link.serve_engine``) and emits one token per running request every
``--step-ms`` milliseconds, as a decode step does.  What it isolates: the front's CPU per token, and whether the
front keeps up with a given step rate, on this machine's CPU, whatever GPU the engine would have.

Usage (repository root, any machine; the built-in tiny checkpoint's tokenizer, built once into ``--cache-dir``)::

    python bench/front_bench.py                          # 32 and 128 streams, 256 tokens each, 20 ms steps, x3
    python bench/front_bench.py --streams 128 --tokens 512 --step-ms 8 --stream-interval 4
    python bench/front_bench.py --out bench/results/DATE-HOST-front.json
    python bench/front_bench.py --streams 8 --repeat 1 --step-ms 1 --lone 10 1000 8000   # lone requests' TTFT

Each burst sends ``--streams`` streamed ``/v1/chat/completions`` requests at once (a short message, with
``--prompt-words N`` N random words more as serve_bench's prompts have; ``max_tokens`` = ``--tokens``, ``stream_options.include_usage``) from a raw asyncio HTTP client (cheap, so that it
takes little of the CPU the front needs), and records: ``tokens`` (the sum of ``usage.completion_tokens``),
``events`` (SSE ``data:`` events), ``wall_s``, ``tok_s``, ``front_cpu_s`` and ``front_us_per_token`` (user + system
CPU of the front process itself, psutil, over the burst; ``front_system_share``: the kernel's part of it, where
the socket writes of the events go), ``workers_us_per_token`` (its prompt worker
processes: templating and tokenization of the burst's prompts), ``engine_tok_s_offered`` (what the synthetic
engine would emit if the front kept up: streams x 1000 / step-ms) and ``idle_front_cpu_share`` (the front's CPU
share of one core with nobody connected, measured before the bursts: the fixed cost every token pays a share of);
each burst is run ``--repeat`` times and the run with the median ``front_us_per_token`` is reported (all runs'
values in ``front_us_per_token_runs``).

The synthetic engine's tokens are the ids of an English sentence (the tiny checkpoint has the real Qwen3.5
tokenizer), repeated, or with ``--random-reply`` ids drawn at random from its vocabulary (what a checkpoint with
random weights, as on the GPU benches, emits: many multi-byte pieces); the reply is thinking-mode text, so the front splits reasoning from content as it does
for the real model.  Not a measure of the service (the engine's work is missing): of the front's part of it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import app  # noqa: E402
import serve_host as S  # noqa: E402  (bench/ is on sys.path: this script's folder)
from serve_http import new_client, random_prompt, stream_chat  # noqa: E402
from qwen_chat.chat_types import ModelInfo  # noqa: E402
from qwen_chat.engine.core.handles import _Finish  # noqa: E402

SENTENCE = ("The quick brown fox jumps over the lazy dog while the committee reviews the quarterly report, "
            "and nobody notices that the coffee machine has been leaking since Tuesday. ")


class _Handle:
    """What ``link`` reads of a request handle: counters, the finish reason, ``close`` (a cancel)."""

    def __init__(self) -> None:
        self.finish_reason = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttft_s = None
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Scheduler:
    on_step = None


class SyntheticEngine:
    """A ``ChatEngine`` for ``serve_engine`` that decodes nothing: every ``step_s`` seconds each running choice
    gets the next id of ``ids`` until it has ``max_new_tokens`` of them (finish "length") or is cancelled."""

    def __init__(self, ids: list[int], step_s: float, checkpoint: Path) -> None:
        self.ids, self.step_s = ids, step_s
        self.info = ModelInfo(name="synthetic", demo=True, context_length=32768)
        self.image_token_budget, self.max_context = 1024, 32768
        self.scheduler = _Scheduler()
        self.loaded = type("Loaded", (), {"checkpoint": str(checkpoint)})()
        self._running: list[list] = []  # [sink, index, handle, budget]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.generated = 0
        threading.Thread(target=self._loop, name="synthetic-steps", daemon=True).start()

    def submit_prepared(self, prompt, settings, cancel, sink) -> list:
        handles = [_Handle() for _ in range(settings.n)]
        with self._lock:
            for index, h in enumerate(handles):
                self._running.append([sink, index, h, int(settings.max_new_tokens)])
        return handles

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self.step_s
            with self._lock:
                still = []
                for entry in self._running:
                    sink, index, h, budget = entry
                    if h.closed:
                        h.finish_reason = "cancelled"
                        sink.put((index, _Finish("cancelled"), None))
                        continue
                    sink.put((index, self.ids[h.completion_tokens % len(self.ids)], None))
                    h.completion_tokens += 1
                    self.generated += 1
                    if h.completion_tokens >= budget:
                        h.finish_reason = "length"
                        sink.put((index, _Finish("length"), None))
                    else:
                        still.append(entry)
                self._running = still
            if self.scheduler.on_step is not None:
                self.scheduler.on_step()
            time.sleep(max(0.0, next_at - time.monotonic()))

    def health(self) -> dict:
        return {"ok": True, "reason": "ready", "mode": "single", "world_size": 1, "active": len(self._running),
                "queued": 0, "self_check": "passed"}

    def stats(self) -> dict:
        return {"queue_depth": 0, "running": len(self._running), "generated_tokens_total": self.generated}

    def memory_report(self) -> dict:
        return {}

    def close(self) -> None:
        self._stop.set()


def _special_ids(folder: Path) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in ("<|endoftext|>", "<|im_end|>", "<think>", "</think>",
                                                     "<tool_call>", "</tool_call>")}
    text = tok.encode(SENTENCE * 4, add_special_tokens=False).ids
    rng = random.Random(0)
    plain = tok.get_vocab_size(with_added_tokens=False)  # ordinary tokens: ids below the added (special) ones
    # a reasoning part, then the answer: the front's reasoning split runs as for the real model
    return {"sentence": text[:40] + [ids["</think>"]] + text[40:],
            "random": [rng.randrange(plain) for _ in range(40)] + [ids["</think>"]]
            + [rng.randrange(plain) for _ in range(4096)], "eos": [ids["<|endoftext|>"], ids["<|im_end|>"]],
            "think": [ids["<think>"], ids["</think>"]], "tool": [ids["<tool_call>"], ids["</tool_call>"]]}


async def _stream(port: int, model: str, tokens: int, seed: int, words: int = 0) -> tuple[int, int]:
    """One streamed request over a raw connection: (completion tokens from usage, SSE data events).  ``words``:
    that many random words (``serve_http.random_prompt``, about one token each) after the short message."""
    text = f"Tell me story number {seed}."
    if words:
        text += " " + random_prompt(words, random.Random(seed))
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}],
                       "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    parts = []
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        parts.append(data)
    writer.close()
    raw = b"".join(parts)
    usage = 0
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json.loads(line[6:]).get("usage", {}).get("completion_tokens", usage)
    if usage == 0:
        raise RuntimeError(f"no usage in the reply: {raw[:300]!r}")
    return usage, raw.count(b"data: ")


def _seconds(pid: int) -> tuple[float, dict]:
    """(monotonic now, ``serve_host.cpu_snapshot`` of the front launched as ``pid``: itself as "front", its
    prompt workers as "other")."""
    return time.monotonic(), S.cpu_snapshot(pid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    ap.add_argument("--step-ms", type=float, default=20.0, help="synthetic decode step period (ms)")
    ap.add_argument("--repeat", type=int, default=3, help="bursts per stream count (the median is reported)")
    ap.add_argument("--stream-interval", type=int, default=1, help="the front's --stream-interval")
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="random words added to each request's message (serve_bench's prompts: 600)")
    ap.add_argument("--random-reply", action="store_true",
                    help="reply with token ids drawn at random from the vocabulary, as a model with random weights "
                         "does (default: an English sentence)")
    ap.add_argument("--lone", type=int, nargs="*", default=[],
                    help="also time lone requests of these many random words (10 each, one at a time, after one "
                         "unmeasured): the front's share of a lone request's time to first token; use a short "
                         "--step-ms, since the synthetic engine's first token waits for its next step")
    ap.add_argument("--cache-dir", default=os.environ.get("QWEN_CHAT_CACHE_DIR") or "~/.cache/qwen_chat")
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args()

    from qwen_chat.engine.checkpoints.tiny import build_tiny_checkpoint
    from qwen_chat.engine.client.engine_hub import link_address
    from qwen_chat.engine.core.link import serve_engine

    folder = build_tiny_checkpoint(Path(args.cache_dir).expanduser())
    ids = _special_ids(folder)
    engine = SyntheticEngine(ids["random" if args.random_reply else "sentence"], args.step_ms / 1000.0, folder)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    port = sock.getsockname()[1]
    link = app.Link(link_address("127.0.0.1"), secrets.token_hex(16))
    address, token = link.address, link.token
    history = tempfile.mkdtemp(prefix="front-bench-")
    os.chdir(REPO)  # the front runs ``-m qwen_chat.front_process`` from the working directory, as app.py starts it
    front = app._spawn_front(sock, link, 1, ["--model", str(folder), "--device", "cpu", "--history-dir", history,
                                             "--port", str(port), "--stream-interval", str(args.stream_interval)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    setup = {"checkpoint": str(folder), "image_token_budget": 1024, "max_context": 32768, "eos_ids": ids["eos"],
             "think_ids": ids["think"], "tool_ids": ids["tool"]}
    done = threading.Event()
    threading.Thread(target=serve_engine, args=(engine, address, token, 0, [0], "127.0.0.1", setup,
                                                lambda: done.is_set() or front.poll() is not None),
                     daemon=True).start()
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while httpx.get(base + "/healthz", timeout=10).status_code != 200:
            if time.monotonic() > deadline or front.poll() is not None:
                raise RuntimeError("the front did not become ready")
            time.sleep(0.5)
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        time.sleep(3)
        t0, before = _seconds(front.pid)
        time.sleep(10)
        t1, after = _seconds(front.pid)
        idle_share = S.cpu_delta(before, after)["front"] / (t1 - t0)
        asyncio.run(_burst(port, model, 4, args.tokens, args.prompt_words))  # warm-up: first requests, prompt workers
        lone = {str(w): _lone_ttft(base, model, w) for w in args.lone}
        results = []
        for n in args.streams:
            runs = []
            for _ in range(args.repeat):
                t0, before = _seconds(front.pid)
                times0 = psutil.Process(front.pid).cpu_times()
                got = asyncio.run(_burst(port, model, n, args.tokens, args.prompt_words))
                times1 = psutil.Process(front.pid).cpu_times()
                t1, after = _seconds(front.pid)
                cpu = S.cpu_delta(before, after)
                tokens, events = sum(g[0] for g in got), sum(g[1] for g in got)
                runs.append({"streams": n, "tokens": tokens, "events": events, "wall_s": round(t1 - t0, 2),
                             "tok_s": round(tokens / (t1 - t0), 1),
                             "engine_tok_s_offered": round(n * 1000 / args.step_ms, 1),
                             "front_cpu_s": round(cpu["front"], 2),
                             "front_us_per_token": round(S.us_per_token(cpu["front"], tokens), 1),
                             "front_system_share": round((times1.system - times0.system) / max(
                                 1e-9, times1.system - times0.system + times1.user - times0.user), 3),
                             "workers_us_per_token": round(S.us_per_token(cpu["other"], tokens), 1)})
            median = sorted(runs, key=lambda r: r["front_us_per_token"])[len(runs) // 2]
            results.append(dict(median, front_us_per_token_runs=[r["front_us_per_token"] for r in runs]))
    finally:
        done.set()
        engine.close()
        front.terminate()
        try:
            front.wait(20)
        except subprocess.TimeoutExpired:
            front.kill()
    report = {"bench": "front_bench", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "tokens_per_request": args.tokens,
              "prompt_words": args.prompt_words, "reply": "random ids" if args.random_reply else "sentence",
              "step_ms": args.step_ms, "stream_interval": args.stream_interval,
              "idle_front_cpu_share": round(idle_share, 4), "lone_ttft_ms": lone, "bursts": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"\nidle front: {100 * idle_share:.1f} % of a core")
    for words, got in lone.items():
        print(f"lone request of {words} words: time to first text {got['median']} ms (median; {got['runs']})")
    print("| streams | tokens | SSE events | tok/s (offered) | front us/token (median; runs) | of it system "
          "| prompt workers us/token |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        runs = ", ".join(str(x) for x in r["front_us_per_token_runs"])
        print(f"| {r['streams']} | {r['tokens']} | {r['events']} | {r['tok_s']:,.0f} ({r['engine_tok_s_offered']:,.0f}) "
              f"| {r['front_us_per_token']} ({runs}) | {100 * r['front_system_share']:.0f} % "
              f"| {r['workers_us_per_token']} |")
    return 0


def _lone_ttft(base: str, model: str, words: int, runs: int = 10) -> dict:
    """Time to the first text of lone requests of ``words`` random words (``serve_http.stream_chat``, as
    serve_bench's lone prompts; one unmeasured first): {"median": ms, "runs": [ms...]}."""
    async def go() -> list:
        async with new_client(1) as client:
            out = []
            for i in range(runs + 1):
                res = await stream_chat(client, base, random_prompt(words, random.Random(1000 + i)), 2, model)
                if res.error or res.ttft_s is None:
                    raise RuntimeError(f"lone request failed: {res.error}")
                out.append(round(res.ttft_s * 1e3, 2))
            return out[1:]
    got = asyncio.run(go())
    return {"median": sorted(got)[len(got) // 2], "runs": got}


async def _burst(port: int, model: str, n: int, tokens: int, words: int) -> list:
    return await asyncio.gather(*[_stream(port, model, tokens, i, words) for i in range(n)])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
