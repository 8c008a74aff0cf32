"""The pure pieces of the service benchmark (bench/serve_*.py): statistics, prompt calibration, SSE timing,
the result document's key layout, the table and plot, the start-up error line, the allocator-capping
sitecustomize, the host measures (CPU per token by process role, GPU busy share) and the noisy-neighbour gap.  The end-to-end check is ``python bench/serve_bench.py --smoke`` (minutes; not run here)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import serve_http as H  # noqa: E402
import serve_proc as P  # noqa: E402
import serve_report as R  # noqa: E402


def test_percentile_interpolates_like_numpy():
    assert H.percentile([], 50) is None
    assert H.percentile([7.0], 99) == 7.0
    assert H.percentile([4, 1, 3, 2], 50) == 2.5
    assert H.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert H.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert H.percentile([1.0, None, 3.0], 50) == 2.0


@pytest.mark.parametrize("overhead,per_word", [(17, 1.0), (25, 1.3)])
def test_calibration_hits_the_target_token_count(overhead, per_word):
    def count(words):  # what usage.prompt_tokens would say for a prompt of that many words
        return round(overhead + per_word * words)

    samples = [(n, count(n)) for n in (200, 4000)]
    a, b = H.fit_tokens_per_word(samples)
    for target in (1000, 8000, 32000, 128000):
        assert abs(count(H.words_for(target, a, b)) - target) <= 2
    assert H.words_for(5, 17, 1.0) == 1  # never an empty prompt
    assert H.fit_tokens_per_word([(100, 120)]) == (20.0, 1.0)
    with pytest.raises(ValueError):
        H.fit_tokens_per_word([])


def test_random_prompts_are_words_of_the_list_and_differ():
    rng = random.Random(0)
    a, b = H.random_prompt(50, rng), H.random_prompt(50, rng)
    assert len(a.split()) == 50 and set(a.split()) <= set(H.WORDS) and a != b
    assert len(set(H.WORDS)) == len(H.WORDS) > 300


def _sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def _chunk(**delta):
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _run_stream(handler) -> H.StreamResult:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await H.stream_chat(client, "http://x", "hello world", 8, model="m")
    return asyncio.run(go())


def test_stream_chat_times_text_chunks_and_reads_usage():
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        body = _sse(_chunk(role="assistant", content=""), _chunk(reasoning_content="think"), _chunk(content="hi"),
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                    {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 8}}, "[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    r = _run_stream(handler)
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert seen["max_tokens"] == 8 and seen["model"] == "m" and "ignore_eos" not in seen
    assert r.ok and r.status == 200 and r.error is None
    assert r.text_chunks == 2  # the role chunk's empty content is not a token
    assert 0 <= r.ttft_s <= r.t_last <= r.end_s
    assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (12, 8, "length")
    d = H.result_dict(r)
    assert d["decode_tok_s"] == r.decode_tok_s and json.dumps(d)


def test_stream_chat_reports_refusals_and_error_events():
    refused = _run_stream(lambda request: httpx.Response(
        429, json={"error": {"message": "the service is busy", "type": "busy"}}))
    assert refused.status == 429 and not refused.ok and refused.error == "HTTP 429: the service is busy"
    cut = _run_stream(lambda request: httpx.Response(200, content=_sse(
        _chunk(content="a"), {"error": {"message": "the reply was cut off"}}, "[DONE]")))
    assert not cut.ok and cut.error == "the reply was cut off" and cut.ttft_s is not None
    no_done = _run_stream(lambda request: httpx.Response(200, content=_sse(_chunk(content="a"))))
    assert not no_done.ok and "DONE" in no_done.error


def test_summarize_counts_tokens_over_the_wall_time_of_the_burst():
    ok = [H.StreamResult(status=200, ttft_s=t, t_last=t + 1.0, end_s=t + 1.1, prompt_tokens=600,
                         completion_tokens=256) for t in (0.1, 0.2, 0.3)]
    refused = H.StreamResult(status=429, error="HTTP 429: busy")
    s = H.summarize(ok + [refused], wall_s=2.0)
    assert (s["streams"], s["ok"], s["refused"], s["failed"]) == (4, 3, 1, 1)
    assert s["completion_tokens"] == 768 and s["aggregate_tok_s"] == pytest.approx(384.0)
    assert s["ttft_ms_p50"] == pytest.approx(200.0) and s["ttft_ms_p99"] == pytest.approx(298.0)
    assert s["decode_tok_s_p50"] == pytest.approx(255.0) and s["error"] == "HTTP 429: busy"
    assert H.summarize([refused], 1.0)["aggregate_tok_s"] is None


def _fake_doc(cap_started=True):
    bursts = {str(c): {"aggregate_tok_s": 100.0 * c, "ttft_ms_p50": 40.0 + c, "ttft_ms_p99": 50.0 + c,
                       "ok": c, "streams": c} for c in (1, 8, 32, 64, 128)}
    cap = {"started": cap_started, "bursts": {k: bursts[k] for k in ("8", "32")} if cap_started else {},
           "error": None if cap_started else "exit 78: app.py: cannot start the engine: CUDA out of memory",
           "fraction": 0.16}
    prompts = {"1k": {"p50": 45.0, "p99": 50.0}, "8k": {"p50": 320.0, "p99": 330.0}, "32k": {"p50": 1500.0,
                                                                                              "p99": 1600.0},
               "128k": None}
    context = {"date": "2026-12-01", "gpu": "NVIDIA-H200", "versions": {"torch": "2.13.0"}, "command": "python x",
               "peak_gpu_memory_gib": 30.5, "models": {"data": [{"id": "ckpt"}]},
               "detail": {"bursts": bursts, "prompts": {"128k": {"error": "HTTP 400: context_length_exceeded"}}}}
    return R.result_doc(batch1=210.0, bursts=bursts, prompts=prompts, cap24=cap, startup_s=84.0, context=context)


def test_result_document_has_the_published_keys():
    doc = _fake_doc()
    json.dumps(doc)
    assert list(doc)[:7] == ["batch1_tok_s", "aggregate_tok_s", "ttft_ms_p50", "ttft_ms_p99", "prompt_ttft_ms",
                             "cap24", "startup_s"]
    for key in ("aggregate_tok_s", "ttft_ms_p50", "ttft_ms_p99"):
        assert list(doc[key]) == ["1", "8", "32", "64", "128"]
    assert doc["aggregate_tok_s"]["32"] == 3200.0 and doc["ttft_ms_p99"]["128"] == 178.0
    assert list(doc["prompt_ttft_ms"]) == ["1k", "8k", "32k", "128k"]
    assert doc["prompt_ttft_ms"]["8k"] == {"p50": 320.0, "p99": 330.0} and doc["prompt_ttft_ms"]["128k"] is None
    cap = doc["cap24"]
    assert cap["started"] is True and "bursts" not in cap
    for key in ("aggregate_tok_s", "ttft_ms_p50", "ttft_ms_p99"):
        assert list(cap[key]) == ["8", "32"]
    assert cap["aggregate_tok_s"]["8"] == 800.0 and doc["startup_s"] == 84.0
    for key in ("date", "gpu", "versions", "command", "peak_gpu_memory_gib", "models"):
        assert key in doc
    failed = _fake_doc(cap_started=False)["cap24"]
    assert failed["started"] is False and failed["aggregate_tok_s"] == {"8": None, "32": None}
    assert "out of memory" in failed["error"]


def test_table_and_plot(tmp_path):
    doc = _fake_doc()
    text = R.table(doc)
    assert "batch-1 decode (tok/s)" in text and "210.0" in text and "context_length_exceeded" in text
    assert "128 streams" in text and "24 GB cap,  8 streams" in text
    assert "cannot start the engine" in R.table(_fake_doc(cap_started=False))
    doc8 = _fake_doc()  # the weights row says what /v1/models said of them
    doc8["models"] = {"data": [{"engine": {"weights": {"dtype": "bfloat16", "fp8_modules": 200,
                                                       "fp8_bytes": 6913900544}}}]}
    assert "FP8 for 200 layers (6.44 GiB), bfloat16 for the rest" in R.table(doc8)
    from PIL import Image

    R._plot_pillow(doc, tmp_path / "p.png", "title")
    assert Image.open(tmp_path / "p.png").size == (1100, 440)
    used = R.plot(doc, tmp_path / "q.png")
    assert used in ("matplotlib", "pillow") and (tmp_path / "q.png").stat().st_size > 1000


def test_startup_error_line_prefers_the_services_own_reason():
    log = "INFO loading\nTraceback (most recent call last):\nRuntimeError: CUDA out of memory\n" \
          "app.py: cannot start the engine: rank 0: CUDA out of memory. Tried to allocate 2.00 GiB\nINFO bye\n"
    assert P.startup_error_line(log).startswith("app.py: cannot start the engine: rank 0: CUDA out of memory")
    assert P.startup_error_line("x\nTypeError: bad\nINFO done\n") == "TypeError: bad"
    assert P.startup_error_line("just\nlines\n") == "lines"
    assert P.startup_error_line("") is None


def test_startup_phases_from_the_service_log():
    """The phases of one start as the service logs them (lines of an H200 run, trimmed)."""
    log = textwrap.dedent("""\
        2026-12-04 15:40:22,106 INFO qwen_chat: listening on http://127.0.0.1:7860 (503 'loading' until ready)
        2026-12-04 15:40:41,372 INFO qwen_chat.engine.startup.bootstrap: rank 0: loading /ckpt (single)
        2026-12-04 15:40:46,718 INFO qwen_chat.engine.startup.bootstrap: rank 0/1: device cuda:0, parameters held 9410 M, GPU memory 17.54 GiB allocated, 17.54 GiB peak, load 5.3 s + shard 0.0 s
        2026-12-04 15:41:41,814 INFO qwen_chat.engine.startup.runner_setup: captured 20 decode graphs in 53.0 s: 34 Triton kernels compiled (9.5 s), 0 from cache; 12 torch.compile graphs (23.7 s) (the rest while idle or on first use)
        2026-12-04 15:42:16,960 INFO qwen_chat.engine.startup.runner_setup: captured 54 prefill graphs (9 pieces x buckets [32, 64] tokens), 0.30 GiB, in 35.1 s: 37 Triton kernels compiled (28.6 s), 0 from cache; 0 torch.compile graphs (0.0 s)
        2026-12-04 15:42:20,257 INFO qwen_chat.engine.startup.runner_setup: compiled the sampler in 3.3 s: 0 Triton kernels compiled (0.0 s), 0 from cache; 2 torch.compile graphs (3.2 s)
        2026-12-04 15:43:00,946 INFO qwen_chat.engine.startup.warmup: warmed up the prefill kernels (short, kept and restored, long, burst, photo) in 40.7 s
        2026-12-04 15:43:00,946 INFO qwen_chat.engine.startup.runner_setup: warm-up compilation: 40.7 s: 43 Triton kernels compiled (33.5 s), 0 from cache; 0 torch.compile graphs (0.0 s); slowest Triton kernels to compile since start: k x25 (25.1 s)
        """)
    assert P.startup_phases(log) == {"imports": 19.3, "load": 5.3, "decode_graphs": 53.0, "prefill_graphs": 35.1,
                                     "sampler": 3.3, "warm_up": 40.7, "triton_kernels_compiled": 114,
                                     "triton_compile_s": 71.6}
    assert P.startup_phases("INFO nothing here\n") == {}


def test_the_steps_before_loading_are_read_from_the_line_the_engine_logs():
    """The engine's "before loading the weights" line (``bootstrap.BeforeLoading``) gives ``before_loading``."""
    from qwen_chat.engine.startup.bootstrap import BeforeLoading

    steps = BeforeLoading(6.1)
    steps.parts += [("device", 2.04), ("process groups", 0.0), ("engine modules", 3.2), ("checkpoint", 0.4)]
    line = ("2026-12-04 15:40:41,372 INFO qwen_chat.engine.startup.bootstrap: before loading the weights: "
            + steps.describe())
    assert P.startup_phases(line)["before_loading"] == {"imports": 6.1, "device": 2.0, "process_groups": 0.0,
                                                        "engine_modules": 3.2, "checkpoint": 0.4}
    assert steps.describe().startswith("11.7 s: imports 6.1 s, device 2.0 s")


