"""ServiceConfig: the command line generated from the dataclass fields, the environment fallbacks, and
``validate()`` refusing a bad setting or users file with exit code 2 and one line, before anything loads."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from qwen_chat.config import ConfigError, ServiceConfig
from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[2]


def run_app(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "app.py", "--port", str(free_port()), "--history-dir",
                           str(tmp_path / "history"), *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def assert_one_line_config_error(out: subprocess.CompletedProcess, *fragments: str) -> None:
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("app.py: configuration error: "), out.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_generated_parser_defaults_are_the_dataclass_defaults():
    assert ServiceConfig.from_argv([], env={}) == ServiceConfig()
    assert vars(ServiceConfig.parser().parse_args([])) == {}  # the parser holds no default of its own
    cfg = ServiceConfig()
    assert (cfg.tp_allreduce, cfg.tp_fused) == ("auto", True)


def test_every_field_has_a_flag_listed_by_help_and_in_the_readme_table():
    out = subprocess.run([sys.executable, "app.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    readme = (REPO / "README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    parser = ServiceConfig.parser()
    dests = set()
    for action in parser._actions:
        if action.dest in ("help", "local_rank"):
            continue
        dests.add(action.dest)
        assert action.help != argparse.SUPPRESS
        for flag in action.option_strings:
            assert flag in out.stdout and f"`{flag}" in readme, flag
    assert dests == {f.name for f in fields(ServiceConfig)} - {"local_rank"}


def test_flags_parse_as_before():
    cfg = ServiceConfig.from_argv(
        ["--model", "tiny", "--port", "9000", "--history-dir", "h", "--max-upload-mb", "1.5", "--max-context", "100",
         "--device", "cpu", "--no-login", "--api-key", "a", "--api-key", "b", "--no-api-key", "--allow-remote-images",
         "--local_rank=3", "--tp-allreduce", "nccl", "--no-tp-fused"], env={"QWEN_CHAT_API_KEYS": "c, d,,"})
    assert (cfg.model, cfg.port, cfg.history_dir, cfg.max_upload_mb, cfg.max_context, cfg.device) == (
        "tiny", 9000, Path("h"), 1.5, 100, "cpu")
    assert (cfg.login, cfg.api_keys, cfg.require_api_key, cfg.allow_remote_images, cfg.local_rank) == (
        False, ("a", "b", "c", "d"), False, True, 3)
    assert (cfg.tp_allreduce, cfg.tp_fused) == ("nccl", False)
    assert ServiceConfig.from_argv(["--login"], env={}).login is True
    assert ServiceConfig.from_argv(["--tp-fused"], env={"QWEN_CHAT_TP_FUSED": "0"}).tp_fused is True


def test_prompt_workers_default_to_a_quarter_of_the_cores_from_2_to_8(monkeypatch):
    assert ServiceConfig.from_argv(["--prompt-workers", "3"], env={}).prompt_worker_count == 3
    for cores, workers in ((1, 2), (2, 2), (16, 4), (32, 8), (128, 8), (None, 2)):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        assert ServiceConfig.from_argv([], env={}).prompt_worker_count == workers, cores


def test_environment_variables_are_fallbacks_of_their_flags():
    env = {"QWEN_CHAT_DS_CONFIG": "env.json", "LOCAL_RANK": "2", "QWEN_CHAT_TP_ALLREDUCE": " NCCL ",
           "QWEN_CHAT_TP_FUSED": "0"}
    cfg = ServiceConfig.from_argv([], env=env)
    assert (cfg.ds_config, cfg.local_rank, cfg.tp_allreduce, cfg.tp_fused) == (Path("env.json"), 2, "nccl", False)
    cfg = ServiceConfig.from_argv(["--ds-config", "cli.json", "--local-rank", "1", "--tp-allreduce", "auto"], env=env)
    assert (cfg.ds_config, cfg.local_rank, cfg.tp_allreduce) == (Path("cli.json"), 1, "auto")
    for on in ("1", "", "yes"):
        assert ServiceConfig.from_argv([], env={"QWEN_CHAT_TP_FUSED": on}).tp_fused is True
    assert ServiceConfig.from_argv([], env={"QWEN_CHAT_TP_ALLREDUCE": ""}).tp_allreduce == "auto"
    with pytest.raises(ConfigError, match=r"\$LOCAL_RANK must be a number"):
        ServiceConfig.from_argv([], env={"LOCAL_RANK": "x"})


def test_validate_refuses_impossible_values_with_one_line():
    cases = [
        (dict(max_upload_mb=0.0), "--max-upload-mb must be > 0"),
        (dict(max_upload_mb=float("inf")), "--max-upload-mb must be > 0"),
        (dict(max_context=0), "--max-context must be >= 1, got 0"),
        (dict(collective_timeout_s=0.0), "--collective-timeout-s must be > 0"),
        (dict(tp_allreduce="gloo"), "--tp-allreduce (or $QWEN_CHAT_TP_ALLREDUCE) must be one of auto, symm_mem, nccl"),
        (dict(device="xpu"), "--device must be one of cpu, cuda, got 'xpu'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError) as err:
            ServiceConfig(**kwargs).validate()
        assert message in str(err.value) and "\n" not in str(err.value), kwargs
    assert ServiceConfig(max_upload_mb=0.5, max_context=1).validate().max_upload_mb == 0.5


def test_users_file_is_parsed_by_validate_only_when_login_is_on(tmp_path):
    bad = tmp_path / "users.txt"
    bad.write_text("# users\nalice:not-a-bcrypt-hash\n")
    with pytest.raises(ConfigError, match=r"users.txt:2: expected 'username:<bcrypt hash>'"):
        ServiceConfig(login=True, users_file=bad).validate()
    with pytest.raises(ConfigError, match="does not exist"):
        ServiceConfig(login=True, users_file=tmp_path / "missing.txt").validate()
    with pytest.raises(ConfigError, match="cannot read users file"):
        ServiceConfig(login=True, users_file=tmp_path).validate()
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9:$2b$x\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        ServiceConfig(login=True, users_file=tmp_path / "latin1.txt").validate()
    assert ServiceConfig(login=False, users_file=bad).validate().users_file == bad  # not read: login is off
    good = tmp_path / "good.txt"
    good.write_text("alice:$2b$12$" + "a" * 53 + "\n")
    assert ServiceConfig(login=True, users_file=good).validate().users_file == good


def test_validation_does_not_import_torch_or_gradio(tmp_path):
    users = tmp_path / "users.txt"
    users.write_text("alice:$2b$12$" + "a" * 53 + "\n")
    code = ("import sys; from qwen_chat.config import ServiceConfig;"
            f"ServiceConfig.from_argv(['--login', '--users-file', {str(users)!r}]).validate();"
            "assert 'torch' not in sys.modules and 'gradio' not in sys.modules, sorted(sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_bad_users_file_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "users.txt"
    bad.write_text("alice\n")
    assert_one_line_config_error(run_app("--login", "--users-file", str(bad), tmp_path=tmp_path),
                                 f"{bad}:1: expected 'username:<bcrypt hash>'")
    assert_one_line_config_error(run_app("--login", "--users-file", str(tmp_path / "none.txt"), tmp_path=tmp_path),
                                 "does not exist", "python -m qwen_chat.web.auth add USER")
    assert not (tmp_path / "history").exists()  # refused before the server or the engine started


def test_non_positive_max_upload_mb_exits_2_with_one_line(tmp_path):
    for value in ("0", "-1"):
        assert_one_line_config_error(run_app("--model", "tiny", "--max-upload-mb", value, tmp_path=tmp_path),
                                     "--max-upload-mb must be > 0")
    assert not (tmp_path / "history").exists()


def test_bad_tp_allreduce_from_the_environment_exits_2(tmp_path):
    out = subprocess.run([sys.executable, "app.py", "--model", "tiny", "--port", str(free_port())], cwd=REPO,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "QWEN_CHAT_TP_ALLREDUCE": "gloo"})
    assert_one_line_config_error(out, "$QWEN_CHAT_TP_ALLREDUCE", "got 'gloo'")
    out = run_app("--tp-allreduce", "gloo", tmp_path=tmp_path)
    assert out.returncode == 2 and "argument --tp-allreduce: invalid choice: 'gloo'" in out.stderr


def test_unusable_history_dir_exits_2_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "app.py", "--model", "tiny", "--port", str(free_port()), "--history-dir",
                          "/proc/foo"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert_one_line_config_error(out, "--history-dir /proc/foo", "cannot be created")
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        ServiceConfig(history_dir=not_a_folder).validate()
    created = tmp_path / "a" / "b"
    assert ServiceConfig(history_dir=created).validate().history_dir == created and created.is_dir()
