"""Data-parallel replicas at start-up: one rendezvous for the launcher's whole world, then one
``torch.distributed`` world per replica, and the address of the web front's link.

Every replica is a complete engine of its own (``layout.ReplicaLayout``): its T ranks form their own
``torch.distributed`` world (default group, gloo control and start-up groups: ``ranks.init_process_groups``),
so its tensor-parallel collectives, plan broadcasts, heartbeats and self-check never involve another replica and
replicas never wait on each other.  Inside a replica every rank sees itself as rank ``replica_rank`` of
``tp_size`` (``join`` sets ``RANK`` and ``WORLD_SIZE`` to those values, so ``RankInfo.from_env``, DeepSpeed and
the whole single-replica code path run unchanged; log lines carry ``[replica R rank G]``, G the global rank);
``LOCAL_RANK`` (the GPU) stays the launcher's.

The rendezvous is one ``TCPStore`` at the launcher's ``MASTER_ADDR:MASTER_PORT``, hosted by global rank 0
(under torchrun its agent's store); each replica's process groups use it through a ``PrefixStore`` of their
own, so no further port is needed for them.  The same store carries each rank's place (host, device) for the
start-up log and the address and key of the front's link (``replica_link``): rank 0 listens on an
ephemeral port of ``MASTER_ADDR``, the other replicas' leads connect to it (an HMAC challenge with a random
32-byte key refuses anyone else; the key travels in the store, which is as trusted as the launcher's own
rendezvous).

Usage (``bootstrap.start_engine``, every rank)::

    world = join(layout)                      # before RankInfo.from_env
    world.announce(device)                    # rank 0 logs the layout
    groups = init_process_groups(info, device, timeout, store=world.replica_store)
    listener = world.open_front()             # rank 0;  conn = world.connect_front()  on the other leads
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from qwen_chat.engine.parallel.layout import ReplicaLayout
from qwen_chat.engine.parallel.ranks import STARTUP_TIMEOUT_S

log = logging.getLogger(__name__)

#: Key prefix of everything this service keeps in the launcher's store (apart from torch's own keys).
STORE_PREFIX = "qwen_chat/"


class ReplicaWorld:
    """A rank's share of a multi-replica start: the ``layout``, the launcher-wide ``store`` and the
    ``replica_store`` (a ``PrefixStore`` of this rank's replica) its process groups are built on."""

    def __init__(self, layout: ReplicaLayout, store: dist.Store) -> None:
        self.layout = layout
        self.store = store
        self.replica_store = dist.PrefixStore(f"{STORE_PREFIX}replica{layout.replica}/", store)

    def announce(self, device: torch.device) -> None:
        """Publish where this rank runs (host, device); rank 0 waits for every rank's and logs the layout, one
        line per replica (``ReplicaLayout.describe``).  Every rank calls it once, right after picking its device."""
        layout = self.layout
        self.store.set(f"{STORE_PREFIX}place/{layout.rank}", f"{socket.gethostname()} {device}")
        if layout.rank != 0:
            return
        places = {g: self.store.get(f"{STORE_PREFIX}place/{g}").decode() for g in range(layout.world_size)}
        log.info("data parallel: %d replicas x %d rank(s) each (world %d)", layout.replicas, layout.tp_size,
                 layout.world_size)
        for line in layout.describe(places):
            log.info("%s", line)

    def open_front(self) -> Listener:
        """Rank 0: listen for the other replicas' leads on an ephemeral port of ``MASTER_ADDR`` and publish its
        address and key.  Returns the ``Listener`` (``replica_link.accept_leads`` takes it)."""
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        key = secrets.token_bytes(32)
        listener = Listener((host, 0), backlog=max(8, self.layout.replicas), authkey=key)
        bound_host, port = listener.address
        self.store.set(f"{STORE_PREFIX}front", f"{bound_host} {port}")
        self.store.set(f"{STORE_PREFIX}front_key", key.hex())
        log.info("replica link: rank 0 listens on %s:%d for %d replica lead(s)", bound_host, port,
                 self.layout.replicas - 1)
        return listener

    def connect_front(self) -> Connection:
        """A lead of replica >= 1: connect to rank 0's link (waits, up to the start-up timeout, until rank 0
        published it).  Raises OSError or ``multiprocessing.AuthenticationError`` when that fails."""
        host, port = self.store.get(f"{STORE_PREFIX}front").decode().split()
        key = bytes.fromhex(self.store.get(f"{STORE_PREFIX}front_key").decode())
        return Client((host, int(port)), authkey=key)


def join(layout: ReplicaLayout, env: Optional[Mapping[str, str]] = None) -> ReplicaWorld:
    """Meet every rank of the launcher at ``MASTER_ADDR:MASTER_PORT`` (global rank 0 hosts the store unless
    torchrun's agent does) and make this process a rank of its replica's own world (module docstring).

    Raises: whatever ``TCPStore`` raises (port busy on rank 0; no rank 0 within ``ranks.STARTUP_TIMEOUT_S``).
    """
    env = os.environ if env is None else env
    host, port = env.get("MASTER_ADDR") or "127.0.0.1", int(env.get("MASTER_PORT") or 29500)
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, layout.world_size, is_master=layout.rank == 0 and not agent_store,
                          timeout=timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)
    os.environ["RANK"] = str(layout.replica_rank)
    os.environ["WORLD_SIZE"] = str(layout.tp_size)
    _tag_log_lines(layout)
    return ReplicaWorld(layout, store)


def _tag_log_lines(layout: ReplicaLayout) -> None:
    """Put ``[replica R rank G]`` into every log line of this process: inside a replica the ranks are numbered
    from 0 again, and all replicas write into the launcher's one output."""
    tag = f"[replica {layout.replica} rank {layout.rank}]"
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag} %(name)s: %(message)s"))
