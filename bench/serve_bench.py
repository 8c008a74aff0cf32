"""Service benchmark: Qwen3.5-9B measured only through HTTP, as a user of the OpenAI-compatible API meets it.

Usage (repository root):

    python bench/serve_bench.py                    # GPU host: random full-config checkpoint, ~9 min on one H200
    python bench/serve_bench.py --model PATH       # an existing checkpoint folder instead
    python bench/serve_bench.py --smoke            # CPU: --model tiny, everything scaled down (checks the script)
    python bench/serve_bench.py --skip-cap24 --skip-long   # partial runs (also --skip-followups)
    QWEN_CHAT_QUANTIZE=fp8 python bench/serve_bench.py     # FP8 weights (start.sh reads the variable)
    python bench/serve_bench.py --cap24-only --service-args "--max-batch 16" --out PREFIX   # what-if: the 24 GB
                                                           # phase alone, start.sh given one more flag
    CUDA_VISIBLE_DEVICES=0 python bench/serve_bench.py     # one GPU of a multi-GPU host (start.sh uses every
                                                           # visible GPU; NUM_GPUS=1 works too)
    CUDA_VISIBLE_DEVICES=0,1 python bench/serve_bench.py --data-parallel 2   # two replicas, one GPU each
                                                           # (DATA_PARALLEL=2 for the service; -dp2 results)

It builds (once, cached under ``--ckpt-dir``: ``bench/serve_ckpt.py``) a checkpoint of the published config
``bench/qwen3_5_9b_config.json`` with random bf16 weights, starts the service as the README does
(``bash start.sh --model CKPT``, default flags; ``--port`` only when 7860 is taken) and measures, with streamed
``/v1/chat/completions`` requests (``stream_options.include_usage``; the service's default sampling and thinking
mode; random-word prompts, since the API has no ignore-EOS, so tokens are counted from ``usage``):

- ``startup_s``: seconds from launching start.sh to ``/healthz`` answering 200;
- ``batch1_tok_s``: one stream alone (100-token prompt, 1,024 tokens out), tokens/s after its first token
  (median of 2 runs);
- ``aggregate_tok_s`` / ``ttft_ms_p50`` / ``ttft_ms_p99`` for bursts of 1, 8, 32, 64 and 128 streams sent at
  once (600-token prompts, 256 tokens out): total completion tokens / wall time of the burst (tokens/s), and
  time to the first chunk carrying ``content`` or ``reasoning_content`` (ms, streams that finished; a refused
  stream, HTTP 429, is counted in ``detail.bursts``);
- ``prompt_ttft_ms``: TTFT p50/p99 (ms) of 1k, 8k, 32k and 128k-token prompts (1,000 / 8,000 / 32,000 / 128,000
  ``usage.prompt_tokens``, word counts calibrated through ``usage``; 3 / 3 / 2 / 1 repeats), one at a time;
  null when the service refuses the prompt (its message is in ``detail.prompts``);
- ``host_cpu_us_per_token``: {"front": us, "engine": us}: CPU time (user + system, psutil) of the service's
  processes over the 128-stream burst (should it generate no token, the largest one that did:
  ``detail.host_cpu.streams``; ``--smoke`` too runs 128 streams, 4 tokens each) / its completion
  tokens, microseconds per token; "front" is the web front process (``python -m qwen_chat.front_process``:
  uvicorn, Gradio, the API), "engine" every ``app.py`` process (rank 0's is replica 0's engine; with several
  ranks or replicas every rank's app.py counts here) (``serve_host.py``: the processes are start.sh's and all its
  descendants, sampled right before and after the burst); the CPU seconds, per role and burst, are in
  ``detail.host_cpu`` and ``detail.bursts[N].host_cpu_s``;
- ``gpu_busy_share``: {"32": 0-1, "128": 0-1}: during the 32- and 128-stream bursts, the mean of nvidia-smi's
  ``utilization.gpu`` / 100 (``-lms 100`` in a background process, samples inside the burst's window, the
  service's GPUs averaged).  nvidia-smi counts a sample period as busy when a kernel was running at all, so this
  is an upper bound of the GPU's busy share; null in ``--smoke`` and without nvidia-smi;
- ``noisy_neighbour``: {"max_gap_ms", "status", "big_request_s", "streams"}, after the bursts: 32 streams (the
  burst prompts, 256 tokens out) all streaming, then one request whose single user message is 16 MB of words
  (16 * 2**20 characters, ``max_tokens`` 16): its HTTP status and seconds to its answer, and the longest time
  between two consecutive text chunks of any stream among the gaps overlapping [send, answer] (ms)
  (``serve_noisy.py``; body size, baseline gap and the streams' summary in ``detail.noisy_neighbour``;
  ``--smoke``: 8 streams, 32 tokens, 2 MB);
- ``followup_ttft_ms``: TTFT p50 (ms) of a conversation's next turn (a 20-token message) after an 8k and a 30k
  history, keyed "8k" / "30k", each with "cached" (the conversation cache holds the first turn) and "uncached"
  (one word changed at the start: everything prefilled) (``serve_followup.py``; 3 repeats each);
- ``first_use_ttft_ms`` / ``steady_ttft_ms``: TTFT (ms) of one request of each kind, keyed "1k", "8k" (prompts of
  that many tokens), "image" (a photo, ``tests/fixtures/images/chelsea.png``, and a short question), "burst8"
  (the median of 8 streams sent at once, 600-token prompts): first right after ``/healthz`` turns 200 (before
  anything else is sent), then again after the other phases (``serve_firstuse.request_kinds``);
- ``shared_system_prompt``: {"ttft_ms", "cached_tokens"}: new conversations of different users that start with
  the same 4k-token system prompt and their own 20-token question, after a first one: TTFT p50 (ms) and the
  smallest ``cached_tokens`` (``serve_firstuse.shared_system_prompt``; a changed system prompt's TTFT for
  comparison in ``detail.shared_system_prompt``);
- ``startup_warm_s``: seconds to ``/healthz`` 200 when the service is started again right after the main phases
  (whatever it keeps on disk between starts is there; ``--skip-restart`` skips it);
- ``startup_phases_s``: {"first" | "restart": seconds of each start-up phase and the Triton kernels compiled,
  from the service log (``serve_proc.startup_phases``)};
- ``cap24``: the service restarted with its CUDA allocator capped at 22.5 GiB by a ``sitecustomize.py`` on
  PYTHONPATH (``torch.cuda.set_per_process_memory_fraction``; no flag changed): whether it started, aggregate
  tok/s + TTFT at 8 and 32 streams, and ``long_context``: 32 prompts of 32k tokens at once, how many the KV
  cache holds by arithmetic and how many ran at once (``serve_capacity.py``);
- ``peak_gpu_memory_gib``: the largest nvidia-smi used memory sampled during the run (GiB, all GPUs summed);
  ``/metrics``' ``qwen_chat_gpu_memory_bytes`` is kept per phase in ``detail``.

Writes ``bench/results/<date>-<gpu>-serve.{json,png,log}`` (the log is the service's output; ``--out PREFIX``
overrides the prefix, else ``--smoke`` writes ``<date>-cpu-serve-smoke.*``; copies go to ``$OUT`` when set),
saves the JSON after every phase, prints a table last and a time-stamped progress line per phase on stderr.
The service is always stopped (its whole process group), on errors, Ctrl-C and SIGTERM too.  ``--smoke`` hides
the GPUs from the service (``CUDA_VISIBLE_DEVICES=""``), so start.sh runs ``app.py --device cpu``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_host as S  # noqa: E402
import serve_http as H  # noqa: E402
import serve_report as R  # noqa: E402
from serve_capacity import capped_service  # noqa: E402
from serve_firstuse import request_kinds, shared_system_prompt  # noqa: E402
from serve_followup import followups  # noqa: E402
from serve_noisy import noisy_neighbour  # noqa: E402
from serve_ckpt import DEFAULT_CKPT_DIR  # noqa: E402
from serve_proc import (Service, free_port, kernel_lines, port_is_free, server_versions,  # noqa: E402
                        startup_phases)

ROOT = Path(__file__).resolve().parents[1]
FULL = dict(calib_words=(200, 4000), warmup_new=32, batch1_prompt=100, batch1_new=1024, batch1_runs=2,
            burst_prompt=600, burst_new=256, prompt_new=8,
            prompts={"1k": 1000, "8k": 8000, "32k": 32000, "128k": 128000},
            followups={"8k": 8000, "30k": 30000}, followup_reply=32, followup_new=20, followup_repeats=3,
            repeats={"1k": 3, "8k": 3, "32k": 2, "128k": 1}, startup_timeout_s=420, budget_s=540,
            cap_long=dict(tokens=32000, streams=32, new_tokens=16),
            kinds=dict(sizes={"1k": 1000, "8k": 8000}, new_tokens=8),
            shared=dict(system_tokens=4000, question_tokens=20, users=3, new_tokens=4),
            noisy=dict(streams=32, new_tokens=256, body_chars=16 * 2 ** 20, big_max_tokens=16))
SMOKE = dict(calib_words=(20, 200), warmup_new=4, batch1_prompt=20, batch1_new=24, batch1_runs=1,
             burst_prompt=40, burst_new=4, prompt_new=2,
             prompts={"1k": 60, "8k": 120, "32k": 240, "128k": 40000},
             followups={"8k": 120, "30k": 240}, followup_reply=4, followup_new=10, followup_repeats=2,
             repeats={"1k": 2, "8k": 2, "32k": 1, "128k": 1}, startup_timeout_s=300, budget_s=0,
             cap_long=dict(tokens=240, streams=4, new_tokens=2),
             kinds=dict(sizes={"1k": 60, "8k": 120}, new_tokens=2),
             shared=dict(system_tokens=200, question_tokens=10, users=2, new_tokens=2),
             noisy=dict(streams=8, new_tokens=32, body_chars=2 * 2 ** 20, big_max_tokens=16))
T0 = time.monotonic()


def progress(msg: str) -> None:
    """One time-stamped progress line on stderr (wall clock and seconds since the start)."""
    print(f"[{dt.datetime.now():%H:%M:%S} +{time.monotonic() - T0:5.0f}s] serve_bench: {msg}", file=sys.stderr,
          flush=True)


def with_ext(prefix: Path, ext: str) -> Path:
    """``prefix`` + ``ext`` (a dot inside the prefix's name is kept, unlike ``Path.with_suffix``)."""
    return Path(str(prefix) + ext)


def gpu_label() -> tuple[str, int]:
    """(name for the result files: nvidia-smi's first GPU name with dashes, "xN" for N > 1 GPUs, or "cpu";
    number of GPUs)."""
    names = H.nvidia_smi("name", H.visible_gpus())
    if not names:
        return "cpu", 0
    return names[0].replace(" ", "-") + (f"x{len(names)}" if len(names) > 1 else ""), len(names)


def build_checkpoint(ckpt_dir: Path) -> tuple[Path, dict]:
    """The random full-config checkpoint (``bench/serve_ckpt.py`` in its own process, so this one never holds
    GPU memory).  Returns (folder, build info).  Raises RuntimeError with the builder's last lines."""
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("serve_ckpt.py")), "--ckpt-dir",
                          str(ckpt_dir), "--json"], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError("checkpoint build failed: " + " | ".join((out.stderr or out.stdout).splitlines()[-3:]))
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return Path(info["folder"]), info


