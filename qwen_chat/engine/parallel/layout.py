"""The replica layout: how the launcher's ranks form data-parallel replicas.  No torch (app.py checks it before
the heavy imports, so a bad layout fails in about a second with one line).

``--data-parallel N`` (or ``$DATA_PARALLEL``) splits the launcher's world of W ranks into N replicas of
T = W / N ranks each.  Replica r is the ranks ``r*T .. r*T + T - 1``; its lowest rank is the replica's lead
(it runs the replica's scheduler); global rank 0, the lead of replica 0, also serves the web port.  The DeepSpeed
launcher numbers ranks host by host (hostfile order, then GPU order), so with T dividing the GPUs of each host a
replica never spans machines; with a larger T it spans them exactly as tensor parallel does today.

T comes from the DeepSpeed config: ``tensor_parallel.autotp_size`` when it is a number, W / N when it says
``"auto"`` or is absent (every ZeRO-3 config).  Each replica then runs that config over its own T ranks.

Usage::

    layout = ReplicaLayout.from_env(cfg.data_parallel, cfg.ds_config)   # LayoutError: one line
    layout.replica, layout.replica_rank, layout.is_lead, layout.ranks_of(1)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from qwen_chat.config import ConfigError


class LayoutError(ConfigError):
    """The launcher's world cannot be split into the replicas asked for (one line, meant for the operator)."""


def resolve_tp_size(setting: Any, group_size: int) -> int:
    """The tensor-parallel degree of ``tensor_parallel.autotp_size`` = ``setting``: the group's whole size
    (``group_size`` ranks) for ``"auto"`` or None, else the number itself.

    Raises: ValueError when ``setting`` is neither "auto", None nor an integer >= 1.
    """
    if setting in ("auto", None):
        return int(group_size)
    if isinstance(setting, bool) or not isinstance(setting, (int, str)) or not str(setting).isdigit() \
            or int(setting) < 1:
        raise ValueError(f"tensor_parallel.autotp_size must be \"auto\" or a whole number >= 1, got {setting!r}")
    return int(setting)


def configured_tp_setting(ds_config: Optional[Path]) -> Any:
    """``tensor_parallel.autotp_size`` of the DeepSpeed config file (None when absent, unreadable or ZeRO-3;
    ``sharding.read_plan`` reports an unreadable file itself)."""
    if ds_config is None:
        return None
    try:
        raw = json.loads(Path(ds_config).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or int((raw.get("zero_optimization") or {}).get("stage", 0) or 0) == 3:
        return None
    return (raw.get("tensor_parallel") or {}).get("autotp_size")


@dataclass(frozen=True)
class ReplicaLayout:
    """This process's place among the replicas.

    ``world_size``: ranks the launcher started (every machine).  ``rank``: this process's global rank.
    ``replicas``: N.  ``tp_size``: ranks per replica (T).  Derived: ``replica`` (this rank's replica),
    ``replica_rank`` (its rank inside the replica), ``lead_rank`` (the replica's lowest global rank).
    """

    world_size: int = 1
    rank: int = 0
    replicas: int = 1
    tp_size: int = 1

    @property
    def replica(self) -> int:
        return self.rank // self.tp_size

    @property
    def replica_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def lead_rank(self) -> int:
        return self.replica * self.tp_size

    @property
    def is_lead(self) -> bool:
        return self.replica_rank == 0

    def ranks_of(self, replica: int) -> range:
        """The global ranks of ``replica``."""
        return range(replica * self.tp_size, (replica + 1) * self.tp_size)

    @classmethod
    def from_env(cls, data_parallel: int, ds_config: Optional[Path],
                 env: Optional[Mapping[str, str]] = None) -> "ReplicaLayout":
        """The layout of ``data_parallel`` replicas over the launcher's world (``WORLD_SIZE``, ``RANK``;
        1 and 0 without a launcher), with T from ``ds_config`` (module docstring).

        Raises:
            LayoutError: the world is not N replicas of T ranks (not a multiple of T or of N, fewer ranks than
                replicas, a fixed ``autotp_size`` whose N x T differs from the world), or ``autotp_size`` is
                not a number.
        """
        env = os.environ if env is None else env
        world, rank, n = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0")), int(data_parallel)
        setting = configured_tp_setting(ds_config)
        try:
            fixed = None if setting in ("auto", None) else resolve_tp_size(setting, world)
        except ValueError as exc:
            raise LayoutError(f"{ds_config}: {exc}") from None
        if fixed is not None:
            if world % fixed:
                raise LayoutError(f"the launcher started {world} rank(s), not a multiple of the tensor-parallel "
                                  f"degree {fixed} (tensor_parallel.autotp_size in {ds_config})")
            if world != n * fixed:
                raise LayoutError(f"the launcher started {world} rank(s), but --data-parallel {n} x tensor-parallel "
                                  f"degree {fixed} = {n * fixed}; pass --data-parallel {world // fixed} (or "
                                  f"DATA_PARALLEL), or start {n * fixed} ranks (NUM_GPUS)")
        elif world < n:
            raise LayoutError(f"--data-parallel {n} needs at least {n} ranks (one GPU each), but the launcher "
                              f"started {world}; lower it or start more ranks (NUM_GPUS, NUM_CPU_RANKS, HOSTFILE)")
        elif world % n:
            raise LayoutError(f"the launcher started {world} ranks, which do not split into {n} replicas of equal "
                              f"size; start a multiple of {n} ranks (NUM_GPUS) or change --data-parallel")
        return cls(world_size=world, rank=rank, replicas=n, tp_size=world // n)

    def describe(self, places: Mapping[int, str]) -> list[str]:
        """One start-up log line per replica, e.g. ``replica 1: ranks 2, 3 (gpu-a cuda:2, gpu-a cuda:3); lead
        rank 2``; ``places`` maps each global rank to where it runs (host and device)."""
        lines = []
        for r in range(self.replicas):
            ranks = self.ranks_of(r)
            where = ", ".join(places.get(g, "?") for g in ranks)
            lines.append(f"replica {r}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ({where}); "
                         f"lead rank {ranks[0]}" + ("; serves the web port" if r == 0 else ""))
        return lines
