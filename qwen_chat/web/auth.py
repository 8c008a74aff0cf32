"""Login users file (bcrypt-hashed passwords) and its command-line tool.

The users file is a text file with one ``username:bcrypt-hash`` line per user (``#`` starts a comment), the
layout of Apache's ``htpasswd -B``.  Create or change users with::

    python -m qwen_chat.web.auth add alice --users-file users.txt      # asks for the password twice
    echo 'secret-pass' | python -m qwen_chat.web.auth add bob --users-file users.txt   # reads stdin
    python -m qwen_chat.web.auth remove bob --users-file users.txt
    python -m qwen_chat.web.auth list --users-file users.txt

and start the service with ``--users-file users.txt`` (login is on by default when bound beyond loopback).
The web server passes ``UserDB.verify`` to Gradio's ``auth=``.  Usernames double as per-user history folder
names, so they are restricted to ``[A-Za-z0-9_.-]`` (no leading dot).  Hashing: bcrypt (the ``bcrypt``
package), cost 12 by default; bcrypt only reads the first 72 bytes of a password, so longer passwords are
refused instead of being silently truncated.
"""
from __future__ import annotations

import argparse
import getpass
import hmac
import re
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

import bcrypt

from qwen_chat.history.files import write_atomic
from qwen_chat.history.store import LOCAL_USER

USERNAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")
#: Names the history store uses itself: ``local`` owns the history written with login off, so a login user of
#: that name would read it.  Compared case-insensitively (a case-insensitive file system maps them to one folder).
RESERVED_USERNAMES = frozenset({LOCAL_USER})
MIN_PASSWORD_CHARS = 8
MAX_PASSWORD_BYTES = 72  # bcrypt's input limit (bcrypt 5 raises ValueError beyond it)
DEFAULT_ROUNDS = 12  # bcrypt cost factor: 2**12 key-expansion rounds, ~0.2 s per check on one CPU core


class UsersFileError(ValueError):
    """The users file or a username/password given to the tool is not acceptable; the message says why."""


def check_username(username: str) -> str:
    """Return ``username`` if it is 1-64 chars of ``[A-Za-z0-9_.-]`` not starting with a dot and not reserved
    (``RESERVED_USERNAMES``).

    Raises:
        UsersFileError: otherwise (the name is also a folder name, so ``..``, ``/`` and the like are refused).
    """
    if not isinstance(username, str) or not USERNAME_RE.match(username):
        raise UsersFileError(
            f"invalid username {username!r}: use 1-64 letters, digits, '_', '-' or '.', not starting with '.'"
        )
    if username.lower() in RESERVED_USERNAMES:
        raise UsersFileError(f"username {username!r} is reserved: the history written with login off belongs to "
                             f"it; choose another name")
    return username


def check_password(password: str) -> str:
    """Return ``password`` if it has at least 8 characters and at most 72 UTF-8 bytes (bcrypt's limit).

    Raises:
        UsersFileError: naming the rule that failed.
    """
    if len(password) < MIN_PASSWORD_CHARS:
        raise UsersFileError(f"password too short: at least {MIN_PASSWORD_CHARS} characters")
    if len(password.encode("utf-8")) > MAX_PASSWORD_BYTES:
        raise UsersFileError(f"password too long: at most {MAX_PASSWORD_BYTES} bytes (bcrypt's limit)")
    return password


