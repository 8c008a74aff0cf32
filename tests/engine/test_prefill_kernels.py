"""The prefill's fused kernels (qwen_chat.engine.model.prefill_kernels) on CPU under Triton's interpreter: each
kernel equals its transformers module in fp32, and a runner with the kernels gives the same logits and the same
conv and recurrent states as one without them over packed steps with short, continuing and kept chunks.

The checks run in one subprocess with ``TRITON_INTERPRET=1`` (tests/support/prefill_kernel_checks.py), since the
variable must be set before the kernels are defined.  bf16 roundings are compared on CUDA (tests/gpu), since
the interpreter truncates fp32 to bf16 instead of rounding.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is installed by deploy/install.sh --test")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.support.prefill_kernel_checks"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["rms_norm_rows", "rms_norm_strided_heads", "gated_rms_norm", "swiglu"])
def test_kernel_equals_its_module_in_fp32(results, case):
    assert results["ops"][case] <= 1e-6, results["ops"]


def test_runner_with_fused_kernels_matches_the_unfused_runner(results):
    r = results["parity"]
    assert r["impl"] is True and r["steps"] == 3
    assert r["logits"] <= 1e-5 and r["conv_state"] <= 1e-5 and r["rec_state"] <= 1e-5, r
    assert r["last_vs_transformers"] <= 1e-4, r

