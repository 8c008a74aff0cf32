"""Speculative decoding's verify step: one target forward over k + 1 tokens per sequence, and the exact state
after partial acceptance.

A verify step feeds each sequence its last sampled token followed by k draft tokens (T = k + 1 rows per
sequence, at positions L .. L + k, where L is the slot's length).  Every projection, norm, MLP and the lm_head
runs once over all B x T rows (the weights are read once, as in a decode step of B x T rows); the attention
layers write the T keys and values and attend causally per row (row j sees positions <= L + j), exactly as T
decode rows of one sequence; the Gated DeltaNet layers, whose conv and recurrent state are sequential, run
their core token by token (T calls of the decode step's core on B rows each), between the shared projections.

**Exact state after partial acceptance: per-position states are kept.**  After the token of position j < k the
core copies each sequence's Gated DeltaNet conv ring and recurrent state into a snapshot buffer
(``SpecBuffers``); the state after the last position stays in the slot.  When a of the k drafts are accepted,
the slot must end after position L + a: ``Verifier.restore`` copies snapshot a back into the slot (nothing when
a = k), queued on the device from the device's counts, and ``Verifier.advance`` sets the slot's length to
L + a + 1 once the host has them.  Keys and values of the rejected positions need no undo: they
lie past the slot's length, attention never reads past a row's own position, and the next step overwrites them.
Why snapshots rather than recomputing: recomputing the accepted prefix would cost a second forward (a weight
read) per step whenever anything is rejected, which at the acceptance rates of a depth-1 to depth-3 MTP head
(about 60-90 %) is most steps; the snapshots cost a copy of the state per verified position (48 MiB per
sequence and position for Qwen3.5-9B in fp32, docs/speculative.md), far less than a weight read at the small
batches where speculation pays.

Formulas: as ``forward.ModelForward.decode`` (transformers ``modeling_qwen3_5.py``), whose helpers this module
calls.  Used by ``core``'s speculative steps through ``parallel.executors.LocalExecutor``.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from qwen_chat.chat_types import ContextTooLong
from qwen_chat.engine.model import gdn, graphs
from qwen_chat.engine.model.forward import ModelForward


def device_ints(values, device: torch.device) -> torch.Tensor:
    """int64 tensor of ``values`` (nested int lists) on ``device`` without waiting for the device: on CUDA
    through pinned memory and an asynchronous copy (a plain copy from pageable memory makes the host wait for
    the whole stream, which would keep the host from queueing a speculative step's kernels while the GPU runs)."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SpecBuffers:
    """Snapshot buffers of the Gated DeltaNet state for the verified positions but the last.

    Args: forward (the runner's ``ModelForward``: its layer kinds, conv and recurrent state), ``rows`` (sequences a
    verify step holds at most), ``positions`` (snapshots per sequence: T - 1 = k).
    Attributes: ``conv``/``rec``: layer index -> [positions, rows, ...] (the slot tensors' dtypes and shapes).
    """

    def __init__(self, forward: ModelForward, rows: int, positions: int) -> None:
        self.rows, self.positions = int(rows), int(positions)
        self.conv = {i: torch.zeros((self.positions, self.rows) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                     for i, t in forward.conv_state.items()}
        self.rec = {i: torch.zeros((self.positions, self.rows) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                    for i, t in forward.rec_state.items()}


def verify_forward(fwd: ModelForward, slot_idx: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                   rope_pos: torch.Tensor, ctx: int, T: int, snaps: SpecBuffers) -> torch.Tensor:
    """The verify forward of B sequences x T tokens.

    slot_idx/tokens/pos/rope_pos: int64 [B * T] on the device, sequence-major (row b * T + j is sequence b's
    token j, at position pos[b * T] + j); ctx: the attention window (a multiple of the block size, covering every
    row's position).  Writes each row's keys and values, leaves each slot's Gated DeltaNet state after its last
    row and the states after rows 0 .. T - 2 in ``snaps`` (sequence b at index b).  Returns fp32 [B * T, V + H]:
    each row's logits, then its final normed hidden state (the MTP head's input).  Tensor ops only.
    """
    return fwd.decode_rows(slot_idx, tokens, pos, rope_pos, ctx, eager_write=True, with_hidden=True,
                           linear=lambda i, la, x: _linear_verify(fwd, i, la, slot_idx, pos, x, T, snaps))


def _linear_verify(fwd: ModelForward, i: int, la, slot_idx: torch.Tensor, pos: torch.Tensor, x: torch.Tensor,
                   T: int, snaps: SpecBuffers) -> torch.Tensor:
    """A Gated DeltaNet layer over B x T verify rows: projections once, the core token by token (the decode
    step's core: ``gdn.gdn_decode`` or ``glue.gdn_step``), snapshots after every token but the last."""
    g = fwd._geo[i]
    qkv, z, b, a = fwd._project(i, "mix", x)
    B = x.shape[0] // T
    slots = slot_idx.view(B, T)[:, 0].contiguous()  # the GDN kernel reads slot and position rows densely
    conv, rec = fwd.conv_state[i], fwd.rec_state[i]
    cores = []
    for j in range(T):
        qkv_j, z_j, b_j, a_j = (t.view(B, T, -1)[:, j].contiguous() for t in (qkv, z, b, a))
        pos_j = pos.view(B, T)[:, j].contiguous()
        if fwd._opts.gdn_kernel:
            core = gdn.gdn_decode(qkv_j, z_j, b_j, a_j, conv, rec, slots, pos_j, la.conv1d.weight[:, 0, :], la.A_log,
                                  la.dt_bias, la.norm.weight, la.norm.variance_epsilon, g["key_dim"], g["dk"],
                                  g["dv"])
        else:
            core = fwd._glue["gdn_step"](qkv_j, z_j, b_j, a_j, conv, rec, slots, pos_j, la.conv1d.weight[:, 0, :],
                                         la.A_log, la.dt_bias, la.norm, la.activation, g["key_dim"], g["dk"], g["dv"])
        cores.append(core)
        if j < T - 1:  # one gather kernel each, straight into the snapshot buffer
            torch.index_select(conv, 0, slots, out=snaps.conv[i][j, :B])
            torch.index_select(rec, 0, slots, out=snaps.rec[i][j, :B])
    core = torch.stack(cores, dim=1).reshape(B * T, -1)
    return fwd.tp.linear(la.out_proj, core)


def _graph_step(fwd: ModelForward, T: int, snaps: SpecBuffers, slot_idx: torch.Tensor, tokens: torch.Tensor,
                pos: torch.Tensor, rope_pos: torch.Tensor, ctx: int) -> torch.Tensor:
    """``verify_forward`` in the shape of ``graphs.DecodeStep`` (what ``graphs.CudaGraphs`` captures)."""
    return verify_forward(fwd, slot_idx, tokens, pos, rope_pos, ctx, T, snaps)


class Verifier:
    """The verify step of one ``ModelRunner`` (see the module docstring).

    Args: runner (``ModelRunner``), ``max_batch`` (sequences one verify step holds at most), ``k`` (draft tokens
    per sequence at most, >= 1).  Raises ValueError for ``max_batch`` or ``k`` < 1.
    """

    def __init__(self, runner, *, max_batch: int, k: int) -> None:
        if max_batch < 1 or k < 1:
            raise ValueError(f"a verifier needs max_batch >= 1 and k >= 1 (got {max_batch}, {k})")
        self.runner, self.max_batch, self.k = runner, int(max_batch), int(k)
        #: sequences a step is padded to (the decode graphs' batch ladder up to max_batch)
        self.padded = graphs.graph_batch_sizes(self.max_batch)
        self._snaps: dict[int, SpecBuffers] = {}  # k -> buffers (allocated on first use of that k)
        self._graphs: dict[int, graphs.CudaGraphs] = {}  # T -> verify graphs (CUDA graphs only)
        self._pending: tuple[list[int], int] | None = None

    def snapshots(self, k: int) -> SpecBuffers:
        """The snapshot buffers for verify steps with ``k`` drafts (allocated on first use; rows for the largest
        padded batch)."""
        if k not in self._snaps:
            self._snaps[k] = SpecBuffers(self.runner._forward, self.padded[-1], k)
        return self._snaps[k]

    def graphs_for(self, T: int) -> graphs.CudaGraphs | None:
        """The CUDA graphs of verify steps with T tokens per sequence (rows T x the padded batch sizes), or None
        when the runner captures no graphs."""
        r = self.runner
        if r.graphs is None:
            return None
        if T not in self._graphs:
            step = functools.partial(_graph_step, r._forward, T, self.snapshots(T - 1))
            self._graphs[T] = graphs.CudaGraphs(device=r.device, scratch_slot=r.num_slots, decode_step=step,
                                                ladder=[T * b for b in self.padded])
        return self._graphs[T]

    def capture(self, context_buckets: Sequence[int]) -> int:
        """Capture the verify graphs of ``self.k`` drafts (the scheduler's) for every padded batch and the context
        buckets given, ahead of serving (others are captured on first use).  Returns the verify graphs held (0
        without CUDA graphs)."""
        g = self.graphs_for(self.k + 1)
        if g is None:
            return 0
        for b in self.padded:
            for ctx in context_buckets:
                g.capture_decode((self.k + 1) * b, ctx)
        return g.count()

    def prepare(self, slots: Sequence[int], T: int) -> None:
        """Check a verify step of ``slots`` x T tokens and give each slot the KV blocks its length + T needs
        (the drafter writes its chained positions there first).  Raises as ``verify``."""
        r = self.runner
        slots = [int(s) for s in slots]
        B = len(slots)
        if not 2 <= T <= self.k + 1:
            raise ValueError(f"verify takes 2..{self.k + 1} tokens per sequence, got {T}")
        if not 0 < B <= self.max_batch or len(set(slots)) != B:
            raise ValueError(f"verify needs 1..{self.max_batch} distinct slots, got {slots}")
        for s in slots:
            r._check_slot(s)
            if not r._active[s]:
                raise ValueError(f"slot {s} is not prefilled")
            if r.lengths[s] + T > r.max_context:
                raise ContextTooLong(f"sequence in slot {s} cannot take {T} more tokens within the context of "
                                     f"{r.max_context}", r.lengths[s], r.max_context)
        r.tables.ensure_all([(s, r.lengths[s] + T) for s in slots])
        r.tables.flush()

    @torch.no_grad()
    def verify(self, slots: Sequence[int], tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Feed each slot its row of ``tokens`` (int64 [B, T]: the last sampled token, then T - 1 drafts) in one
        forward.  The slots' lengths stay until ``accept`` (or ``restore`` then ``advance``), which must follow
        before any other call.

        Returns (logits fp32 [B, T, V], hidden fp32 [B, T, H] (final normed hidden state of each row), each
        slot's length before the step (its first row's position)).  Raises ValueError for empty, duplicate or
        unprefilled slots, more than ``max_batch`` of them, T - 1 outside 1..k or a shape mismatch;
        ContextTooLong when a slot cannot hold T more tokens; ``paged.OutOfBlocks`` when the blocks run out."""
        r = self.runner
        slots = [int(s) for s in slots]
        B = len(slots)
        if tokens.dim() != 2 or tokens.shape[0] != B:
            raise ValueError(f"verify needs tokens [{B}, T], got {tuple(tokens.shape)}")
        T = int(tokens.shape[1])
        self.prepare(slots, T)
        start = [r.lengths[s] for s in slots]
        pos = [p + j for p in start for j in range(T)]
        rope = [p + r.rope_deltas[s] + j for p, s in zip(start, slots) for j in range(T)]
        rows = [s for s in slots for _ in range(T)]
        dev = r.device
        idx = device_ints([rows, pos, rope], dev) if r.graphs is None else None
        ctx = r.context_bucket(max(start) + T)
        flat = tokens.to(dev, torch.long).reshape(-1)
        g = self.graphs_for(T)
        if g is not None:
            out = g.decode(rows, flat, pos, rope, ctx)
        else:
            out = verify_forward(r._forward, idx[0], flat, idx[1], idx[2], ctx, T, self.snapshots(T - 1))
        V = r.vocab_size
        self._pending = (slots, T)
        return out[:, :V].view(B, T, V), out[:, V:].view(B, T, -1), start

    @torch.no_grad()
    def restore(self, counts: torch.Tensor) -> None:
        """Queue the exact state after the last ``verify``: sequence b keeps ``counts[b]`` (int64 [B] on the
        device, 1..T) of its T verified tokens, so its Gated DeltaNet state becomes snapshot ``counts[b] - 1``
        (rows that kept all T stay as the forward left them: their copy goes to the scratch slot).  No host
        wait: launched before the host learns the counts; ``advance`` then sets the lengths.  Raises ValueError
        without a pending verify."""
        r = self.runner
        if self._pending is None:
            raise ValueError("restore must follow a verify")
        slots, T = self._pending
        B = len(slots)
        snaps = self.snapshots(T - 1)
        counts = counts.to(r.device, torch.long)
        slot_t = device_ints(slots, r.device)
        dst = torch.where(counts < T, slot_t, torch.full_like(slot_t, r.num_slots))
        j = (counts - 1).clamp(max=T - 2)
        b = torch.arange(B, device=r.device)
        for i in snaps.rec:
            r.conv_state[i].index_copy_(0, dst, snaps.conv[i][j, b])
            r.rec_state[i].index_copy_(0, dst, snaps.rec[i][j, b])

    def advance(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """End the verify step of ``slots`` on the host: slot b's length grows by ``counts[b]`` (the counts given
        to ``restore``).  Raises ValueError when the slots are not those of the last ``verify`` or a count is
        outside 1..T."""
        r = self.runner
        slots = [int(s) for s in slots]
        if self._pending is None or self._pending[0] != slots or len(counts) != len(slots):
            raise ValueError("advance must follow the verify of the same slots")
        T = self._pending[1]
        counts = [int(c) for c in counts]
        if any(not 1 <= c <= T for c in counts):
            raise ValueError(f"accepted counts {counts} outside 1..{T}")
        self._pending = None
        for s, c in zip(slots, counts):
            r.lengths[s] += c

    def accept(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """``restore`` and ``advance`` with the counts on the host (int list, 1..T each).  Raises as ``advance``
        (before any state changes)."""
        if self._pending is None or self._pending[0] != [int(s) for s in slots] or len(counts) != len(slots):
            raise ValueError("accept must follow the verify of the same slots")
        if any(not 1 <= int(c) <= self._pending[1] for c in counts):
            raise ValueError(f"accepted counts {list(counts)} outside 1..{self._pending[1]}")
        self.restore(device_ints(counts, self.runner.device))
        self.advance(slots, counts)
