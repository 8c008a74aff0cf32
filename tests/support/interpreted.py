"""Run a check module of tests/support under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before the
kernels are defined, so the checks run in a subprocess) and return the JSON object its last line prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, timeout_s: float = 600) -> dict:
    """``python -m <module>`` from the repository root with ``TRITON_INTERPRET=1``.  Raises AssertionError with
    the tail of its stderr when it exits non-zero."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
