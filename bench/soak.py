"""Soak benchmark: many short requests against the tiny service, watching what grows (memory, file descriptors or threads that leak).

Usage (repository root; loopback only, CPU is enough):

    python bench/soak.py                         # 20,000 requests, 8 at a time, about 15 minutes on 2 cores
    python bench/soak.py --requests 2000 --out bench/results/soak-short   # a shorter run

It starts the service as the README does (``bash start.sh --model tiny``, a free port, its own history folder)
and sends ``--requests`` short requests through the OpenAI API, ``--concurrency`` at a time, cycling through
four kinds: a plain completion, a streamed one read to its end, a streamed one dropped after its first chunk,
and one with a photo (``tests/fixtures/images/chelsea.png`` as a data URL); each asks for 4 tokens.  Every
``--sample-every`` requests it records, for every process of the service (``serve_host.service_processes``):
``RssAnon`` (kB, from ``/proc/PID/status``: the process's own heap, not shared libraries or files), open file
descriptors and threads; and the p50 latency (ms, send to last byte) of those requests.  Written to
``<out>.json``: the samples, the request outcomes by kind and status, and a summary: RssAnon growth per 1,000
requests after the warm-up (the first ``--warmup`` requests) per process role, the fd and thread counts at the
start and the end, and the p50 latency of the first and the last window.  A table is printed last.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_host as S  # noqa: E402
from serve_proc import Service, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "tests" / "fixtures" / "images" / "chelsea.png"
KINDS = ("plain", "stream", "dropped", "image")


def rss_anon_kb(pid: int) -> int | None:
    """``RssAnon`` of ``pid`` in kB (None when the process is gone or the field is missing)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def sample(pid: int) -> dict:
    """Per service process: role, RssAnon kB, open fds, threads."""
    out = []
    for role, procs in S.service_processes(pid).items():
        for p in procs:
            try:
                out.append({"pid": p.pid, "role": role, "rss_anon_kb": rss_anon_kb(p.pid), "fds": p.num_fds(),
                            "threads": p.num_threads()})
            except psutil.Error:
                continue
    return {"processes": out}


def body_of(kind: str, i: int, image_url: str) -> dict:
    content: object = f"Soak request {i}: say one word."
    if kind == "image":
        content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "One word?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "chat_template_kwargs": {"enable_thinking": False}}
    if kind in ("stream", "dropped"):
        body["stream"] = True
    return body


async def one(client: httpx.AsyncClient, url: str, kind: str, i: int, image_url: str) -> tuple[str, int, float]:
    """(kind, HTTP status (0: no answer), seconds)."""
    t0 = time.perf_counter()
    try:
        if kind in ("stream", "dropped"):
            async with client.stream("POST", url + "/v1/chat/completions", json=body_of(kind, i, image_url)) as r:
                async for _ in r.aiter_lines():
                    if kind == "dropped":
                        break  # the client goes away after the first line
                return kind, r.status_code, time.perf_counter() - t0
        r = await client.post(url + "/v1/chat/completions", json=body_of(kind, i, image_url))
        return kind, r.status_code, time.perf_counter() - t0
    except httpx.HTTPError:
        return kind, 0, time.perf_counter() - t0


async def run(url: str, pid: int, args) -> dict:
    image_url = "data:image/png;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
    samples, outcomes, window = [], {}, []
    samples.append({"requests": 0, "t_s": 0.0, **sample(pid)})
    t_start = time.monotonic()
    done = 0
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency + 2)) as client:
        next_i = 0
        while done < args.requests:
            n = min(args.sample_every, args.requests - done)
            sem = asyncio.Semaphore(args.concurrency)

            async def guarded(i: int):
                async with sem:
                    return await one(client, url, KINDS[i % len(KINDS)], i, image_url)

            results = await asyncio.gather(*(guarded(next_i + k) for k in range(n)))
            next_i += n
            done += n
            for kind, status, seconds in results:
                key = f"{kind} {status}"
                outcomes[key] = outcomes.get(key, 0) + 1
            window = [s for k, st, s in results if st == 200]
            await asyncio.sleep(1.0)  # let dropped streams end in the engine before the sample
            samples.append({"requests": done, "t_s": round(time.monotonic() - t_start, 1),
                            "p50_ms": round(statistics.median(window) * 1e3, 1) if window else None, **sample(pid)})
            last = samples[-1]
            rss = {r: sum(p["rss_anon_kb"] or 0 for p in last["processes"] if p["role"] == r) for r in S.ROLES}
            print(f"[soak] {done} requests, {last['t_s']} s: p50 {last['p50_ms']} ms, RssAnon kB {rss}",
                  file=sys.stderr, flush=True)
    return {"samples": samples, "outcomes": outcomes}


