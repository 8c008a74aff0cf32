"""start.sh picks how to start the service from the GPUs it sees: one GPU as one plain process (no DeepSpeed
launcher, whose own imports cost seconds on every start), several through ``deepspeed --num_gpus N``, none as one
CPU process (or ``NUM_CPU_RANKS`` CPU ranks through the launcher).

Driven with stand-ins on ``PATH``: an ``nvidia-smi`` that lists N GPUs, and ``deepspeed`` / ``$PYTHON`` scripts that
print the command line they were given instead of starting anything.
"""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_start(tmp_path: Path, gpus: int, **env: str) -> str:
    """The command start.sh execs (as printed by the stand-in), with ``gpus`` GPUs listed by ``nvidia-smi``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus))
    if gpus:
        _script(bin_dir / "nvidia-smi", listing)
    _script(bin_dir / "deepspeed", 'echo "deepspeed $*"\n')
    _script(bin_dir / "fake-python", 'echo "python $*"\n')
    path = str(bin_dir) + os.pathsep + "/usr/bin:/bin"  # no real nvidia-smi or deepspeed from the machine
    full_env = {"PATH": path, "HOME": str(tmp_path), "PYTHON": str(bin_dir / "fake-python"), **env}
    out = subprocess.run(["bash", str(REPO / "start.sh"), "--model", "tiny"], env=full_env, capture_output=True,
                         text=True, timeout=30, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("gpus,env,expected", [
    (1, {}, "python app.py --model tiny"),
    (4, {"NUM_GPUS": "1"}, "python app.py --model tiny"),
    (2, {}, "deepspeed --num_gpus 2 --master_port 29500 app.py --model tiny"),
    (4, {"CUDA_VISIBLE_DEVICES": "1,3"}, "deepspeed --num_gpus 2 --master_port 29500 app.py --model tiny"),
    (4, {"CUDA_VISIBLE_DEVICES": "2"}, "python app.py --model tiny"),
    (2, {"CUDA_VISIBLE_DEVICES": ""}, "python app.py --device cpu --model tiny"),
    (0, {}, "python app.py --device cpu --model tiny"),
    (0, {"NUM_CPU_RANKS": "2"}, "deepspeed --num_gpus 2 --master_port 29500 app.py --device cpu --model tiny"),
], ids=["one-gpu", "num-gpus-1", "two-gpus", "visible-2-of-4", "visible-1-of-4", "visible-none", "no-gpu",
        "cpu-ranks"])
def test_start_script_launches_by_gpu_count(tmp_path, gpus, env, expected):
    assert run_start(tmp_path, gpus, **env) == expected