class Bench:
    """The run's measurements, saved to JSON after every phase (a cut-short run still leaves its file)."""

    def __init__(self, args, sizes: dict, prefix: Path, gpu: str, gpus: int, argv: list[str]):
        self.args, self.P, self.prefix, self.gpu = args, sizes, prefix, gpu
        self.rng = random.Random(20261201)
        self.batch1 = None
        self.bursts: dict = {}
        self.prompts: dict = {}
        self.cap24: dict = {"started": False, "error": "not run"}
        self.startup_s = None
        self.gpus = gpus
        # --smoke runs on the CPU even on a GPU host: start.sh then counts no GPU and runs app.py --device cpu.
        self.env = {"CUDA_VISIBLE_DEVICES": ""} if args.smoke else {}
        if args.data_parallel > 1:  # replicas over the visible GPUs (on CPU: that many CPU ranks)
            self.env["DATA_PARALLEL"] = str(args.data_parallel)
            if args.smoke:
                self.env["NUM_CPU_RANKS"] = str(args.data_parallel)
        self.sampler = None  # started with the first service (the checkpoint build is not the service's memory)
        self.calib = (0.0, 1.0)
        self.context = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"), "gpu": gpu, "gpu_count": gpus,
                        "command": " ".join(["python", "bench/serve_bench.py", *argv]), "smoke": bool(args.smoke),
                        "data_parallel": args.data_parallel,
                        "versions": None, "peak_gpu_memory_gib": None, "models": None, "service_command": None,
                        "checkpoint": None, "sizes": sizes, "errors": [],
                        "host_cpu_us_per_token": None, "gpu_busy_share": {k: None for k in R.BUSY_CONCURRENCY},
                        "noisy_neighbour": None, "first_use_ttft_ms": None, "steady_ttft_ms": None,
                        "shared_system_prompt": None, "startup_warm_s": None,
                        "sampling": "the service's defaults (model-card preset of thinking mode), max_tokens set",
                        "detail": {"calibration": None, "batch1": [], "bursts": {}, "prompts": {}, "phases": {}}}
        # what start.sh got besides the flags (DATA_PARALLEL..., and QWEN_CHAT_QUANTIZE passed through from here)
        self.context["service_env"] = {**self.env, **({"QWEN_CHAT_QUANTIZE": os.environ["QWEN_CHAT_QUANTIZE"]}
                                                      if os.environ.get("QWEN_CHAT_QUANTIZE") else {})}
        self.service_args = shlex.split(args.service_args)
        self.context["service_args"] = self.service_args
        self.detail = self.context["detail"]
        self.services: list[Service] = []

    def words(self, tokens: int) -> int:
        return H.words_for(tokens, *self.calib)

    def prompt(self, tokens: int) -> str:
        return H.random_prompt(self.words(tokens), self.rng)

    def phase_memory(self, name: str, url: str) -> None:
        self.detail["phases"][name] = {"nvidia_smi_peak_gib": self.sampler.mark() if self.sampler else None,
                                       "metrics_gpu_gib": H.metrics_gpu_gib(url),
                                       "t_s": round(time.monotonic() - T0, 1)}

    def doc(self) -> dict:
        if self.sampler:
            self.context["peak_gpu_memory_gib"] = self.sampler.peak_gib
        return R.result_doc(batch1=self.batch1, bursts=self.bursts, prompts=self.prompts, cap24=self.cap24,
                            startup_s=self.startup_s, context=self.context)

    def save(self) -> dict:
        doc = self.doc()
        path = with_ext(self.prefix, ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return doc

    def left_s(self) -> float:
        budget = self.args.budget_s if self.args.budget_s is not None else self.P["budget_s"]
        return float("inf") if not budget else budget - (time.monotonic() - T0)

    # --- phases -----------------------------------------------------------------------------------------------
    def calibrate(self, url: str, model: str) -> None:
        samples = []
        for n in self.P["calib_words"]:
            r = H.one(url, H.random_prompt(n, self.rng), 1, model)
            if r.prompt_tokens is None:
                raise RuntimeError(f"calibration request failed: {r.error}")
            samples.append((n, r.prompt_tokens))
        self.calib = H.fit_tokens_per_word(samples)
        self.detail["calibration"] = {"samples_words_tokens": samples, "overhead_tokens": self.calib[0],
                                      "tokens_per_word": self.calib[1]}
        progress(f"calibrated: prompt tokens = {self.calib[0]:.1f} + {self.calib[1]:.4f} x words")

    def run_batch1(self, url: str, model: str) -> None:
        rates = []
        for _ in range(self.P["batch1_runs"]):
            r = H.one(url, self.prompt(self.P["batch1_prompt"]), self.P["batch1_new"], model)
            self.detail["batch1"].append(H.result_dict(r))
            if r.decode_tok_s is not None:
                rates.append(r.decode_tok_s)
            progress(f"batch 1: {r.completion_tokens} tokens, {r.decode_tok_s or 0:.1f} tok/s after the first"
                     + (f" ({r.error})" if r.error else ""))
        self.batch1 = statistics.median(rates) if rates else None

    def run_burst(self, url: str, model: str, streams: int, into: dict, label: str,
                  svc: Optional[Service] = None) -> None:
        """One burst of ``streams`` streams; with ``svc`` also the CPU seconds of its processes over the burst
        (``host_cpu_s`` / ``host_cpu_us_per_token``) and, with GPUs, nvidia-smi's busy share (``gpu_busy_share``)."""
        prompts = [self.prompt(self.P["burst_prompt"]) for _ in range(streams)]
        gpu = S.GpuBusySampler(ids=H.visible_gpus()).start() if svc is not None and self.gpus else None
        before = S.cpu_snapshot(svc.proc.pid) if svc is not None else None
        t0 = time.perf_counter()
        s = H.burst(url, prompts, self.P["burst_new"], model)
        t1 = time.perf_counter()
        if svc is not None:
            cpu = S.cpu_delta(before, S.cpu_snapshot(svc.proc.pid))
            s["host_cpu_s"] = {k: round(v, 4) for k, v in cpu.items()}
            s["host_cpu_us_per_token"] = {k: S.us_per_token(cpu[k], s["completion_tokens"]) for k in ("front", "engine")}
        if gpu is not None:
            gpu.stop()
            s["gpu_busy_share"] = gpu.share(t0, t1)
        self.phase_memory(f"{label}{streams}", url)
        s.update(self.detail["phases"][f"{label}{streams}"])
        into[str(streams)] = s
        progress(f"{label}{streams} streams: {s['ok']}/{streams} ok ({s['refused']} refused), "
                 f"{s['aggregate_tok_s'] or 0:.1f} tok/s, TTFT p50 {s['ttft_ms_p50'] or 0:.0f} ms"
                 + "".join(f", {k} {v:.0f} us CPU/token" for k, v in (s.get("host_cpu_us_per_token") or {}).items()
                           if v is not None)
                 + (f", GPU busy {s['gpu_busy_share']:.2f}" if s.get("gpu_busy_share") is not None else "")
                 + (f"; first error: {s['error'][:120]}" if s["error"] else ""))

    def run_prompts(self, url: str, model: str, svc: Service) -> None:
        for size, target in self.P["prompts"].items():
            entry = {"target_tokens": target, "words": self.words(target), "ttft_ms": [], "prompt_tokens": [],
                     "error": None}
            self.detail["prompts"][size] = entry
            if self.args.skip_long and size in ("32k", "128k"):
                entry["error"] = "skipped (--skip-long)"
            for _ in range(0 if entry["error"] else self.P["repeats"][size]):
                r = H.one(url, self.prompt(target), self.P["prompt_new"], model)
                if not r.ok or r.ttft_s is None:
                    entry["error"] = r.error or "no text chunk came back"
                    if not svc.alive():
                        entry["error"] += f" (the service exited: {svc.error or svc.proc.returncode})"
                    break
                entry["ttft_ms"].append(r.ttft_s * 1e3)
                entry["prompt_tokens"].append(r.prompt_tokens)
            ok = entry["ttft_ms"] and entry["error"] is None
            self.prompts[size] = {"p50": H.percentile(entry["ttft_ms"], 50),
                                  "p99": H.percentile(entry["ttft_ms"], 99)} if ok else None
            self.phase_memory(f"prompt_{size}", url)
            progress(f"prompt {size} ({(entry['prompt_tokens'] or ['?'])[0]} tokens): "
                     + (f"TTFT p50 {self.prompts[size]['p50']:.0f} ms" if ok else f"null: {entry['error'][:160]}"))
            self.save()

    def host_measures(self) -> None:
        """The published ``host_cpu_us_per_token`` (the largest burst with CPU time and tokens) and
        ``gpu_busy_share`` from the bursts' summaries."""
        for c in sorted(self.bursts, key=int, reverse=True):
            b = self.bursts[c]
            per = b.get("host_cpu_us_per_token") or {}
            if per.get("front") is not None and per.get("engine") is not None:
                self.context["host_cpu_us_per_token"] = {k: round(v, 2) for k, v in per.items()}
                self.detail["host_cpu"] = {"streams": int(c), "completion_tokens": b["completion_tokens"],
                                           "wall_s": b["wall_s"], "cpu_s": b["host_cpu_s"],
                                           "roles": "front: python -m qwen_chat.front_process; engine: every "
                                                    "app.py process; other: bash / the DeepSpeed launcher"}
                break
        self.context["gpu_busy_share"] = {k: (self.bursts.get(k) or {}).get("gpu_busy_share")
                                          for k in R.BUSY_CONCURRENCY}

    def run_noisy(self, url: str, model: str) -> None:
        N = self.P["noisy"]
        progress(f"noisy neighbour: {N['streams']} streams, then one {N['body_chars'] / 2 ** 20:.0f} MB request")
        prompts = [self.prompt(self.P["burst_prompt"]) for _ in range(N["streams"])]
        summary, detail = noisy_neighbour(url, prompts, N["new_tokens"], model, body_chars=N["body_chars"],
                                          big_max_tokens=N["big_max_tokens"], rng=self.rng)
        self.context["noisy_neighbour"] = summary
        self.detail["noisy_neighbour"] = detail
        progress(f"noisy neighbour: HTTP {summary['status']} after {summary['big_request_s']:.2f} s "
                 f"({detail['big_request_error'] or 'ok'})"[:200] + f"; longest chunk gap {summary['max_gap_ms']} ms "
                 f"(baseline {detail['baseline_max_gap_ms']} ms; {detail['streaming_when_sent']} streaming at the send)")
        self.save()

    def run_followups(self, url: str, model: str) -> None:
        P = self.P
        res, detail = followups(url, model, self.prompt, P["followups"], repeats=P["followup_repeats"],
                                reply_tokens=P["followup_reply"], new_tokens=P["followup_new"])
        self.context["followup_ttft_ms"] = res
        self.detail["followups"] = detail
        for label, v in res.items():
            progress(f"follow-up after {label}: " + (f"cached {v['cached']:.0f} ms, uncached {v['uncached']:.0f} ms"
                                                    if v else f"null: {detail[label]['error']}"))
        self.save()

    def run_kinds(self, url: str, model: str, key: str) -> None:
        """``first_use_ttft_ms`` or ``steady_ttft_ms`` (``key``): one request of each kind."""
        K = self.P["kinds"]
        res, detail = request_kinds(url, model, self.prompt, sizes=K["sizes"], burst_prompt=self.P["burst_prompt"],
                                    new_tokens=K["new_tokens"])
        self.context[key] = res
        self.detail[key] = detail
        progress(f"{key}: " + ", ".join(f"{k} {_ms(v)}" for k, v in res.items()))
        self.save()

    def run_shared_system(self, url: str, model: str) -> None:
        S_ = self.P["shared"]
        res, detail = shared_system_prompt(url, model, self.prompt, system_tokens=S_["system_tokens"],
                                           question_tokens=S_["question_tokens"], users=S_["users"],
                                           new_tokens=S_["new_tokens"])
        self.context["shared_system_prompt"] = res
        self.detail["shared_system_prompt"] = detail
        progress("shared system prompt: " + (f"TTFT p50 {_ms(res['ttft_ms'])}, cached_tokens {res['cached_tokens']} "
                                             f"(first user {_ms(detail['first'])}, changed prompt "
                                             f"{_ms(H.percentile(detail['changed'], 50))})"
                                             if res else f"null: {detail['error']}"))
        self.save()

    def restart_warm(self, svc: Service) -> None:
        """``startup_warm_s``: the same service started again right after it stopped."""
        again = Service(svc.args, svc.port, svc.log, self.env)
        self.services.append(again)
        progress("restarting the service (warm start-up)")
        if again.start(self.P["startup_timeout_s"]):
            self.context["startup_warm_s"] = again.startup_s
            self.context.setdefault("startup_phases_s", {})["restart"] = startup_phases(again.log_text())
            progress(f"/healthz 200 after {again.startup_s:.1f} s (warm)")
        else:
            self.context["errors"].append(f"warm restart failed: {again.error}")
        again.stop()
        self.save()

    def service_argv(self, model_arg: str, port: int) -> list[str]:
        """start.sh's arguments for every service of the run: the model, ``--port`` when not 7860, and
        ``--service-args``."""
        return ["--model", model_arg] + (["--port", str(port)] if port != 7860 else []) + self.service_args

    def main_service(self, model_arg: str, port: int, log: Path) -> bool:
        svc = Service(self.service_argv(model_arg, port), port, log, self.env)
        self.context["service_command"] = svc.command
        self.services.append(svc)
        progress(f"starting the service: {svc.command}")
        if self.gpus and self.sampler is None:
            self.sampler = H.GpuMemorySampler(ids=H.visible_gpus()).start()
        if not svc.start(self.P["startup_timeout_s"]):
            self.context["errors"].append(f"service did not start: {svc.error}")
            progress(f"the service did not start: {svc.error}")
            return False
        self.startup_s = svc.startup_s
        url = svc.base_url
        progress(f"/healthz 200 after {svc.startup_s:.1f} s")
        self.context["kernels"] = kernel_lines(svc.log_text())
        phases = self.context.setdefault("startup_phases_s", {})["first"] = startup_phases(svc.log_text())
        progress("start-up phases (s): " + ", ".join(f"{k} {v}" for k, v in phases.items()))
        self.context["models"] = httpx.get(url + "/v1/models", timeout=30).json()
        self.context["healthz"] = httpx.get(url + "/healthz", timeout=30).json()
        model = self.context["models"]["data"][0]["id"]
        progress("first use of each kind of request")
        self.run_kinds(url, model, "first_use_ttft_ms")   # before anything else reaches the service
        self.phase_memory("after_startup", url)
        self.calibrate(url, model)
        progress("warm-up stream")
        H.one(url, self.prompt(self.P["burst_prompt"]), self.P["warmup_new"], model)
        progress("batch-1 decode")
        self.run_batch1(url, model)
        self.phase_memory("batch1", url)
        self.save()
        for streams in R.CONCURRENCY:
            self.run_burst(url, model, streams, self.bursts, "", svc)
            self.detail["bursts"][str(streams)] = self.bursts[str(streams)]
            self.host_measures()
            self.save()
        self.run_noisy(url, model)
        if not self.args.skip_followups:
            progress("follow-up TTFT, cached and uncached")
            self.run_followups(url, model)
        progress("shared system prompt")
        self.run_shared_system(url, model)
        progress("prompt TTFT, one prompt at a time")
        self.run_prompts(url, model, svc)
        progress("steady TTFT of each kind of request")
        self.run_kinds(url, model, "steady_ttft_ms")
        svc.stop()
        if not self.args.skip_restart:
            self.restart_warm(svc)
        return True

    def cap_service(self, model_arg: str, port: int, log: Path) -> None:
        """The service restarted under the 24 GB cap: bursts and the long-context phase (``serve_capacity``)."""
        capped_service(self, model_arg, port, log, progress)


def _ms(v) -> str:
    return "null" if v is None else f"{v:.0f} ms"


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="existing checkpoint folder (or hub id, or 'tiny') instead of the random one")
    ap.add_argument("--ckpt-dir", type=Path, default=DEFAULT_CKPT_DIR, help="cache folder of the random checkpoint")
    ap.add_argument("--smoke", action="store_true", help="--model tiny on CPU, everything scaled down")
    ap.add_argument("--out", type=Path, help="results prefix (default bench/results/<date>-<gpu>-serve)")
    ap.add_argument("--port", type=int, help="service port (default 7860, or a free one when it is taken)")
    ap.add_argument("--data-parallel", type=int, default=1, metavar="N",
                    help="run the service with DATA_PARALLEL=N (N replicas over the visible GPUs; --smoke: N CPU "
                         "ranks); results get a -dpN suffix")
    ap.add_argument("--skip-cap24", action="store_true", help="skip the restart under the 24 GB cap")
    ap.add_argument("--cap24-only", action="store_true", help="only the 24 GB phase (no uncapped service first)")
    ap.add_argument("--service-args", default="", metavar="ARGS",
                    help="extra start.sh arguments for every service started, e.g. '--max-batch 16' (the default "
                         "flags are what a user gets; this is for what-if runs, recorded in the JSON)")
    ap.add_argument("--skip-long", action="store_true", help="skip the 32k and 128k-token prompts")
    ap.add_argument("--skip-followups", action="store_true", help="skip the follow-up (conversation cache) phase")
    ap.add_argument("--skip-restart", action="store_true", help="skip the warm restart (startup_warm_s)")
    ap.add_argument("--budget-s", type=float, help="skip the 24 GB run when fewer seconds are left than its "
                                                   "start-up needs (default 540 on a GPU host; 0: no budget)")
    args = ap.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    gpu, gpus = ("cpu", 0) if args.smoke else gpu_label()
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    if args.data_parallel < 1:
        ap.error("--data-parallel must be >= 1")
    dp = f"-dp{args.data_parallel}" if args.data_parallel > 1 else ""
    dp += f"-{os.environ['QWEN_CHAT_QUANTIZE']}" if os.environ.get("QWEN_CHAT_QUANTIZE") else ""
    prefix = args.out or ROOT / "bench" / "results" / (f"{date}-{gpu}-serve{dp}" + ("-smoke" if args.smoke else ""))
    log = with_ext(prefix, ".log")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    bench = Bench(args, sizes, prefix, gpu, gpus, argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    code = 0
    try:
        bench.context["versions"] = server_versions(bench.env)
        if args.model or args.smoke:
            model_arg = args.model or "tiny"
            bench.context["checkpoint"] = {"model": model_arg}
        else:
            progress(f"random full-config checkpoint under {args.ckpt_dir} (built once, then reused)")
            folder, info = build_checkpoint(args.ckpt_dir)
            model_arg = str(folder)
            bench.context["checkpoint"] = info
            progress(f"checkpoint {folder} ({'reused' if info.get('reused') else 'built'})")
        port = args.port or (7860 if port_is_free(7860) else free_port())
        if args.cap24_only:
            bench.cap_service(model_arg, port, log)
        elif not bench.main_service(model_arg, port, log):
            code = 1
        elif args.skip_cap24:
            bench.cap24 = {"started": False, "error": "skipped (--skip-cap24)"}
        elif bench.left_s() < (bench.startup_s or 0) + 60:
            bench.cap24 = {"started": False, "error": f"skipped: {bench.left_s():.0f} s of the budget left"}
            progress(bench.cap24["error"])
        else:
            bench.cap_service(model_arg, port if port_is_free(port) else free_port(), log)
    except KeyboardInterrupt as exc:
        bench.context["errors"].append(f"interrupted ({str(exc) or 'Ctrl-C'})")
        progress("interrupted: stopping the service")
        code = 130
    except Exception as exc:  # noqa: BLE001 - recorded, the service is stopped below
        bench.context["errors"].append(f"{type(exc).__name__}: {exc}"[:600])
        progress(f"failed: {type(exc).__name__}: {exc}")
        code = 1
    finally:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the stop
        for svc in bench.services:
            svc.stop()
        signal.signal(signal.SIGINT, old)
        if bench.sampler:
            bench.sampler.stop()
    doc = bench.save()
    png = with_ext(prefix, ".png")
    try:
        bench.context["plot"] = R.plot(doc, png)
        doc = bench.save()
    except Exception as exc:  # noqa: BLE001 - the JSON is what matters
        progress(f"plot failed: {exc!r}")
    if os.environ.get("OUT"):
        for path in (with_ext(prefix, ".json"), png, log):
            dest = Path(os.environ["OUT"]) / path.name
            if path.exists() and path.resolve() != dest.resolve():
                shutil.copy2(path, dest)
    progress(f"wrote {with_ext(prefix, '.json')}, {png.name}, {log.name}")
    print("\n" + R.table(doc), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
