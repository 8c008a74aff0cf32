"""fla kernel-config files (``qwen_chat/engine/model/fla_tuning.py``) from the autotuning a GPU run printed.

Run a workload that reaches every fla kernel of the prefill with ``TRITON_PRINT_AUTOTUNING=1`` on the GPU in
question (``bench/burst_probe.py`` does: packed and single-sequence prefills), then turn its log into one
``{kernel}.json`` per kernel in fla's format (``fla.ops.utils.cache``: ``autotune_entries`` keyed by the md5 of
the serialised tuning key, each with the key and the winning config) plus a ``manifest.json`` with the versions
and where the log came from:

    python bench/fla_configs.py LOG --gpu NVIDIA_H200 --fla 0.6.0 --triton 3.6.0
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_ROOT = ROOT / "qwen_chat" / "engine" / "model" / "fla_configs"

_FUNCTION = re.compile(r"^Triton autotuning for function (\w+),")
_KEY = re.compile(r"^with key as (\(.*\)),$")
_BEST = re.compile(r"^best config selected: (.*);$")


def key_hash(key: list) -> str:
    """fla's ``AutotuneKey.key_hash``: md5 of the key as compact JSON with sorted keys."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def parse_config(text: str) -> dict:
    """``"BV: 64, num_warps: 4, num_ctas: 1, num_stages: 2, maxnreg: None"`` -> fla's config dict."""
    fields = {}
    for part in text.split(", "):
        name, value = part.split(": ", 1)
        fields[name] = None if value == "None" else int(value)
    launch = {k: fields.pop(k) for k in ("num_warps", "num_ctas", "num_stages", "maxnreg")}
    return {"kwargs": fields, **launch}


def parse_log(lines) -> dict[str, dict[str, dict]]:
    """kernel -> {hash: {"autotune_key": [...], "config": {...}}} from ``TRITON_PRINT_AUTOTUNING`` output
    (a later result for the same key replaces an earlier one)."""
    out: dict[str, dict[str, dict]] = {}
    kernel, key = None, None
    for line in lines:
        line = line.strip()
        if m := _FUNCTION.match(line):
            kernel, key = m.group(1), None
        elif (m := _KEY.match(line)) and kernel:
            key = list(ast.literal_eval(m.group(1)))
        elif (m := _BEST.match(line)) and kernel and key is not None:
            out.setdefault(kernel, {})[key_hash(key)] = {"autotune_key": key, "config": parse_config(m.group(1))}
            kernel, key = None, None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path, help="a log with TRITON_PRINT_AUTOTUNING=1 output")
    ap.add_argument("--gpu", required=True, help="GPU name as fla spells it (e.g. NVIDIA_H200)")
    ap.add_argument("--fla", required=True, help="fla version the log was made with")
    ap.add_argument("--triton", required=True, help="Triton version the log was made with")
    ap.add_argument("--out-root", type=Path, default=OUT_ROOT)
    args = ap.parse_args(argv)
    kernels = parse_log(args.log.read_text().splitlines())
    if not kernels:
        print(f"no autotuning results in {args.log}", file=sys.stderr)
        return 1
    folder = args.out_root / args.gpu
    folder.mkdir(parents=True, exist_ok=True)
    for kernel, entries in sorted(kernels.items()):
        doc = {"kernel_name": kernel, "triton_version": args.triton, "autotune_entries": entries}
        (folder / f"{kernel}.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{kernel}: {len(entries)} key(s)")
    log = args.log.resolve()
    source = log.relative_to(ROOT) if log.is_relative_to(ROOT) else log
    manifest = {"versions": {"fla": args.fla, "triton": args.triton}, "source": str(source),
                "command": "python bench/fla_configs.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
