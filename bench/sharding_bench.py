"""Sharding benchmark helpers: a random-weight checkpoint of the full Qwen3.5-9B config, and the result table.

Run by ``bench/sharding_gpu.sh`` on a 2-GPU host (see docs/sharding.md, "Measured"):

    python bench/sharding_bench.py checkpoint --processor DIR --out /tmp/ckpt9b
        # random bf16 weights of bench/qwen3_5_9b_config.json, built on cuda:0 and saved in the published layout,
        # plus the processor/tokenizer files copied from DIR (e.g. the tiny model's folder: same tokenizer)
    python bench/sharding_bench.py collect --logs DIR --out FILE.json
        # reads the driver results (<mode>.out.json) and logs (<mode>.log) of each mode and writes one JSON with
        # per-rank GPU memory, load time, TTFT, decode tok/s and greedy agreement with the single-GPU run

The speed and memory of a forward do not depend on the weight values, so random weights give the real costs
(measured-baselines.md does the same).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).with_name("qwen3_5_9b_config.json")
MODES = ("single", "tp", "zero3", "zero3-offload")
# Files of a checkpoint folder that hold weights or the model config: everything else is processor/tokenizer.
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "QWEN_CHAT_DEMO")


def make_checkpoint(processor_dir: Path, out: Path) -> dict:
    """Write a random bf16 checkpoint of the full config to ``out``; returns {"params": int, "seconds": float}."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for qwen_chat
    from qwen_chat.engine.checkpoints.layout import write_model

    t0 = time.monotonic()
    raw = json.loads(CONFIG.read_text())
    config = Qwen3_5Config.from_dict(raw)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda:0"):
        model = Qwen3_5ForConditionalGeneration(config)
    torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    write_model(model, out, seed=0)  # the published layout: 4 shards + index, with an MTP head
    for f in Path(processor_dir).iterdir():
        if f.is_file() and f.name not in _MODEL_FILES and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    del model
    torch.cuda.empty_cache()
    return {"params": n, "seconds": time.monotonic() - t0}


_MEM = re.compile(r"rank (\d+)/(\d+): device (\S+), parameters held ([\d.e+]+) M, (?:GPU memory ([\d.]+) GiB "
                  r"allocated, ([\d.]+) GiB peak|GPU memory n/a \(CPU\)), load ([\d.]+) s \+ shard ([\d.]+) s")
_STOP = re.compile(r"rank (\d+): stopping; GPU memory ([\d.]+) GiB allocated, ([\d.]+) GiB peak")


def collect(logs: Path) -> dict:
    """Summarise each mode found in ``logs`` (``<mode>.out.json`` + ``<mode>.log``)."""
    modes = {}
    ref = None
    for mode in MODES:
        out, log = logs / f"{mode}.out.json", logs / f"{mode}.log"
        entry: dict = {"completed": out.exists()}
        if not out.exists() and (logs / f"{mode}.out.partial.json").exists():
            out = logs / f"{mode}.out.partial.json"  # cut short: the steps that finished
        text = log.read_text(errors="replace") if log.exists() else ""
        ranks = {}
        for m in _MEM.finditer(text):
            ranks[int(m.group(1))] = {"device": m.group(3), "params_held_M": float(m.group(4)),
                                      "gpu_gib_after_load": float(m.group(5) or "nan"),
                                      "gpu_gib_peak_after_load": float(m.group(6) or "nan"),
                                      "load_s": float(m.group(7)), "shard_s": float(m.group(8))}
        for m in _STOP.finditer(text):
            ranks.setdefault(int(m.group(1)), {})["gpu_gib_peak_at_exit"] = float(m.group(3))
        if out.exists():
            res = json.loads(out.read_text())
            if "rank0_gpu_peak_bytes" in res:
                ranks.setdefault(0, {})["gpu_gib_peak_at_exit"] = res["rank0_gpu_peak_bytes"] / 2**30
            entry["steps"] = {k: {kk: v.get(kk) for kk in ("prompt_tokens", "ttft_s", "decode_tok_s", "finish")}
                              for k, v in res["steps"].items()}
            entry["tokens"] = {k: v.get("tokens") for k, v in res["steps"].items()}
            if mode == "single":
                ref = entry["tokens"]
        else:
            entry["log_tail"] = text.splitlines()[-25:]
        entry["ranks"] = ranks
        modes[mode] = entry
    for mode, entry in modes.items():
        if mode == "single" or ref is None or "tokens" not in entry:
            continue
        agree = {}
        for name, toks in entry["tokens"].items():
            base = ref.get(name)
            if base is None or toks is None:
                continue
            k = 0
            while k < min(len(toks), len(base)) and toks[k] == base[k]:
                k += 1
            agree[name] = {"first_mismatch": None if k == min(len(toks), len(base)) else k, "compared": min(len(toks), len(base))}
        entry["greedy_agreement_with_single"] = agree
    return {"date": dt.date.today().isoformat(), "host": "2 x NVIDIA H200", "modes": modes}


def run_bounded(seconds: float, log: Path, cmd: list[str]) -> int:
    """Run ``cmd`` in its own process group with output to ``log``; after ``seconds`` end the whole group
    (launcher and ranks: SIGTERM, then SIGKILL 5 s later).  The log starts with ``# launch <epoch> <cmd>``
    (start-up time is measured from it) and gets ``# TIMEOUT after N s`` when the limit hit.  Returns the exit
    code (negative: signal)."""
    import os
    import signal
    import subprocess

    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write(f"# launch {time.time():.3f} {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(seconds)
        except subprocess.TimeoutExpired:
            print(f"timeout after {seconds:.0f} s: {log.name}", flush=True)
            fh.write(f"# TIMEOUT after {seconds:.0f} s\n")
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    try:  # ranks left behind by a launcher that died first
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    print(f"{log.name}: exit {code} after {time.monotonic() - t0:.0f} s", flush=True)
    return code


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seconds", type=float, required=True)
    r.add_argument("--log", type=Path, required=True)
    r.add_argument("command", nargs=argparse.REMAINDER)
    c = sub.add_parser("checkpoint")
    c.add_argument("--processor", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("collect")
    s.add_argument("--logs", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--command", default="")
    args = p.parse_args()
    if args.cmd == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return run_bounded(args.seconds, args.log, command)
    if args.cmd == "checkpoint":
        print(json.dumps(make_checkpoint(args.processor, args.out)))
        return 0
    summary = collect(args.logs)
    summary["command"] = args.command
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({m: {k: v for k, v in e.items() if k not in ("tokens", "log_tail")} for m, e in summary["modes"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
