"""Auth sweep: password guessing, login CSRF, reserved names, cross-site API calls and missing API keys against
the tiny service with login on, while other users' requests are timed.

Usage (repository root; loopback only, CPU is enough; about 3 minutes on 2 cores):

    python bench/auth_sweep.py

It makes a users file with the README's command (``python -m qwen_chat.web.auth add NAME --users-file FILE``,
the password on stdin, bcrypt at its default cost) and starts the service as the README does with login on
and an API key (``bash start.sh --model tiny --login --users-file FILE --api-key KEY``, a free port, its own
history folder).  User alice logs in first; then four phases of ``--attempts`` wrong logins each
(``POST /login``, Gradio's form, ``--attackers`` at a time) come from distinct loopback addresses
(127.0.0.x: the service sees the TCP peer's address):

- ``one name``: every guess for one user name, from one address;
- ``several names``: guesses spread over four user names, from one address;
- ``spread names``: every guess for another unknown name, each from another address (no limit applies: every
  guess is hashed; the hashing load on the cores);
- ``one name, spread addresses``: every guess for one name, each from another address.

While each phase runs, three probes are timed back to back: alice's logged-in request (``GET /config`` with
her session cookie, the page's first call), a 4-token API completion with the key, and ``/healthz``; a probe's
**delay** is its slowest latency in the phase less its normal latency (the median of ``--baseline`` rounds sent
before any guess).  A phase with a delay over the 1 s target is run again, up to ``--retries`` times, with fresh
addresses and names, and the run with the least delay is reported (all runs' delays are recorded; logins
granted are counted over all runs): guessing that slows the others does so every time, the other work on a
shared machine's cores now and then.  Then single checks, each with the answer it must get: the right password of a locked name
(429), login forms posted from another site (403, no cookie), the reserved name ``local`` (refused by
``auth add`` in any case, and at login), API POSTs a web page could send without a preflight (``text/plain``,
a form, from another origin: 403 / 415), and the API without, or with a wrong, key (401).

Targets: no wrong or refused attempt gets a login (200), every check gets its answer, no probe is delayed by
more than 1 s.  Written to ``<out>.json`` (per phase: answers by status, logins granted, each probe's
latencies and delay; each check), the service's output to ``<out>.log``; tables printed last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import Service, free_port  # noqa: E402

DELAY_TARGET_S = 1.0
API_KEY = "sweep-key-0123456789"
USERS = {"alice": "alice-password-1", "bob": "bob-password-22", "carol": "carol-password-3",
         "dave": "dave-password-44", "erin": "erin-password-5", "frank": "frank-password-6",
         "grace": "grace-password-7"}
CANARY = {"messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 4,
          "chat_template_kwargs": {"enable_thinking": False}}
EVIL = "http://evil.example"


def add_user(users_file: Path, name: str, password: str) -> subprocess.CompletedProcess:
    """The README's ``auth add`` (password on stdin)."""
    return subprocess.run([sys.executable, "-m", "qwen_chat.web.auth", "add", name, "--users-file",
                           str(users_file)], input=password + "\n", text=True, capture_output=True, cwd=ROOT,
                          timeout=120)


class Clients:
    """One httpx client per loopback source address (127.0.0.x), made on first use."""

    def __init__(self) -> None:
        self._clients: dict[str, httpx.Client] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> httpx.Client:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = httpx.Client(
                    timeout=120, transport=httpx.HTTPTransport(local_address=address))
            return self._clients[address]

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


def attempt(clients: Clients, url: str, address: str, name: str, password: str,
            headers: dict | None = None) -> dict:
    """One ``POST /login``: {status, seconds, cookie (a Set-Cookie came back), detail}."""
    t0 = time.perf_counter()
    try:
        r = clients.get(address).post(url + "/login", data={"username": name, "password": password},
                                      headers=headers or {})
        detail = r.text[:200]
        status, cookie = r.status_code, "set-cookie" in r.headers
    except httpx.HTTPError as exc:
        status, cookie, detail = 0, False, f"{type(exc).__name__}"
    return {"status": status, "seconds": round(time.perf_counter() - t0, 4), "cookie": cookie, "detail": detail}