def test_gpu_memory_sampler_keeps_the_peak_and_phase_peaks():
    values = iter([["1024", "2048"], ["4096", "0"], None] + [["512", "512"]] * 1000)
    s = H.GpuMemorySampler(interval_s=0.001, probe=lambda: next(values))
    s.start()
    while s.peak_gib is None or s.peak_gib < 4.0:
        pass
    s.stop()
    assert s.peak_gib == 4.0 and s.mark() == 4.0 and s.mark() is None


def test_visible_gpus_follow_start_sh():
    assert H.visible_gpus({}) is None
    assert H.visible_gpus({"CUDA_VISIBLE_DEVICES": "1, 0"}) == "1,0"
    assert H.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3", "NUM_GPUS": "1"}) == "2"
    assert H.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None


FAKE_TORCH = '''
import sys
calls = []
class _Dev:
    def __init__(self, i): self.i = i
    def __enter__(self): return self
    def __exit__(self, *a): return False
class _Props:
    total_memory = 144 * 2**30
class cuda:
    queued = []
    @staticmethod
    def is_available(): return True
    @staticmethod
    def device_count(): return 1
    @staticmethod
    def device(i): return _Dev(i)
    @staticmethod
    def _lazy_call(fn): cuda.queued.append(fn)
    @staticmethod
    def set_per_process_memory_fraction(f, d): calls.append((f, d))
    @staticmethod
    def get_device_properties(d): return _Props()
    @staticmethod
    def init():
        for fn in cuda.queued: fn()
'''


