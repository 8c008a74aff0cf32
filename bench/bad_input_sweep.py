"""Bad-input sweep: every kind of malformed, wrong or hostile API request against the tiny service, each with a
normal request (the canary) timed beside it.

Usage (repository root; loopback only, CPU is enough; about 10 minutes on 2 cores):

    python bench/bad_input_sweep.py                   # every kind (275), results in bench/results/
    python bench/bad_input_sweep.py --only image      # the kinds whose name or group contains "image"

It starts the service as the README does (``bash start.sh --model tiny``, a free port, its own history folder,
``--max-request-mb`` 16 so that the bodies over the limit are quick to send) and sends each kind of
``tests/support/bad_inputs.cases`` (built from tables: wrong types and ranges for every field of
``/v1/chat/completions``, NaN / Infinity / huge numbers, unknown roles and content parts, broken image data
URLs, tools / tool_choice / response_format mistakes and schemas over the limits, bodies over the size limit,
deep nesting, too many messages, non-JSON content types and foreign origins, wrong methods and unknown routes,
lone surrogates; and odd but legal requests that must be answered 200).  While each one runs, the canary (the
same 4-token request the normal latency was measured with) is sent again and again until that request has its
answer; the canary's **delay** is its slowest latency then less its normal latency (the median of
``--baseline`` canaries sent alone before the sweep).  A kind whose delay is over the 1 s target is sent again,
up to ``--retries`` times, and its delay is the least of its runs (every run is recorded): a request that
stalls the service does so every time, while the other work on a shared machine's cores delays a canary now
and then whatever request runs beside it.

Each answer is judged by ``bad_inputs.judge``: ``ok`` (the expected status; a 4xx with an OpenAI error body
whose message names the field or the limit), ``5xx``, ``unclear`` or ``wrong status``.  Targets: no 5xx, every
4xx names the problem, no request delays the canary by more than 1 s.  Written to ``<out>.json`` (every kind:
status, verdict, message, seconds, canary latencies and delay; the summary), the service's output to
``<out>.log``; a table per group is printed last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from serve_proc import Service, free_port  # noqa: E402
from tests.support import bad_inputs as B  # noqa: E402

DELAY_TARGET_S = 1.0


def canary(client: httpx.Client, url: str) -> tuple[int, float]:
    """One normal 4-token request: (HTTP status, seconds)."""
    t0 = time.perf_counter()
    try:
        status = client.post(url + "/v1/chat/completions", json=B.BASE).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.perf_counter() - t0


def run_case(case: B.Case, url: str, client: httpx.Client, normal_s: float) -> dict:
    """Send ``case`` in a thread while canaries run back to back here; the record of this kind."""
    answer: list[B.Answer] = []
    sender = threading.Thread(target=lambda: answer.append(B.send(case, url)), daemon=True)
    sender.start()
    latencies, statuses = [], []
    while True:
        status, seconds = canary(client, url)
        latencies.append(round(seconds, 4))
        statuses.append(status)
        if not sender.is_alive():
            break
    sender.join()
    verdict, why = B.judge(case, answer[0])
    error = B.error_of(answer[0].text)
    return {"name": case.name, "group": case.group, "method": case.method, "path": case.path,
            "body_bytes": len(case.body or case.raw or b""), "expect": case.expect, "status": answer[0].status,
            "verdict": verdict, "why": why, "message": error["message"][:300] if error else None,
            "param": error["param"] if error else None, "code": error["code"] if error else None,
            "seconds": round(answer[0].seconds, 4), "canary_s": latencies,
            "canary_failed": sum(1 for s in statuses if s != 200),
            "canary_delay_s": round(max(latencies) - normal_s, 4)}


def summary(records: list[dict], normal_s: float, baseline: list[float]) -> dict:
    """Counts by verdict (all kinds and per group), the worst canary delay (seconds) and its kind, the kinds over
    the target, the canary's normal latency and its baseline latencies (seconds)."""
    worst = max(records, key=lambda r: r["canary_delay_s"])
    groups = {}
    for r in records:
        g = groups.setdefault(r["group"], {"kinds": 0, "ok": 0, "5xx": 0, "unclear": 0, "wrong status": 0,
                                           "worst_delay_s": 0.0})
        g["kinds"] += 1
        g[r["verdict"]] += 1
        g["worst_delay_s"] = max(g["worst_delay_s"], r["canary_delay_s"])
    return {"kinds": len(records), "ok": sum(r["verdict"] == "ok" for r in records),
            "5xx": sum(r["verdict"] == "5xx" for r in records),
            "unclear": sum(r["verdict"] == "unclear" for r in records),
            "wrong_status": sum(r["verdict"] == "wrong status" for r in records),
            "canary_failed": sum(r["canary_failed"] for r in records),
            "canary_normal_s": round(normal_s, 4), "canary_baseline_s": [round(b, 4) for b in baseline],
            "worst_delay_s": worst["canary_delay_s"], "worst_delay_kind": worst["name"],
            "over_target": [r["name"] for r in records if r["canary_delay_s"] > DELAY_TARGET_S],
            "groups": groups}