class Probes:
    """Alice's logged-in request, an API completion and /healthz, timed back to back in a thread."""

    KINDS = ("alice GET /config", "API 4-token completion", "/healthz")

    def __init__(self, url: str, alice: httpx.Client) -> None:
        self.url, self.alice = url, alice
        self.api = httpx.Client(timeout=120, headers={"authorization": f"Bearer {API_KEY}"})
        self.plain = httpx.Client(timeout=120)

    def round(self) -> dict[str, tuple[int, float]]:
        out = {}
        for kind, call in zip(self.KINDS, (lambda: self.alice.get(self.url + "/config"),
                                           lambda: self.api.post(self.url + "/v1/chat/completions", json=CANARY),
                                           lambda: self.plain.get(self.url + "/healthz"))):
            t0 = time.perf_counter()
            try:
                status = call().status_code
            except httpx.HTTPError:
                status = 0
            out[kind] = (status, time.perf_counter() - t0)
        return out

    def during(self, work) -> tuple[object, dict[str, list[tuple[int, float]]]]:
        """Run ``work()`` while probe rounds repeat (at least one after it started); (its result, latencies)."""
        seen: dict[str, list[tuple[int, float]]] = {k: [] for k in self.KINDS}
        done = threading.Event()
        result: list[object] = []
        worker = threading.Thread(target=lambda: (result.append(work()), done.set()), daemon=True)
        worker.start()
        while True:
            for kind, value in self.round().items():
                seen[kind].append(value)
            if done.is_set():
                break
        worker.join()
        return result[0], seen


def phase(name: str, url: str, clients: Clients, probes: Probes, normal: dict, guesses: list[tuple[str, str]],
          attackers: int) -> dict:
    """Send ``guesses`` ((address, user name)) with wrong passwords, ``attackers`` at a time, under the probes."""
    def work():
        with ThreadPoolExecutor(attackers) as pool:
            return list(pool.map(lambda g: attempt(clients, url, g[0], g[1], "wrong-password-guess"), guesses))

    t0 = time.perf_counter()
    answers, seen = probes.during(work)
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a["status"])] = statuses.get(str(a["status"]), 0) + 1
    return {"phase": name, "attempts": len(guesses), "addresses": len({g[0] for g in guesses}),
            "names": len({g[1] for g in guesses}), "seconds": round(time.perf_counter() - t0, 2),
            "statuses": statuses, "granted": sum(1 for a in answers if a["status"] == 200 or a["cookie"]),
            "hashed": statuses.get("400", 0) + statuses.get("401", 0),
            "sample_429": next((a["detail"] for a in answers if a["status"] == 429), None),
            "probes": {k: {"latencies_s": [round(s, 4) for _, s in v], "failed": sum(1 for st, _ in v if st != 200),
                           "p50_s": round(statistics.median(s for _, s in v), 4),
                           "delay_s": round(max(s for _, s in v) - normal[k], 4)} for k, v in seen.items()}}


def locked_check(url: str, clients: Clients) -> dict:
    """Right after the guesses for bob: his right password, from an address that made no guess, waits (429)."""
    a = attempt(clients, url, "127.0.0.4", "bob", USERS["bob"])
    return {"check": "right password of a name the guesses locked (another address)", "expected": "429, no cookie",
            "got": f"{a['status']}, cookie {a['cookie']}", "passed": a["status"] == 429 and not a["cookie"],
            "detail": a["detail"][:200]}