class UserDB:
    """Users and their bcrypt password hashes, loaded from and saved to a users file.

    Thread-safe: ``verify`` may be called from many request threads at once.
    """

    def __init__(self, users: Optional[dict[str, bytes]] = None, path: Optional[Path] = None):
        """``users`` maps username -> bcrypt hash (bytes, ``$2b$...``); ``path`` is where ``save`` writes."""
        self._users: dict[str, bytes] = dict(users or {})
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        # verify() hashes against this for unknown users too, so response time does not reveal valid names: made
        # lazily, at the cost of the file's hashes (a cheaper one answered unknown names in 3 ms instead of 0.3 s)
        self._dummy_hash: Optional[bytes] = None

    @classmethod
    def from_file(cls, path: Path | str, missing_ok: bool = False) -> "UserDB":
        """Load a users file.

        Raises:
            UsersFileError: the file does not exist (unless ``missing_ok``), or a line is not
                ``username:$2...`` (the message gives the line number).
        """
        path = Path(path)
        if not path.exists():
            if missing_ok:
                return cls({}, path)
            raise UsersFileError(
                f"users file {path} does not exist; create it with "
                f"`python -m qwen_chat.web.auth add USER --users-file {path}`"
            )
        users: dict[str, bytes] = {}
        for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, hashed = line.partition(":")
            if not sep or not USERNAME_RE.match(name) or not hashed.startswith("$2"):
                raise UsersFileError(f"{path}:{number}: expected 'username:<bcrypt hash>'")
            if name.lower() in RESERVED_USERNAMES:
                raise UsersFileError(f"{path}:{number}: username {name!r} is reserved (the history written with "
                                     f"login off belongs to it); remove the line and add the user under another "
                                     f"name")
            users[name] = hashed.encode("ascii")
        return cls(users, path)

    def usernames(self) -> list[str]:
        """Sorted list of usernames."""
        with self._lock:
            return sorted(self._users)

    def __contains__(self, username: object) -> bool:
        with self._lock:
            return username in self._users

    def __len__(self) -> int:
        with self._lock:
            return len(self._users)

    def set_password(self, username: str, password: str, rounds: int = DEFAULT_ROUNDS) -> None:
        """Add ``username`` or replace its password (in memory; call ``save`` to write the file).

        Raises:
            UsersFileError: bad username or password (see ``check_username``/``check_password``).
        """
        check_username(username)
        check_password(password)
        hashed = bcrypt.hashpw(password.encode("utf-8"), bcrypt.gensalt(rounds=rounds))
        with self._lock:
            self._users[username] = hashed

    def remove(self, username: str) -> bool:
        """Remove ``username``; return False if it was not there."""
        with self._lock:
            return self._users.pop(username, None) is not None

    def verify(self, username: str, password: str) -> bool:
        """True iff ``username`` exists and ``password`` matches its hash.

        Never raises for bad input (wrong types, over-long passwords, unknown users all give False).  Takes
        about one bcrypt check whether or not the user exists.
        """
        if not isinstance(username, str) or not isinstance(password, str):
            return False
        secret = password.encode("utf-8")
        with self._lock:
            hashed = self._users.get(username)
        if len(secret) > MAX_PASSWORD_BYTES:
            return False
        if hashed is None:
            bcrypt.checkpw(secret, self._dummy())
            return False
        try:
            return bcrypt.checkpw(secret, hashed)
        except ValueError:  # malformed hash in the file
            return False

    def _dummy(self) -> bytes:
        """A hash of a password nobody has, at the cost (rounds) of the users' hashes (``DEFAULT_ROUNDS`` when
        the file has none or an unreadable one), so that checking an unknown name takes as long as a known one."""
        if self._dummy_hash is None:
            with self._lock:
                sample = next(iter(self._users.values()), b"")
            parts = sample.split(b"$")
            rounds = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() and 4 <= int(parts[2]) <= 31 \
                else DEFAULT_ROUNDS
            self._dummy_hash = bcrypt.hashpw(b"no-user-has-this-password", bcrypt.gensalt(rounds=rounds))
        return self._dummy_hash

    def save(self, path: Optional[Path | str] = None) -> Path:
        """Write the users file atomically (``history.files.write_atomic``) with mode 0600; return its path.

        Raises:
            UsersFileError: no path was given here or at construction.
        """
        target = Path(path) if path is not None else self.path
        if target is None:
            raise UsersFileError("no users file path to save to")
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            body = "".join(f"{name}:{hashed.decode('ascii')}\n" for name, hashed in sorted(self._users.items()))
        header = "# qwen_chat users file: username:bcrypt-hash (python -m qwen_chat.web.auth --help)\n"
        write_atomic(target, (header + body).encode("utf-8"))  # mode 0600
        return target


def _read_password(stdin, prompt_user: str) -> str:
    """Ask twice on a terminal; otherwise read the first line of stdin (without its newline)."""
    if stdin.isatty():
        first = getpass.getpass(f"Password for {prompt_user}: ")
        second = getpass.getpass("Repeat password: ")
        if not hmac.compare_digest(first.encode("utf-8"), second.encode("utf-8")):
            raise UsersFileError("passwords do not match")
        return first
    line = stdin.readline()
    return line.rstrip("\r\n")


def main(argv: Optional[Sequence[str]] = None, stdin=None) -> int:
    """CLI entry point; returns the process exit status (0 ok, 2 bad input)."""
    stdin = sys.stdin if stdin is None else stdin
    parser = argparse.ArgumentParser(
        prog="python -m qwen_chat.web.auth", description="Manage the chat service's login users file."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add a user or change a password (password from the terminal or stdin)")
    add.add_argument("username")
    add.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="bcrypt cost factor (4..31)")
    rem = sub.add_parser("remove", help="remove a user")
    rem.add_argument("username")
    sub.add_parser("list", help="list usernames")
    for p in (add, rem, sub.choices["list"]):
        p.add_argument("--users-file", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        db = UserDB.from_file(args.users_file, missing_ok=(args.command == "add"))
        if args.command == "add":
            check_username(args.username)
            if not 4 <= args.rounds <= 31:
                raise UsersFileError("--rounds must be 4..31")
            existed = args.username in db
            db.set_password(args.username, _read_password(stdin, args.username), rounds=args.rounds)
            db.save()
            print(f"{'updated' if existed else 'added'} user {args.username} in {args.users_file}")
        elif args.command == "remove":
            if not db.remove(args.username):
                raise UsersFileError(f"no user {args.username!r} in {args.users_file}")
            db.save()
            print(f"removed user {args.username} from {args.users_file}")
        else:
            for name in db.usernames():
                print(name)
    except UsersFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