def table(s: dict) -> str:
    """The summary as a text table, one row per group, then the canary figures and the targets."""
    rows = [("group", "kinds", "ok", "5xx", "unclear", "wrong status", "worst canary delay (s)")]
    for name, g in s["groups"].items():
        rows.append((name, g["kinds"], g["ok"], g["5xx"], g["unclear"], g["wrong status"],
                     f"{g['worst_delay_s']:.3f}"))
    rows.append(("all", s["kinds"], s["ok"], s["5xx"], s["unclear"], s["wrong_status"],
                 f"{s['worst_delay_s']:.3f}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(-1, "-" * len(lines[0]))
    return "\n".join(lines + [
        f"canary normal latency {s['canary_normal_s']:.3f} s (median of {len(s['canary_baseline_s'])}); worst "
        f"delay {s['worst_delay_s']:.3f} s ({s['worst_delay_kind']}); canaries failed: {s['canary_failed']}",
        f"targets: 0 x 5xx ({s['5xx']}), every 4xx names the problem ({s['unclear']} unclear), "
        f"no delay over {DELAY_TARGET_S:g} s ({len(s['over_target'])} over)"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-request-mb", type=float, default=16.0, help="the service's body limit")
    ap.add_argument("--baseline", type=int, default=15, help="canaries sent alone for the normal latency")
    ap.add_argument("--retries", type=int, default=2,
                    help="times a kind whose canary delay is over 1 s is sent again (its delay: the least)")
    ap.add_argument("--only", help="run the kinds whose name or group contains this text")
    ap.add_argument("--out", type=Path, help="results prefix (default bench/results/<date>-cpu-bad-input-sweep)")
    args = ap.parse_args(argv)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    prefix = args.out or ROOT / "bench" / "results" / f"{date}-cpu-bad-input-sweep"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(str(prefix) + ".log").unlink(missing_ok=True)  # this run's service output only
    limit = int(args.max_request_mb * 2**20)
    kinds = [c for c in B.cases(limit)
             if not args.only or args.only.lower() in (c.name + " " + c.group).lower()]
    port = free_port()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="qwen-chat-sweep-") as history:
        svc = Service(["--model", "tiny", "--port", str(port), "--history-dir", history,
                       "--max-request-mb", f"{args.max_request_mb:g}"], port, Path(str(prefix) + ".log"),
                      {"CUDA_VISIBLE_DEVICES": ""})
        if not svc.start_retrying(who="bad_input_sweep"):
            return 1
        try:
            with httpx.Client(timeout=120) as client:
                for _ in range(3):  # warm-up: first requests compile and fill caches
                    canary(client, svc.base_url)
                baseline = [canary(client, svc.base_url)[1] for _ in range(args.baseline)]
                normal = statistics.median(baseline)
                records = []
                for i, case in enumerate(kinds, 1):
                    rec = run_case(case, svc.base_url, client, normal)
                    runs = [rec["canary_delay_s"]]
                    while runs[-1] > DELAY_TARGET_S and len(runs) < 1 + args.retries:
                        runs.append(run_case(case, svc.base_url, client, normal)["canary_delay_s"])
                    rec.update(canary_delay_s=min(runs), canary_delay_runs=runs)
                    records.append(rec)
                    mark = "" if rec["verdict"] == "ok" else f"  <-- {rec['verdict']}: {rec['why'][:160]}"
                    print(f"[{i}/{len(kinds)}] {case.group} / {case.name}: {rec['status']} in "
                          f"{rec['seconds']:.3f} s, canary delay {rec['canary_delay_s']:+.3f} s{mark}",
                          file=sys.stderr, flush=True)
                still = canary(client, svc.base_url)
                health = client.get(svc.base_url + "/healthz").status_code
        finally:
            svc.stop()
            tracebacks = svc.log_text().count("Traceback")
    doc = {"date": date, "command": " ".join(["python", "bench/bad_input_sweep.py", *(argv or sys.argv[1:])]),
           "machine": f"{os.cpu_count()} CPU cores, tiny model, loopback",
           "load_average_before_after": [round(x, 2) for x in (*load_before, *os.getloadavg())],
           "service": svc.command, "max_request_mb": args.max_request_mb,
           "summary": summary(records, normal, baseline),
           "after": {"canary_status": still[0], "canary_s": round(still[1], 4), "healthz": health,
                     "tracebacks_in_log": tracebacks},
           "kinds": records}
    Path(str(prefix) + ".json").write_text(json.dumps(doc, indent=1, ensure_ascii=True) + "\n")
    print("\n" + table(doc["summary"]))
    print(f"after the sweep: canary {still[0]} in {still[1]:.3f} s, /healthz {health}, "
          f"tracebacks in the service log: {tracebacks}")
    s = doc["summary"]
    return 0 if not (s["5xx"] or s["unclear"] or s["wrong_status"] or s["over_target"]) else 2


if __name__ == "__main__":
    sys.exit(main())