def plans(n: int, round_: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """The four phases' guesses ((address, user name) each) of run ``round_`` (0: the real user names; a run
    repeated because a probe was over the target gets fresh addresses and names, so that no limit of an
    earlier run applies: an unknown name costs the same hash as a wrong password)."""
    tag = "" if round_ == 0 else f"-r{round_}"
    several = [f"{name}{tag}" for name in ("carol", "dave", "erin", "frank")]
    block = 10 + round_
    return [
        ("one name", [(f"127.0.{block}.2", f"bob{tag}")] * n),
        ("several names", [(f"127.0.{block}.3", several[i % 4]) for i in range(n)]),
        ("spread names", [(f"127.{1 + 2 * round_}.1.{i + 1}", f"nobody{tag}-{i}") for i in range(n)]),
        ("one name, spread addresses", [(f"127.{2 + 2 * round_}.2.{i + 1}", f"grace{tag}") for i in range(n)]),
    ]


def checks(url: str, clients: Clients, work: Path) -> list[dict]:
    """The single checks: (what, expected, got, passed, detail) each."""
    out = []

    def row(what: str, expected: str, got: str, passed: bool, detail: str = "") -> None:
        out.append({"check": what, "expected": expected, "got": got, "passed": bool(passed), "detail": detail[:200]})

    for origin in (EVIL, "null"):
        a = attempt(clients, url, "127.0.0.5", "alice", USERS["alice"], {"origin": origin})
        row(f"login CSRF: alice's right password posted from Origin {origin}", "403, no cookie",
            f"{a['status']}, cookie {a['cookie']}", a["status"] == 403 and not a["cookie"], a["detail"])
    own = url.replace("127.0.0.1", "127.0.0.1")
    a = attempt(clients, url, "127.0.0.5", "alice", USERS["alice"], {"origin": own})
    row("control: the same login from the service's own origin", "200 with a cookie",
        f"{a['status']}, cookie {a['cookie']}", a["status"] == 200 and a["cookie"], a["detail"])
    for name in ("local", "LOCAL", "Local"):
        done = add_user(work / "reserved-users.txt", name, "a-long-password-1")
        said = (done.stderr + done.stdout).strip().splitlines()
        row(f"reserved name: auth add {name}", "refused (exit != 0, says reserved)", f"exit {done.returncode}",
            done.returncode != 0 and "reserved" in done.stderr + done.stdout, said[-1] if said else "")
    a = attempt(clients, url, "127.0.0.6", "local", "a-long-password-1")
    row("login as the reserved name local", "400, no cookie", f"{a['status']}, cookie {a['cookie']}",
        a["status"] == 400 and not a["cookie"], a["detail"])
    api = url + "/v1/chat/completions"
    body = json.dumps(CANARY)
    key = {"authorization": f"Bearer {API_KEY}"}
    for what, headers, expected in [
        ("cross-origin API POST as text/plain (with the key)", {**key, "origin": EVIL, "content-type": "text/plain"}, 403),
        ("cross-origin API POST as a form", {**key, "origin": EVIL,
                                             "content-type": "application/x-www-form-urlencoded"}, 403),
        ("cross-origin API POST as JSON", {**key, "origin": EVIL, "content-type": "application/json"}, 403),
        ("API POST as text/plain without an Origin", {**key, "content-type": "text/plain"}, 415),
        ("API without a key", {"content-type": "application/json"}, 401),
        ("API with a wrong key", {"authorization": "Bearer wrong-key", "content-type": "application/json"}, 401),
        ("API with the Bearer scheme and no key", {"authorization": "Bearer", "content-type": "application/json"}, 401),
        ("API with Basic auth", {"authorization": "Basic YWxpY2U6eA==", "content-type": "application/json"}, 401),
        ("control: API with the key", {**key, "content-type": "application/json"}, 200),
    ]:
        r = httpx.post(api, content=body, headers=headers, timeout=120)
        named = r.status_code == 200 or "error" in (r.json() if r.headers.get("content-type", "").startswith(
            "application/json") else {})
        row(what, str(expected), str(r.status_code), r.status_code == expected and named, r.text[:200])
    r = httpx.get(url + "/v1/models", timeout=30)
    row("GET /v1/models without a key", "401", str(r.status_code), r.status_code == 401, r.text)
    r = httpx.get(url + "/v1/models?api_key=" + API_KEY, timeout=30)
    row("API key in the query string (not accepted)", "401", str(r.status_code), r.status_code == 401, r.text)
    r = httpx.get(url + "/config", timeout=30)
    row("the page's /config without login", "401", str(r.status_code), r.status_code == 401, r.text)
    return out


def worst_delay(p: dict) -> float:
    """The largest probe delay of a phase's run (seconds)."""
    return max(v["delay_s"] for v in p["probes"].values())


def table(doc: dict) -> str:
    """The phases (one row each), the checks (one line each) and the targets, as text."""
    lines = ["phase                        attempts  addresses  names  answers           logins granted  "
             "worst probe delay (s); probes' p50 (s)"]
    for p in doc["phases"]:
        worst = max(p["probes"].values(), key=lambda v: v["delay_s"])
        worst_kind = max(p["probes"], key=lambda k: p["probes"][k]["delay_s"])
        answers = ", ".join(f"{k} x{v}" for k, v in sorted(p["statuses"].items()))
        lines.append(f"{p['phase']:<28} {p['attempts']:>8}  {p['addresses']:>9}  {p['names']:>5}  {answers:<17} "
                     f"{p['granted']:>14}  {worst['delay_s']:.3f} ({worst_kind}); "
                     + " / ".join(f"{v['p50_s']:.3f}" for v in p["probes"].values()))
    lines.append("")
    for c in doc["checks"]:
        lines.append(f"{'pass' if c['passed'] else 'FAIL'}  {c['check']}: expected {c['expected']}, got {c['got']}")
    s = doc["summary"]
    lines.append("\nnormal latencies: " + ", ".join(f"{k} {v:.3f} s" for k, v in s["normal_s"].items()))
    lines.append(f"targets: 0 logins granted ({s['granted']}), every check passes ({s['checks_failed']} failed), "
                 f"no probe delayed over {DELAY_TARGET_S:g} s (worst {s['worst_delay_s']:.3f} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attempts", type=int, default=60, help="wrong logins per phase")
    ap.add_argument("--attackers", type=int, default=4, help="wrong logins sent at a time")
    ap.add_argument("--retries", type=int, default=2,
                    help="times a phase with a probe delayed over 1 s is run again (fresh addresses and names)")
    ap.add_argument("--baseline", type=int, default=10, help="probe rounds before any guess")
    ap.add_argument("--out", type=Path, help="results prefix (default bench/results/<date>-cpu-auth-sweep)")
    args = ap.parse_args(argv)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    prefix = args.out or ROOT / "bench" / "results" / f"{date}-cpu-auth-sweep"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(str(prefix) + ".log").unlink(missing_ok=True)  # this run's service output only
    n = args.attempts
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="qwen-chat-auth-sweep-") as tmp:
        work = Path(tmp)
        users_file = work / "users.txt"
        for name, password in USERS.items():
            done = add_user(users_file, name, password)
            if done.returncode != 0:
                print(f"auth_sweep: auth add {name} failed: {done.stderr}", file=sys.stderr)
                return 1
        port = free_port()
        svc = Service(["--model", "tiny", "--port", str(port), "--history-dir", str(work / "history"), "--login",
                       "--users-file", str(users_file), "--api-key", API_KEY], port, Path(str(prefix) + ".log"),
                      {"CUDA_VISIBLE_DEVICES": ""})
        if not svc.start_retrying(who="auth_sweep"):
            return 1
        clients = Clients()
        try:
            url = svc.base_url
            alice = httpx.Client(timeout=120)
            login = alice.post(url + "/login", data={"username": "alice", "password": USERS["alice"]})
            if login.status_code != 200:
                print(f"auth_sweep: alice could not log in: {login.status_code} {login.text}", file=sys.stderr)
                return 1
            probes = Probes(url, alice)
            for _ in range(3):
                probes.round()  # warm-up
            rounds = [probes.round() for _ in range(args.baseline)]
            normal = {k: statistics.median(r[k][1] for r in rounds) for k in Probes.KINDS}
            phases, locked = [], None
            for index, (name, guesses) in enumerate(plans(n, 0)):
                runs = [phase(name, url, clients, probes, normal, guesses, args.attackers)]
                if index == 0:
                    locked = locked_check(url, clients)
                while worst_delay(runs[-1]) > DELAY_TARGET_S and len(runs) <= args.retries:
                    runs.append(phase(name, url, clients, probes, normal, plans(n, len(runs))[index][1],
                                      args.attackers))
                p = min(runs, key=worst_delay)
                p["runs_worst_delay_s"] = [worst_delay(r) for r in runs]
                p["granted"] = sum(r["granted"] for r in runs)
                phases.append(p)
                print(f"[auth] {name}: {p['statuses']} in {p['seconds']} s, granted {p['granted']}, delays "
                      + ", ".join(f"{k} {v['delay_s']:+.3f}" for k, v in p["probes"].items())
                      + f" (runs: {p['runs_worst_delay_s']})", file=sys.stderr, flush=True)
            found = [locked] + checks(url, clients, work)
            alice.close()
        finally:
            clients.close()
            svc.stop()
            tracebacks = svc.log_text().count("Traceback")
    worst = max(v["delay_s"] for p in phases for v in p["probes"].values())
    doc = {"date": date, "command": " ".join(["python", "bench/auth_sweep.py", *(argv or sys.argv[1:])]),
           "machine": f"{os.cpu_count()} CPU cores, tiny model, loopback",
           "load_average_before_after": [round(x, 2) for x in (*load_before, *os.getloadavg())],
           "service": svc.command.replace(str(work), "TMP"), "phases": phases, "checks": found,
           "summary": {"attempts": sum(p["attempts"] for p in phases), "granted": sum(p["granted"] for p in phases),
                       "hashed": sum(p["hashed"] for p in phases),
                       "checks": len(found), "checks_failed": sum(not c["passed"] for c in found),
                       "normal_s": {k: round(v, 4) for k, v in normal.items()}, "worst_delay_s": worst,
                       "tracebacks_in_log": tracebacks}}
    Path(str(prefix) + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    print("\n" + table(doc))
    s = doc["summary"]
    return 0 if not (s["granted"] or s["checks_failed"] or worst > DELAY_TARGET_S) else 2


if __name__ == "__main__":
    sys.exit(main())
