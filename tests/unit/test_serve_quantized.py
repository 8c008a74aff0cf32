"""bench/serve_quantized.py's merge of serve results into the ``quantized`` key (no service is started)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _serve_doc(batch1, agg64, agg128, int4_modules=0):
    return {"batch1_tok_s": batch1, "aggregate_tok_s": {"1": 1.0, "64": agg64, "128": agg128},
            "models": {"data": [{"engine": {"weights": {"dtype": "bfloat16", "int4_modules": int4_modules}}}]}}


def test_merge_writes_the_quantized_key_and_ratios_to_bf16(tmp_path):
    files = {}
    for kind, doc in {"bf16": _serve_doc(200.0, 1600.0, 2000.0), "int4": _serve_doc(500.0, 1700.0, 1900.0, 200)}.items():
        files[kind] = tmp_path / f"{kind}.json"
        files[kind].write_text(json.dumps(doc))
    missing = tmp_path / "fp8.json"  # a run that wrote nothing: nulls, and exit status 1
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_quantized.py"), "--out", str(tmp_path / "q"),
                           "--merge", f"bf16={files['bf16']}", f"int4={files['int4']}", f"fp8={missing}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads((tmp_path / "q.json").read_text())
    q = doc["quantized"]
    assert q["int4"]["batch1_tok_s"] == 500.0 and q["int4"]["aggregate_tok_s"] == {"64": 1700.0, "128": 1900.0}
    assert q["int4"]["weights"]["int4_modules"] == 200
    assert q["fp8"] == {"batch1_tok_s": None, "aggregate_tok_s": {"64": None, "128": None}, "weights": None}
    assert doc["ratios"]["int4"] == {"batch1": 2.5, "64": 1.062, "128": 0.95}
    assert doc["ratios"]["fp8"] == {"batch1": None, "64": None, "128": None}
    assert "int4" in proc.stdout and "500.0" in proc.stdout


def test_merge_sums_up_the_fp8_kv_run_under_the_24_gb_cap(tmp_path):
    cap = {"cap24": {"started": True, "aggregate_tok_s": {"8": 700.0, "32": 1500.0},
                     "long_context": {"engine": {"kv_tokens": 190000, "state_slots": 38}}}}
    bf16, fp8kv = tmp_path / "bf16.json", tmp_path / "kv.json"
    bf16.write_text(json.dumps(_serve_doc(200.0, 1600.0, 2000.0)))
    fp8kv.write_text(json.dumps(cap))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_quantized.py"), "--out", str(tmp_path / "q"),
                           "--merge", f"bf16={bf16}", f"fp8_kv_cap24={fp8kv}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "q.json").read_text())
    assert doc["quantized"]["fp8_kv_cap24"] == {"kv_tokens": 190000, "aggregate_tok_s": {"32": 1500.0}}
    assert "fp8_kv_cap24" not in doc["ratios"] and "190000 KV tokens" in proc.stdout


def test_the_fp8_kv_run_keeps_its_flag_beside_service_args_of_the_caller():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import serve_quantized
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert serve_quantized.with_kv_flag(["--service-args", "--max-batch 16", "--skip-long"]) == [
        "--service-args", "--max-batch 16 --kv-cache-dtype fp8", "--skip-long"]
    assert serve_quantized.with_kv_flag(["--skip-long"]) == ["--skip-long"]