@pytest.mark.parametrize("argv0,local_rank,capped", [("app.py", None, True), ("launcher.py", None, False),
                                                      ("launcher.py", "0", True)])
def test_sitecustomize_caps_only_the_service_processes(tmp_path, argv0, local_rank, capped):
    site, fake, other = tmp_path / "site", tmp_path / "fake", tmp_path / "other"
    P.cap_sitecustomize(site)
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(FAKE_TORCH)
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = '1'\n")
    (tmp_path / argv0).write_text(textwrap.dedent("""
        import os, torch
        print(len(torch.cuda.queued), os.environ.get('CHAINED'))
        torch.cuda.init()
        print(torch.calls)
    """))
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env.update({"PYTHONPATH": os.pathsep.join(map(str, (site, fake, other))), P.FRACTION_ENV: "0.15625"})
    if local_rank is not None:
        env["LOCAL_RANK"] = local_rank
    out = subprocess.run([sys.executable, argv0], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    queued, calls = out.stdout.splitlines()
    assert queued == ("1 1" if capped else "0 1")  # the next sitecustomize on the path ran too
    assert calls == ("[(0.15625, 0)]" if capped else "[]")
    assert ("capped at 22.50 GiB" in out.stderr) is capped


def test_long_context_phase_reads_metrics_and_reports_the_fit(monkeypatch):
    """The 24 GB phase's long-context check (bench/serve_capacity.py) against a fake service: the KV fit by
    arithmetic (KV tokens // (prompt + new tokens), capped by the state slots), the most sequences running in a
    sample of /metrics, the preemptions over the phase, and its row in the table."""
    import serve_capacity as C

    page = ('# HELP x\nqwen_chat_running_sequences{replica="0"} 3.0\nqwen_chat_running_sequences{replica="1"} 2.0\n'
            'qwen_chat_engine_preemptions_total 7.0\nqwen_chat_engine_preemptions_created 1.7e9\n')
    assert sum(H.metric_values(page, "qwen_chat_running_sequences")) == 5.0
    assert sum(H.metric_values(page, "qwen_chat_engine_preemptions_total")) == 7.0
    assert sum(H.metric_values(page, "qwen_chat_missing")) == 0.0
    polls = iter(range(1, 1000))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "engine": {"kv_tokens": 100_000, "state_slots": 2}}]})
        n = next(polls)
        return httpx.Response(200, text=f"qwen_chat_running_sequences {min(n, 4)}\nqwen_chat_engine_preemptions_total {n}\n")

    transport = httpx.MockTransport(handler)
    real_client = httpx.Client
    monkeypatch.setattr(httpx, "get", lambda url, **kw: real_client(transport=transport).get(url))
    monkeypatch.setattr(httpx, "Client", lambda **kw: real_client(transport=transport))
    done = {"ok": 3, "streams": 3}

    def fake_burst(url, prompts, new_tokens, model):
        time.sleep(1.2)  # several /metrics samples
        assert len(prompts) == 3 and new_tokens == 16 and model == "m"
        return done

    monkeypatch.setattr(C.H, "burst", fake_burst)
    lc = C.long_context("http://svc", "m", lambda n: "w " * n, tokens=32000, streams=3, new_tokens=16)
    assert lc["kv_fit"] == 2  # 100,000 // 32,016 = 3 sequences of KV, but 2 state slots
    assert lc["max_running"] == 4 and lc["preemptions"] >= 3 and lc["burst"] is done
    doc = _fake_doc()
    doc["cap24"]["long_context"] = lc
    assert "24 GB cap, 3 x 32000 tokens: fit by KV / ran at once / ok  2 / 4 / 3" in R.table(doc)


