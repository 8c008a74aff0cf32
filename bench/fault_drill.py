"""Fault drill: the tiny service under a real ``supervisord``, killed with ``kill -9`` (its whole process group)
in the middle of a streaming reply, again and again; what a user would check after each crash.

Usage (repository root; loopback only, CPU is enough, ``supervisord`` from the test install)::

    python bench/fault_drill.py                      # 20 crashes, about 10 minutes on 2 quiet cores
    python bench/fault_drill.py --crashes 5 --out bench/results/fault-short

It starts Supervisor with the deploy configs (``deploy/supervisord.conf`` + ``deploy/qwen3.5-9b.conf``, adapted
to a temporary folder, a free port and the tiny model: ``tests/support/service_harness.Supervisor``) and then,
``--crashes`` times: waits for ``/healthz`` 200 and Supervisor's RUNNING, starts a long reply through the page's
own ``/send`` event (``gradio_client``), waits until the reply has been checkpointed to the history folder with
some text, kills the service's process group with SIGKILL (the harshest crash: no handler runs) and times how
long until ``/healthz`` answers 200 again.  After each crash it checks the history folder: every conversation
file parses, no conversation saved before is missing, and the cut reply reads back ``interrupted`` with at least
the characters seen before the kill.  The crashes follow each other as soon as the service is healthy, so
they are also the "crashed right after it became healthy" case Supervisor must keep restarting (only exit 78
stops it).

Written to ``<out>.json``: per crash the seconds to RUNNING and to ``/healthz`` 200, the characters seen before
the kill and kept after it, and the check results; and a summary (crashes, recoveries within
``--recovery-limit-s``, worst recovery, corrupt and lost files).  A table is printed last.  Exit code 0 when
every crash recovered within the limit with no corrupt or lost file, 2 otherwise.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gradio_client import Client  # noqa: E402

from qwen_chat.history.store import HistoryStore  # noqa: E402
from tests.support.servers import free_port  # noqa: E402
from tests.support.service_harness import (  # noqa: E402
    Supervisor,
    conversation_ids,
    history_files,
    service_argv,
    ui_submit,
    wait_for_streaming_reply,
    wait_healthy,
)
from tests.support.waiting import wait_until  # noqa: E402

PROMPT = "Write a very long story about a lighthouse keeper."
#: Seconds any single wait may take before the drill reports the crash as not recovered.
WAIT_S = 240.0


def check_files(history: Path, before: set) -> tuple[int, list[str]]:
    """(number of conversation files that do not parse or lack the schema's top-level fields, ids of
    conversations in ``before`` that are gone)."""
    corrupt = 0
    for path in history_files(history):
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
            if not {"id", "messages", "revision"} <= data.keys():
                corrupt += 1
        except (OSError, ValueError):
            corrupt += 1
    lost = sorted(before - set(conversation_ids(history)))
    return corrupt, lost


def one_crash(sup: Supervisor, url: str, history: Path, index: int) -> dict:
    """Start a long reply, kill the service's group once the reply is checkpointed, wait for the recovery."""
    sup.wait_state(["RUNNING"], timeout_s=WAIT_S)
    wait_healthy(url, timeout_s=WAIT_S)
    before = set(conversation_ids(history))
    client = Client(url + "/", verbose=False)
    job = ui_submit(client, f"{PROMPT} ({index})")
    conv_id, seen_chars = wait_for_streaming_reply(history, timeout_s=WAIT_S, min_chars=20, ignore=frozenset(before))
    before.add(conv_id)
    pid = sup.pid()
    t0 = time.monotonic()
    os.killpg(pid, signal.SIGKILL)
    wait_until(lambda: sup.pid() not in (0, pid), WAIT_S, "Supervisor to start the service again")
    sup.wait_state(["RUNNING"], timeout_s=WAIT_S)
    running_s = time.monotonic() - t0
    wait_healthy(url, timeout_s=WAIT_S)
    healthy_s = time.monotonic() - t0
    try:
        job.cancel()
    except Exception:  # noqa: BLE001 - the job's connection died with the service
        pass
    corrupt, lost = check_files(history, before)
    reply = HistoryStore(history).user("local").load(conv_id).messages[-1]
    kept = len(reply.text) + len(reply.reasoning)
    return {"crash": index, "running_s": round(running_s, 2), "healthy_s": round(healthy_s, 2),
            "seen_chars": seen_chars, "kept_chars": kept, "reply_status": reply.status,
            "reply_kept": reply.status == "interrupted" and kept >= seen_chars,
            "corrupt_files": corrupt, "lost_conversations": lost, "files": len(history_files(history)),
            "load_average": round(os.getloadavg()[0], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crashes", type=int, default=20, help="kill -9 mid-stream this many times (default 20)")
    ap.add_argument("--recovery-limit-s", type=float, default=30.0,
                    help="a crash counts as recovered when /healthz is 200 again within this many seconds")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"{dt.date.today()}-cpu-fault-drill"),
                    help="output path without extension (.json is written)")
    args = ap.parse_args()
    cache = Path(os.environ.get("QWEN_CHAT_CACHE_DIR") or Path.home() / ".cache" / "qwen_chat")
    rows = []
    with tempfile.TemporaryDirectory(prefix="qwen-fault-drill-") as work:
        work = Path(work)
        port = free_port()
        history = work / "history"
        url = f"http://127.0.0.1:{port}"
        with Supervisor(work, service_argv(port, history, cache)) as sup:
            t0 = time.monotonic()
            wait_healthy(url, timeout_s=WAIT_S)
            first_start_s = time.monotonic() - t0
            for i in range(args.crashes):
                row = one_crash(sup, url, history, i)
                rows.append(row)
                print(f"crash {i:2d}: RUNNING {row['running_s']:6.1f} s, /healthz 200 {row['healthy_s']:6.1f} s, "
                      f"reply {row['reply_status']} {row['kept_chars']}/{row['seen_chars']} chars, "
                      f"corrupt {row['corrupt_files']}, lost {len(row['lost_conversations'])}, "
                      f"load {row['load_average']}", flush=True)
            gave_up = "gave up" in (sup.workdir / "supervisord.log").read_text()
    healthy = [r["healthy_s"] for r in rows]
    summary = {
        "crashes": len(rows), "first_start_s": round(first_start_s, 1),
        "recovered_within_limit": sum(1 for h in healthy if h <= args.recovery_limit_s),
        "recovery_limit_s": args.recovery_limit_s,
        "healthy_s_median": sorted(healthy)[len(healthy) // 2] if healthy else None,
        "healthy_s_max": max(healthy) if healthy else None,
        "replies_kept": sum(r["reply_kept"] for r in rows),
        "corrupt_files_max": max((r["corrupt_files"] for r in rows), default=0),
        "lost_conversations": sorted({c for r in rows for c in r["lost_conversations"]}),
        "supervisor_gave_up": gave_up,
    }
    record = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
              "command": "python bench/fault_drill.py " + " ".join(sys.argv[1:]), "summary": summary, "crashes": rows}
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    ok = (summary["recovered_within_limit"] == len(rows) and summary["replies_kept"] == len(rows)
          and summary["corrupt_files_max"] == 0 and not summary["lost_conversations"] and not gave_up)
    print(f"\nwritten {out}\n")
    print("| | result | target |\n|---|---|---|")
    print(f"| crashes (kill -9 of the process group mid-stream) | {len(rows)} | 20 |")
    print(f"| /healthz 200 again within {args.recovery_limit_s:.0f} s | {summary['recovered_within_limit']} of "
          f"{len(rows)} (median {summary['healthy_s_median']} s, worst {summary['healthy_s_max']} s) | all |")
    print(f"| cut replies kept, read back interrupted | {summary['replies_kept']} of {len(rows)} | all |")
    print(f"| corrupt files / lost conversations | {summary['corrupt_files_max']} / "
          f"{len(summary['lost_conversations'])} | 0 / 0 |")
    print(f"| Supervisor gave up (FATAL) | {gave_up} | no |")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
