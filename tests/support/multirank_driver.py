"""Test driver for the multi-rank engine: every rank calls ``bootstrap.start_engine``; rank 0 runs a scenario.

Run under a launcher (or alone for the single-process reference)::

    deepspeed --num_gpus 2 tests/support/multirank_driver.py --scenario S.json --out R.json -- --model tiny ...

Everything after ``--`` is the service's own command line (``ServiceConfig``).  The scenario is a JSON list of
steps executed in order on rank 0 (the web layer is not involved):

- ``{"op": "greedy", "name": N, "text": T, "images": [paths], "max_new_tokens": K}``: greedy token ids
  (temperature 0) of one user turn, recorded under N (K may be below the UI minimum of 64);
- ``{"op": "stop", "name": N, "after": K}``: a long greedy generation cancelled after K streamed updates;
  records the finish reason and the completion tokens;
- ``{"op": "expect_error", "name": N, "text": T, "images": [paths]}``: ``stream_chat`` must raise a
  ``ChatError`` before streaming; records its class and message;
- ``{"op": "profile", "name": N, "text": T, "max_new_tokens": K}``: like ``greedy``, under ``torch.profiler`` on
  rank 0; records the decode rate and the GPU kernels with the most time per generated token (under TP the
  collectives show as NCCL kernels; their time includes waiting for the other ranks);
- ``{"op": "structured", "name": N, "text": T, "schema": {...}, "tools": [ToolSpec fields], "tool_choice": C,
  "max_new_tokens": K}``: a greedy reply through ``stream_chat`` with a JSON schema and/or tools (constrained
  decoding on rank 0); records the answer, the tool calls ([name, arguments]) and the finish reason;
- ``{"op": "idle", "seconds": S}``: rank 0 stays idle (workers wait on the control group);
- ``{"op": "hold"}``: write the results, then keep serving (heartbeats) until killed or SIGTERM.

Results go to ``--out`` (JSON) once the scenario ends (or before ``hold``); rank 0 then closes the engine,
which sends the exit message to the workers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from qwen_chat.chat_types import CancelToken, ChatError, ChatMessage, GenerationSettings, ToolSpec  # noqa: E402
from qwen_chat.config import ServiceConfig  # noqa: E402


def greedy_settings(max_new_tokens: int) -> GenerationSettings:
    return GenerationSettings.preset(False, temperature=0.0, top_k=1, top_p=1.0, presence_penalty=0.0, seed=0,
                                     max_new_tokens=max_new_tokens)


def run_step(engine, step: dict) -> dict:
    op = step["op"]
    msgs = [ChatMessage(role="user", text=step.get("text", "Hello"), images=tuple(step.get("images", ())))]
    if op == "profile":
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            res = run_step(engine, {**step, "op": "greedy"})
        n = max(1, len(res["tokens"]))
        dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        rows = sorted(((dev_t(e), e.count, e.key) for e in prof.key_averages() if dev_t(e) > 0), reverse=True)
        kernels = [r for r in rows if not r[2].startswith(("aten::", "cudaGraph"))]
        return {**res, "tokens_profiled": n, "kernel_ms_per_token": sum(r[0] for r in kernels) / 1e3 / n,
                "kernels_per_token": sum(r[1] for r in kernels) / n,
                "top_kernels": [{"name": k[:110], "ms_per_token": t / 1e3 / n, "calls_per_token": c / n}
                                for t, c, k in kernels[:25]]}
    if op == "greedy":
        settings = greedy_settings(64)
        prompt = engine.prepare(msgs, settings)
        params = replace(engine.sampling_params(settings, prompt), max_new_tokens=int(step.get("max_new_tokens", 64)))
        t0 = time.monotonic()
        handle = engine.scheduler.submit(prompt, params, CancelToken())
        ids = list(handle)
        seconds = time.monotonic() - t0
        ttft = handle.ttft_s
        decode = (len(ids) - 1) / (seconds - ttft) if ttft is not None and len(ids) > 1 and seconds > ttft else None
        return {"tokens": ids, "finish": handle.finish_reason, "prompt_tokens": prompt.num_tokens,
                "ttft_s": ttft, "seconds": seconds, "decode_tok_s": decode}
    if op == "stop":
        cancel = CancelToken()
        n = 0
        last = None
        t0 = time.monotonic()
        for last in engine.stream_chat(msgs, greedy_settings(int(step.get("max_new_tokens", 4096))), cancel):
            n += 1
            if n == int(step.get("after", 3)):
                cancel.cancel()
        return {"finish": last.finish_reason, "completion_tokens": last.completion_tokens,
                "seconds": time.monotonic() - t0}
    if op == "expect_error":
        try:
            stream = engine.stream_chat(msgs, greedy_settings(64), CancelToken())
        except ChatError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"error": None, "finish": [u.finish_reason for u in stream][-1]}
    if op == "structured":
        settings = replace(greedy_settings(int(step.get("max_new_tokens", 64))), json_schema=step.get("schema"),
                           tools=tuple(ToolSpec(**t) for t in step.get("tools", ())),
                           tool_choice=step.get("tool_choice", "auto"))
        last = list(engine.stream_chat(msgs, settings, CancelToken()))[-1]
        return {"answer": last.answer, "finish": last.finish_reason,
                "tool_calls": [[c.name, c.arguments] for c in last.tool_calls]}
    if op == "idle":
        time.sleep(float(step["seconds"]))
        return {"slept": float(step["seconds"])}
    raise ValueError(f"unknown scenario op {op!r}")


def with_gpu_memory(results: dict) -> dict:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        results["rank0_gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        results["rank0_gpu_allocated_bytes"] = torch.cuda.memory_allocated()
    return results


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main() -> int:
    argv = sys.argv[1:]
    own, service = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1)  # appended by the deepspeed launcher
    args, rest = parser.parse_known_args(own)
    service = rest + service
    if args.local_rank >= 0:
        service.append(f"--local_rank={args.local_rank}")
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ServiceConfig.from_argv(service).validate()

    from qwen_chat.engine.startup import bootstrap

    engine = bootstrap.start_engine(cfg)  # worker ranks never return
    results = {"pid": os.getpid(), "info": {"world_size": engine.info.world_size, "mode": engine.info.mode},
               "health": engine.health(), "steps": {}}
    steps = json.loads(args.scenario.read_text())
    if args.only:
        keep = set(args.only.split(","))
        steps = [s for s in steps if s["op"] == "hold" or s.get("name") in keep]
    partial = args.out.with_suffix(".partial.json")  # after every step, for runs cut short (benchmarks)
    for i, step in enumerate(steps):
        if step["op"] == "hold":
            break
        results["steps"][step.get("name", f"{i}:{step['op']}")] = run_step(engine, step)
        write_json(partial, with_gpu_memory(results))
    write_json(args.out, with_gpu_memory(results))
    if steps and steps[-1]["op"] == "hold":
        while True:
            time.sleep(1)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