def test_noisy_neighbour_max_gap_counts_only_gaps_overlapping_the_big_request():
    """bench/serve_noisy.py: the longest gap between consecutive text chunks of one stream, among the gaps that
    overlap [send, answer]; the others are the baseline."""
    import serve_noisy as N

    arrivals = [[0.0, 0.05, 0.10, 0.15],        # ends before the big request is sent: baseline only
                [0.0, 0.9, 1.6, 1.62, 2.5],      # 0.9 -> 1.6 overlaps (0.7 s); 1.62 -> 2.5 starts after the answer
                [1.05, 1.10, 1.95, 1.96],        # 1.10 -> 1.95 (0.85 s) spans the answer at 1.5
                []]                              # a refused stream: no chunks
    assert N.max_gap_ms(arrivals, 1.0, 1.5) == pytest.approx(850.0)
    assert N.max_gap_ms(arrivals, 1.0, 1.5, overlapping=False) == pytest.approx(900.0)  # 0.0 -> 0.9
    assert N.max_gap_ms([[0.2, 0.1, 0.4]], 0.0, 1.0) == pytest.approx(200.0)  # arrival order does not matter
    assert N.max_gap_ms(arrivals, 5.0, 6.0) is None and N.max_gap_ms([], 0, 1) is None
    text = N.big_text(2 * 2 ** 20, random.Random(1))
    assert len(text) == 2 * 2 ** 20 and set(text.split()[:-1]) <= set(H.WORDS)


