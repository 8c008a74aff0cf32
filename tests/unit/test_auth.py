"""Users file and its CLI (qwen_chat.web.auth): hashing, verification, bad input, file format."""
from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_chat.web.auth import UserDB, UsersFileError, main

ROOT = Path(__file__).resolve().parents[2]


def test_add_save_load_verify(tmp_path):
    path = tmp_path / "users.txt"
    db = UserDB({}, path)
    db.set_password("alice", "correct horse", rounds=4)
    db.set_password("bob", "battery staple", rounds=4)
    db.save()

    text = path.read_text()
    assert "correct horse" not in text and "battery staple" not in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    loaded = UserDB.from_file(path)
    assert loaded.usernames() == ["alice", "bob"]
    assert loaded.verify("alice", "correct horse") is True
    assert loaded.verify("bob", "battery staple") is True
    assert loaded.verify("alice", "battery staple") is False
    assert loaded.verify("carol", "correct horse") is False
    assert loaded.verify("alice", "") is False
    assert loaded.verify("alice", "x" * 100) is False  # over bcrypt's 72 bytes: refused, no exception
    assert loaded.verify(None, "correct horse") is False  # type: ignore[arg-type]


def test_password_change_and_remove(tmp_path):
    db = UserDB({}, tmp_path / "u.txt")
    db.set_password("alice", "first-password", rounds=4)
    db.set_password("alice", "second-password", rounds=4)
    assert db.verify("alice", "second-password") and not db.verify("alice", "first-password")
    assert db.remove("alice") is True
    assert db.remove("alice") is False
    assert len(db) == 0


@pytest.mark.parametrize("name", ["", "..", "../etc", "a/b", ".hidden", "name with space", "x" * 65, "é"])
def test_bad_usernames_refused(name):
    db = UserDB()
    with pytest.raises(UsersFileError, match="invalid username"):
        db.set_password(name, "long enough password", rounds=4)


@pytest.mark.parametrize("name", ["local", "Local", "LOCAL"])
def test_the_login_off_owner_is_a_reserved_name(name, tmp_path, capsys):
    """``local`` owns the history written with login off: ``auth add`` refuses it (any case), and a users file
    that has it is refused at load with its line number."""
    with pytest.raises(UsersFileError, match="reserved"):
        UserDB().set_password(name, "long enough password", rounds=4)
    path = tmp_path / "users.txt"
    assert main(["add", name, "--users-file", str(path), "--rounds", "4"], stdin=io.StringIO("long enough password\n")) != 0
    assert "reserved" in capsys.readouterr().err and not path.exists()
    db = UserDB(path=path)
    db.set_password("alice", "long enough password", rounds=4)
    db.save()
    alice = next(line for line in path.read_text().splitlines() if line.startswith("alice:"))
    path.write_text(f"{alice}\n{name}:{alice.split(':', 1)[1]}\n")
    with pytest.raises(UsersFileError, match=r"users.txt:2: username .* is reserved"):
        UserDB.from_file(path)


def test_bad_passwords_refused():
    db = UserDB()
    with pytest.raises(UsersFileError, match="too short"):
        db.set_password("alice", "short", rounds=4)
    with pytest.raises(UsersFileError, match="72 bytes"):
        db.set_password("alice", "ä" * 40, rounds=4)  # 80 UTF-8 bytes


def test_malformed_file_names_line(tmp_path):
    path = tmp_path / "users.txt"
    path.write_text("# comment\n\nalice:plaintext\n")
    with pytest.raises(UsersFileError, match=r"users.txt:3"):
        UserDB.from_file(path)
    with pytest.raises(UsersFileError, match="does not exist"):
        UserDB.from_file(tmp_path / "missing.txt")


def test_cli_add_list_remove_via_stdin(tmp_path, capsys):
    path = tmp_path / "users.txt"
    assert main(["add", "alice", "--users-file", str(path), "--rounds", "4"], stdin=io.StringIO("pw-alice-123\n")) == 0
    assert main(["add", "bob", "--users-file", str(path), "--rounds", "4"], stdin=io.StringIO("pw-bob-12345\n")) == 0
    assert UserDB.from_file(path).verify("alice", "pw-alice-123")
    capsys.readouterr()
    assert main(["list", "--users-file", str(path)]) == 0
    assert capsys.readouterr().out.split() == ["alice", "bob"]
    assert main(["remove", "bob", "--users-file", str(path)]) == 0
    assert UserDB.from_file(path).usernames() == ["alice"]
    assert main(["remove", "bob", "--users-file", str(path)]) == 2
    assert "no user 'bob'" in capsys.readouterr().err
    assert main(["add", "../x", "--users-file", str(path)], stdin=io.StringIO("pw-long-enough\n")) == 2
    assert main(["add", "carol", "--users-file", str(path)], stdin=io.StringIO("short\n")) == 2
    assert UserDB.from_file(path).usernames() == ["alice"]


def test_cli_as_module_subprocess(tmp_path):
    path = tmp_path / "users.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "qwen_chat.web.auth", "add", "dana", "--users-file", str(path), "--rounds", "4"],
        input="dana-password\n", capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "added user dana" in proc.stdout
    assert UserDB.from_file(path).verify("dana", "dana-password")


def test_an_unknown_name_costs_one_check_at_the_users_cost(tmp_path):
    """``verify`` of an unknown name hashes against a dummy made at the cost of the file's hashes, so that its
    time does not tell which names exist (a cheaper dummy answered in 3 ms instead of 0.3 s)."""
    db = UserDB()
    db.set_password("alice", "long enough password", rounds=5)
    assert db.verify("nobody", "long enough password") is False
    assert db._dummy().startswith(b"$2b$05$")
    assert UserDB()._dummy().startswith(b"$2b$12$")     # no users yet: the default cost
