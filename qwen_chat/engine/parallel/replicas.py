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
start-up log and the address and secret of the web front's link (``core.link`` / ``engine_client``): the
front binds it on ``MASTER_ADDR``, every replica's lead connects to it (a hello without the secret is
ignored; the secret travels in the store, which is as trusted as the launcher's own rendezvous).

Usage (``bootstrap.start_engine``, every rank)::

    world = join(layout)                      # before RankInfo.from_env
    world.announce(device)                    # rank 0 logs the layout
    groups = init_process_groups(info, device, timeout, store=world.replica_store)
    world.publish_link(address, token)        # rank 0;  world.link()  on the other leads
"""
from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
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

    def publish_link(self, address: str, token: str) -> None:
        """Rank 0: publish the web front's link (its address and secret) for the other replicas' leads."""
        self.store.set(f"{STORE_PREFIX}front", address)
        self.store.set(f"{STORE_PREFIX}front_key", token)
        log.info("engine link: the web front listens on %s for %d engine process(es)", address,
                 self.layout.replicas)

    def link(self) -> tuple[str, str]:
        """A lead of replica >= 1: the front's link ``(address, token)`` (waits, up to the start-up timeout,
        until rank 0 published it)."""
        return self.store.get(f"{STORE_PREFIX}front").decode(), self.store.get(f"{STORE_PREFIX}front_key").decode()

    @staticmethod
    def engine_host() -> str:
        """Where this lead's engine input socket binds: loopback when the launcher's ``MASTER_ADDR`` is (one
        machine), else this host's address (the front connects to it)."""
        master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        if master in ("127.0.0.1", "localhost", "::1"):
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())


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