def test_host_cpu_per_token_and_gpu_busy_share():
    """bench/serve_host.py: processes sorted by what they run, CPU seconds per role between two snapshots,
    microseconds per generated token, and the busy share of nvidia-smi samples inside a window."""
    import serve_host as S

    assert S.role(["/venv/bin/python", "-m", "qwen_chat.front_process", "--model", "tiny"]) == "front"
    assert S.role(["python", "app.py", "--device", "cpu", "--model", "tiny"]) == "engine"
    assert S.role(["/usr/bin/python3", "-u", "/srv/app.py", "--local_rank=1"]) == "engine"
    assert S.role(["/usr/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x", "app.py"]) == "other"
    assert S.role(["/usr/bin/python3", "/usr/local/bin/deepspeed", "--num_gpus", "2", "app.py"]) == "other"
    assert S.role(["bash", "start.sh", "--model", "tiny"]) == "other"
    before = {"front": {10: 1.0}, "engine": {11: 5.0, 12: 2.0}, "other": {}}
    after = {"front": {10: 1.5}, "engine": {11: 7.5, 12: 2.5, 13: 0.25}, "other": {}}  # 13: a rank started since
    delta = S.cpu_delta(before, after)
    assert delta == {"front": pytest.approx(0.5), "engine": pytest.approx(3.25), "other": 0}
    # 0.5 CPU seconds over 32,768 tokens (128 streams x 256): about 15.3 us per token
    assert S.us_per_token(delta["front"], 128 * 256) == pytest.approx(15.2588, rel=1e-4)
    assert S.us_per_token(1.0, 0) is None and S.us_per_token(None, 10) is None
    me = S.cpu_snapshot(os.getpid())  # this test process runs pytest, no app.py: "other"
    assert os.getpid() in me["other"] and me["other"][os.getpid()] > 0
    samples = [(0.9, 100.0), (1.0, 50.0), (1.1, 100.0), (1.2, 0.0), (2.5, 100.0)]
    assert S.busy_share(samples, 1.0, 2.0) == pytest.approx(0.5)
    assert S.busy_share(samples, 3.0, 4.0) is None


def test_host_measures_in_the_document_and_table():
    doc = _fake_doc()
    doc.update(host_cpu_us_per_token={"front": 12.5, "engine": 40.25}, gpu_busy_share={"32": 0.81, "128": 0.97},
               noisy_neighbour={"max_gap_ms": 812.0, "status": 400, "big_request_s": 3.25, "streams": 32})
    doc["detail"].update(host_cpu={"streams": 128}, noisy_neighbour={"body_chars": 16 * 2 ** 20,
                                                                      "baseline_max_gap_ms": 45.0})
    text = R.table(doc)
    assert "host CPU/token, 128 streams: front / engine (us)" in text and "12.5 / 40.2" in text
    assert "GPU busy share, 32 / 128 streams (upper bound)" in text and "0.81 / 0.97" in text
    assert "noisy neighbour 16 MB, 32 streams" in text and "400, 3.25 s, 812 ms (baseline 45 ms)" in text
    smoke = _fake_doc()
    smoke.update(host_cpu_us_per_token=None, gpu_busy_share={"32": None, "128": None}, noisy_neighbour=None)
    rows = dict(line.strip().split("  ", 1) for line in R.table(smoke).splitlines() if "  " in line.strip())
    rows = {k: v.strip() for k, v in rows.items()}
    assert rows["GPU busy share, 32 / 128 streams (upper bound)"] == "- / -"
    assert rows["host CPU/token, 128 streams: front / engine (us)"] == "-"