def summary(doc: dict, warmup: int) -> dict:
    """RssAnon growth per 1,000 requests after the warm-up, per role (kB), fds and threads first/last, p50
    first/last window."""
    samples = doc["samples"]
    after = [s for s in samples if s["requests"] >= warmup] or samples[-1:]
    first, last = after[0], samples[-1]

    def by_role(s, key):
        return {r: sum(p[key] or 0 for p in s["processes"] if p["role"] == r) for r in S.ROLES}

    span = max(1, last["requests"] - first["requests"])
    growth = {r: round((by_role(last, "rss_anon_kb")[r] - by_role(first, "rss_anon_kb")[r]) * 1000 / span, 1)
              for r in S.ROLES}
    windows = [s["p50_ms"] for s in samples if s.get("p50_ms") is not None]
    return {"rss_anon_growth_kb_per_1000": growth, "fds_first_last": [by_role(first, "fds"), by_role(last, "fds")],
            "threads_first_last": [by_role(first, "threads"), by_role(last, "threads")],
            "p50_ms_first_last": [windows[1] if len(windows) > 1 else None, windows[-1] if windows else None],
            "failed": sum(v for k, v in doc["outcomes"].items() if not k.endswith(" 200"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-every", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=2000, help="requests before RssAnon growth is counted")
    ap.add_argument("--out", type=Path, help="results prefix (default bench/results/<date>-cpu-soak)")
    args = ap.parse_args(argv)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    prefix = args.out or ROOT / "bench" / "results" / f"{date}-cpu-soak"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="qwen-chat-soak-") as history:
        svc = Service(["--model", "tiny", "--port", str(port), "--history-dir", history], port,
                      Path(str(prefix) + ".log"), {"CUDA_VISIBLE_DEVICES": ""})
        if not svc.start(600):
            print(f"soak: the service did not start: {svc.error}", file=sys.stderr)
            return 1
        try:
            doc = asyncio.run(run(svc.base_url, svc.proc.pid, args))
        finally:
            svc.stop()
    doc.update(date=date, command=" ".join(["python", "bench/soak.py", *(argv or sys.argv[1:])]),
               requests=args.requests, concurrency=args.concurrency, kinds=KINDS,
               summary=summary(doc, args.warmup))
    Path(str(prefix) + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    s = doc["summary"]
    rows = [("requests, failed", f"{args.requests}, {s['failed']}"),
            ("RssAnon growth per 1,000 requests after warm-up (kB) front / engine",
             f"{s['rss_anon_growth_kb_per_1000']['front']} / {s['rss_anon_growth_kb_per_1000']['engine']}"),
            ("open fds first -> last (front, engine)",
             f"{s['fds_first_last'][0]['front']} -> {s['fds_first_last'][1]['front']}, "
             f"{s['fds_first_last'][0]['engine']} -> {s['fds_first_last'][1]['engine']}"),
            ("threads first -> last (front, engine)",
             f"{s['threads_first_last'][0]['front']} -> {s['threads_first_last'][1]['front']}, "
             f"{s['threads_first_last'][0]['engine']} -> {s['threads_first_last'][1]['engine']}"),
            ("p50 latency first / last window (ms)", f"{s['p50_ms_first_last'][0]} / {s['p50_ms_first_last'][1]}")]
    width = max(len(a) for a, _ in rows)
    print("\n" + "\n".join(f"{a:<{width}}  {b}" for a, b in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
