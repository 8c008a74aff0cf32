"""Helpers of ``bench/gpu_verify.sh`` (the one-call GPU verification on a 2-GPU host; see that script).

    python bench/gpu_verify.py collect --dir DIR --out FILE.json [--command ...]
        # one JSON (and a printed table) from DIR: pytest.log, <mode>.log + <mode>.out[.partial].json for each
        # mode found (single, tp, and the eager fall-backs single_eager, tp_eager), versions (env.json)

Per mode: GPU memory per rank after loading (the bootstrap's rank line), peak per rank (driver / stop line),
load + shard seconds, graphs captured and their seconds, start-up seconds (launch to the engine's self-check,
i.e. when the service would open its port), the runner implementation and Gated DeltaNet kernel lines, TTFT
and decode tok/s of each scenario step, greedy agreement with the single-GPU tokens.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharding_bench import _MEM, _STOP  # noqa: E402  (rank and stop lines)

MODES = ("single", "tp", "single_eager", "tp_eager")
_TS = re.compile(r"^\[rank (\d+)\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
_CAPTURED = re.compile(r"captured (\d+) decode (?:and prefill )?graphs in ([\d.]+) s")


def _epoch(stamp: str) -> float:
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1000


def parse_log(text: str) -> dict:
    info: dict = {"ranks": {}}
    lines = text.splitlines()
    launch = float(lines[0].split()[2]) if lines and lines[0].startswith("# launch ") else None
    info["timed_out"] = "# TIMEOUT" in text
    for m in _MEM.finditer(text):
        info["ranks"][int(m.group(1))] = {
            "device": m.group(3), "params_held_M": float(m.group(4)),
            "gpu_gib_after_load": float(m.group(5) or "nan"), "gpu_gib_peak_after_load": float(m.group(6) or "nan"),
            "load_s": float(m.group(7)), "shard_s": float(m.group(8))}
    for m in _STOP.finditer(text):
        info["ranks"].setdefault(int(m.group(1)), {})["gpu_gib_peak_at_exit"] = float(m.group(3))
    kernels, errors = {}, []
    for line in lines:
        m = _TS.match(line)
        if not m:
            if "Error" in line or "Traceback" in line:
                errors.append(line[:400])
            continue
        rank, stamp, msg = int(m.group(1)), m.group(2), m.group(3)
        c = _CAPTURED.search(msg)
        if c:
            r = info["ranks"].setdefault(rank, {})
            r["graphs_captured"], r["capture_s"] = int(c.group(1)), float(c.group(2))
        if msg.startswith("engine self-check passed") and launch is not None and "startup_s" not in info:
            info["startup_s"] = round(_epoch(stamp) - launch, 1)
        if msg.startswith("runner implementation:"):
            info["runner_impl"] = msg.split(":", 1)[1].strip()
        if msg.startswith("kernel: "):
            op, _, impl = msg[8:].partition(" -> ")
            kernels[op] = impl
        if msg.startswith("sharding: "):
            info["sharding"] = msg[10:]
        if msg.startswith("self-check passed on"):
            info["rank_self_check"] = msg
        if " ERROR " in line or "Error" in msg:
            errors.append(line[:400])
    if kernels:
        info["kernels"] = kernels
    if errors:
        info["errors"] = errors[-15:]
    return info


def collect(d: Path) -> dict:
    modes, ref = {}, None
    for mode in MODES:
        log, out = d / f"{mode}.log", d / f"{mode}.out.json"
        if not log.exists():
            continue
        text = log.read_text(errors="replace")
        entry = parse_log(text)
        entry["completed"] = out.exists()
        if not out.exists() and (d / f"{mode}.out.partial.json").exists():
            out = d / f"{mode}.out.partial.json"
        if out.exists():
            res = json.loads(out.read_text())
            if "rank0_gpu_peak_bytes" in res:
                entry["ranks"].setdefault(0, {})["gpu_gib_peak_at_exit"] = round(res["rank0_gpu_peak_bytes"] / 2**30, 3)
            entry["health"] = res.get("health")
            entry["steps"] = {k: {kk: v.get(kk) for kk in ("prompt_tokens", "ttft_s", "decode_tok_s", "finish")}
                              for k, v in res["steps"].items()}
            entry["tokens"] = {k: v.get("tokens") for k, v in res["steps"].items()}
            entry["profiles"] = {k: {kk: v.get(kk) for kk in ("decode_tok_s", "kernel_ms_per_token",
                                                            "kernels_per_token", "top_kernels")}
                                 for k, v in res["steps"].items() if "top_kernels" in v}
        if not entry["completed"]:
            entry["log_tail"] = text.splitlines()[-40:]
        modes[mode] = entry
    for name in ("single", "single_eager"):  # reference tokens: the single-GPU run (compiled if it finished)
        if ref is None and modes.get(name, {}).get("tokens"):
            ref, ref_name = modes[name]["tokens"], name
    for mode, entry in modes.items():
        if ref is None or mode.startswith("single") or "tokens" not in entry:
            continue
        agree = {}
        for name, toks in entry["tokens"].items():
            base = ref.get(name)
            if not base or not toks:
                continue
            k, n = 0, min(len(toks), len(base))
            while k < n and toks[k] == base[k]:
                k += 1
            agree[name] = {"first_mismatch": None if k == n else k, "compared": n}
        entry["greedy_agreement_with_single"] = {"reference": ref_name, **agree}
    result = {"date": dt.date.today().isoformat(), "modes": modes}
    for f, key in ((d / "env.json", "env"),):
        if f.exists():
            result[key] = json.loads(f.read_text())
    pl = d / "pytest.log"
    if pl.exists():
        text = pl.read_text(errors="replace")
        tail = [ln for ln in text.splitlines() if ln.strip()][-30:]
        summary = next((ln for ln in reversed(tail) if re.search(r"\d+ (passed|failed|error|skipped)", ln)), None)
        if summary is None and "rc=124" in text:  # killed by its time box: pytest -q printed only its progress
            progress = text.split("pytest tests/gpu: rc=")[0].strip()
            summary = (f"time box ran out (rc=124) after {progress.count('.')} passed, {progress.count('F')} failed, "
                       f"{progress.count('E')} errors; progress {progress!r}")
        result["pytest_tests_gpu"] = {"summary": summary, "timed_out": "# TIMEOUT" in text or "rc=124" in text,
                                      "tail": tail}
    return result


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def table(res: dict) -> str:
    rows = ["| mode | done | GiB/rank after load | peak GiB/rank | load+shard s | graphs (capture s) | start-up s "
            "| TTFT rocket/image/4k s | decode b1 tok/s (rocket, haiku, image) | greedy first mismatch vs single |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, e in res["modes"].items():
        r = e.get("ranks", {})
        rk = [r[k] for k in sorted(r)]
        mem = " / ".join(_f(x.get("gpu_gib_after_load")) for x in rk) or "-"
        peak = " / ".join(_f(x.get("gpu_gib_peak_at_exit")) for x in rk) or "-"
        ls = " / ".join(f"{_f(x.get('load_s'), '{:.1f}')}+{_f(x.get('shard_s'), '{:.1f}')}" for x in rk) or "-"
        cap = " / ".join(f"{x.get('graphs_captured', '-')} ({_f(x.get('capture_s'), '{:.1f}')})" for x in rk) or "-"
        st = e.get("steps", {})
        ttft = " / ".join(_f(st.get(k, {}).get("ttft_s")) for k in ("text_rocket", "image_cat", "text_4k"))
        dec = ", ".join(_f(st.get(k, {}).get("decode_tok_s"), "{:.1f}") for k in ("text_rocket", "text_haiku", "image_cat"))
        ag = e.get("greedy_agreement_with_single")
        ags = "ref" if mode.startswith("single") else (
            "-" if not ag else ", ".join(f"{k}:{'all' if v['first_mismatch'] is None else v['first_mismatch']}/{v['compared']}"
                                         for k, v in ag.items() if k != "reference"))
        rows.append(f"| {mode} | {'yes' if e.get('completed') else 'NO'} | {mem} | {peak} | {ls} | {cap} | "
                    f"{_f(e.get('startup_s'), '{:.1f}')} | {ttft} | {dec} | {ags} |")
    lines = ["\n".join(rows)]
    sp, tp = res["modes"].get("single", {}).get("steps"), res["modes"].get("tp", {}).get("steps")
    if sp and tp:
        ks = [k for k in ("text_rocket", "text_haiku", "image_cat") if sp.get(k, {}).get("decode_tok_s") and tp.get(k, {}).get("decode_tok_s")]
        if ks:
            ratio = sum(tp[k]["decode_tok_s"] / sp[k]["decode_tok_s"] for k in ks) / len(ks)
            lines.append(f"TP=2 / single decode speed (mean over {len(ks)} prompts): {ratio:.2f}x (target >= 1.5x)")
    for mode, e in res["modes"].items():
        lines.append(f"{mode}: runner {e.get('runner_impl', '-')}; kernels {e.get('kernels', '-')}")
        for name, pr in (e.get("profiles") or {}).items():
            lines.append(f"{mode} {name} (profiled, rank 0): {_f(pr.get('decode_tok_s'), '{:.1f}')} tok/s, "
                         f"{_f(pr.get('kernel_ms_per_token'))} ms of kernels in "
                         f"{_f(pr.get('kernels_per_token'), '{:.0f}')} kernels per token; top: " + "; ".join(
                             f"{k['name'][:48]} {k['ms_per_token']:.3f} ms x{k['calls_per_token']:.0f}"
                             for k in pr["top_kernels"][:8]))
        if e.get("errors"):
            lines.append(f"{mode} errors (last): " + " || ".join(e["errors"][-3:]))
    py = res.get("pytest_tests_gpu")
    lines.append(f"pytest tests/gpu: {py['summary'] if py else 'not run'}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--dir", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--command", default="")
    args = p.parse_args()
    res = collect(args.dir)
    res["command"] = args.command
    args.out.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
