"""bf16, FP8 and 4-bit weights served one after the other on the same GPU, summed up under one ``quantized`` key
(and FP8 weights with the FP8 KV cache on a simulated 24 GB card: ``fp8_kv_cap24``).

Usage (repository root, GPU host):

    python bench/serve_quantized.py --out PREFIX [--kinds bf16,fp8,int4,fp8_kv_cap24] [-- serve_bench.py flags...]
    python bench/serve_quantized.py --merge bf16=A.json fp8=B.json int4=C.json --out PREFIX

The first form runs ``bench/serve_bench.py`` once per kind with ``QWEN_CHAT_QUANTIZE`` set to ``none``, ``fp8``
or ``int4`` (the service's ``--quantize``; same checkpoint, default flags otherwise) and the phases that give
the throughput only (``--skip-cap24 --skip-long --skip-followups --skip-restart``; more flags after ``--``),
results ``PREFIX-<kind>.{json,log,png}``.  The second form merges serve results already measured (e.g. each
kind run as its own GPU call, ``NAME=serve-int4 QWEN_CHAT_QUANTIZE=int4 bash bench/serve_gpu.sh OUT ...``).
Both write ``PREFIX.json``: ``{"quantized": {kind: {"batch1_tok_s": x, "aggregate_tok_s": {"64": x, "128": x},
"weights": what /v1/models said}}, "ratios": {kind: {"batch1": x / bf16, "64": ..., "128": ...}}, "runs": {kind:
file}}`` (a kind whose run failed has nulls), and print a table.  Kind ``fp8_kv_cap24`` (not in the default
``--kinds``) runs ``serve_bench.py --cap24-only`` with ``--quantize fp8 --kv-cache-dtype fp8`` (the 24 GB cap of
its ``cap24`` phase) and is summed up as ``{"kv_tokens": the plan's KV tokens (/v1/models), "aggregate_tok_s":
{"32": x}}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("bf16", "fp8", "int4")
#: The FP8-weights-and-KV run under the 24 GB cap (serve_bench.py's ``cap24`` phase alone).
CAP24_KIND = "fp8_kv_cap24"
CAP24_ARGS = ("--cap24-only", "--skip-followups", "--skip-restart", "--service-args", "--kv-cache-dtype fp8")


def with_kv_flag(extra: list[str]) -> list[str]:
    """``extra`` serve_bench.py flags for the ``fp8_kv_cap24`` run: a ``--service-args`` of theirs (which would
    replace ``CAP24_ARGS``' own) gets ``--kv-cache-dtype fp8`` added."""
    out = list(extra)
    for i, flag in enumerate(out[:-1]):
        if flag == "--service-args":
            out[i + 1] = f"{out[i + 1]} --kv-cache-dtype fp8"
    return out
#: serve_bench.py flags of a throughput-only pass.
THROUGHPUT_ONLY = ("--skip-cap24", "--skip-long", "--skip-followups", "--skip-restart")
STREAMS = ("64", "128")


def cap24_summary(doc: Optional[dict]) -> dict:
    """The ``fp8_kv_cap24`` entry of one ``--cap24-only`` serve result (None: a failed run)."""
    cap = (doc or {}).get("cap24") or {}
    engine = (cap.get("long_context") or {}).get("engine") or {}
    return {"kv_tokens": engine.get("kv_tokens"), "aggregate_tok_s": {"32": (cap.get("aggregate_tok_s") or {}).get("32")}}


def summary(doc: Optional[dict]) -> dict:
    """The ``quantized`` entry of one serve result (``serve_report.result_doc``; None: a failed run)."""
    doc = doc or {}
    agg = doc.get("aggregate_tok_s") or {}
    try:
        weights = doc["models"]["data"][0]["engine"]["weights"]
    except (KeyError, IndexError, TypeError):
        weights = None
    return {"batch1_tok_s": doc.get("batch1_tok_s"), "aggregate_tok_s": {k: agg.get(k) for k in STREAMS},
            "weights": weights}


def merged(docs: dict[str, Optional[dict]], runs: dict[str, str]) -> dict:
    """``{"quantized", "ratios", "runs"}`` of the serve results ``docs`` (kind -> document or None)."""
    quantized = {kind: cap24_summary(doc) if kind == CAP24_KIND else summary(doc) for kind, doc in docs.items()}
    base = quantized.get("bf16")

    def ratio(x, y):
        return None if x is None or not y else round(x / y, 3)

    ratios = {}
    for kind, q in quantized.items():
        if kind in ("bf16", CAP24_KIND) or base is None:
            continue
        ratios[kind] = {"batch1": ratio(q["batch1_tok_s"], base["batch1_tok_s"]),
                        **{k: ratio(q["aggregate_tok_s"][k], base["aggregate_tok_s"][k]) for k in STREAMS}}
    return {"quantized": quantized, "ratios": ratios, "runs": runs}


def table(doc: dict) -> str:
    lines = [f"{'kind':6s} {'batch-1 tok/s':>14s} {'64 streams':>11s} {'128 streams':>12s}  ratios to bf16"]
    for kind, q in doc["quantized"].items():
        if kind == CAP24_KIND:
            lines.append(f"{kind}: {q['kv_tokens']} KV tokens, {q['aggregate_tok_s']['32']} tok/s at 32 streams "
                         "(24 GB cap)")
            continue
        agg = q["aggregate_tok_s"]
        vals = [q["batch1_tok_s"], agg["64"], agg["128"]]
        lines.append(f"{kind:6s} " + " ".join(f"{'-' if v is None else f'{v:.1f}':>{w}s}"
                                              for v, w in zip(vals, (14, 11, 12)))
                     + f"  {doc['ratios'].get(kind, '')}")
    return "\n".join(lines)


def _load(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results prefix")
    ap.add_argument("--kinds", default=",".join(KINDS), help="which weights to serve, in order (bf16, fp8, int4)")
    ap.add_argument("--merge", nargs="+", metavar="KIND=JSON", help="merge serve results instead of running")
    args = ap.parse_args(argv)
    docs, runs = {}, {}
    if args.merge:
        for item in args.merge:
            kind, _, path = item.partition("=")
            if kind not in KINDS + (CAP24_KIND,) or not path:
                ap.error(f"--merge takes KIND=JSON with KIND one of {', '.join(KINDS + (CAP24_KIND,))}: {item!r}")
            docs[kind], runs[kind] = _load(Path(path)), path
    else:
        for kind in args.kinds.split(","):
            if kind not in KINDS + (CAP24_KIND,):
                ap.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS + (CAP24_KIND,))}")
            prefix = Path(f"{args.out}-{kind}")
            env = dict(os.environ, QWEN_CHAT_QUANTIZE={"bf16": "none", CAP24_KIND: "fp8"}.get(kind, kind))
            phases, more = (CAP24_ARGS, with_kv_flag(extra)) if kind == CAP24_KIND else (THROUGHPUT_ONLY, extra)
            cmd = [sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--out", str(prefix), *phases, *more]
            print(f"== {kind}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, cwd=ROOT, env=env, check=False)
            docs[kind], runs[kind] = _load(prefix.with_name(prefix.name + ".json")), f"{prefix}.json"
    doc = merged(docs, runs)
    out = Path(f"{args.out}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"wrote {out}")
    return 0 if all(d is not None for d in docs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
