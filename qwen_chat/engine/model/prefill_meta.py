"""Where the prompt chunks of one packed prefill sit (``PrefillRows``), and every index the packed forward needs
on the device, built on the host and sent in one copy (``pack``)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch

from qwen_chat.engine.model import delta_rule


@dataclass
class PrefillRows:
    """Where one prompt chunk (``types.PrefillItem``) sits in a packed prefill: ``slot``; ``start``: positions already in the slot's cache
    (0 for a new prompt); ``n``: tokens of this chunk (positions start..start+n-1); ``offset``: its first row
    in the packed tokens; ``rows``: int64 [start + n] flat KV-cache rows of positions 0..start+n-1 (device);
    ``logits``: whether the logits of its last token are wanted.  ``rows`` may be given on the host: the prefill
    sends every chunk's rows and its own indexes to the device in one copy (``pack``).  ``keeps``: per
    keep point, in position order, (tokens of the chunk before it (1..n), state row): the Gated DeltaNet conv
    and recurrent state at position start + keep are also written into that row (``delta_rule``,
    ``prefix_cache``)."""

    slot: int
    start: int
    n: int
    offset: int
    rows: torch.Tensor
    logits: bool
    keeps: tuple[tuple[int, int], ...] = ()


#: Each index starts a multiple of this many int64 entries (128 bytes) into the one device copy: Triton
#: compiles a kernel variant per 16-byte alignment of each pointer argument, so indexes at offsets that follow
#: the step's token and chunk counts made the fused conv (and fla's kernels, through ``cu``) compile again, about
#: 0.7 s each, in steps of bursts long after start-up (measured on an H200 by ``bench/burst_probe.py``).
ALIGN = 16


def pack(seqs: Sequence[PrefillRows], K: int, device: torch.device) -> tuple[list[PrefillRows], dict]:
    """Every index the packed prefill needs on the device, sent in one copy (a host tensor sent on its own
    would make the host wait for the device each time): each chunk's KV rows; ``slots`` int64 [N]; ``past``
    bool [N] (the chunk continues its slot); for ``_conv_prefill`` (every Gated DeltaNet layer uses the same):
    ``ext_src`` int64 [sum(n + K - 1)], the conv input's columns (chunk j's K - 1 ring inputs, appended after
    the T packed tokens at T + j (K - 1), then its n tokens), ``take`` int64 [T], the conv output column of each
    token, ``ring_src`` int64 [N, K] its last K input columns, ``prev_cols`` int64 [N, K - 1] and ``ring_cols``
    int64 [N, K], the ring columns of the K - 1 inputs before each chunk and of its last K; ``last`` int64
    [m], the packed row of the last token of each chunk whose logits are wanted; for keep points
    (``PrefillRows.keeps``, chunk by chunk) ``keep_rows`` int64 [k], ``keep_ext`` int64 [k, K] (the conv input
    columns of the K inputs before each keep point) and ``keep_cols`` int64 [k, K] (their ring columns);
    ``seg`` (``delta_rule.Segments``) and its index (``delta_rule.host_index``: ``cu`` the bounds, ...).  For
    the fused conv (``prefill_kernels``): ``tok_chunk``, ``tok_pos`` int64 [T] (each packed token's chunk and
    its index in it), ``chunk_start`` int64 [N] (each chunk's ``start``), and ``ring_idx`` int64 [N K],
    ``keep_idx`` int64 [k K]: the inputs each chunk's ring and each keep point's ring take, as rows of the T
    packed tokens followed by the N (K - 1) inputs before the chunks (``ext_src`` composed with ``ring_src``,
    ``keep_ext``).  Every index tensor starts ``ALIGN``-aligned in the device copy.  K: the Gated DeltaNet conv's
    kernel size (1 when the model has none)."""
    T = max(sq.offset + sq.n for sq in seqs)
    take, keep_ext, keep_cols, ext_src, ring_src, e = [], [], [], [], [], 0
    for j, sq in enumerate(seqs):
        take.append(torch.arange(e, e + sq.n))
        ext_src += [torch.arange(T + j * (K - 1), T + (j + 1) * (K - 1)), torch.arange(sq.offset, sq.offset + sq.n)]
        ring_src.append(torch.arange(e + sq.n - 1, e + sq.n + K - 1))
        for keep, _ in sq.keeps:
            keep_ext.append(torch.arange(e + keep - 1, e + keep - 1 + K))
            keep_cols.append(torch.arange(sq.start + keep - K, sq.start + keep) % K)
        e += sq.n + K - 1
    seg = delta_rule.segments([(sq.offset, sq.n, tuple(k for k, _ in sq.keeps)) for sq in seqs])
    index = delta_rule.host_index(seg)
    last = torch.tensor([sq.offset + sq.n - 1 for sq in seqs if sq.logits], dtype=torch.long)
    prev_cols = torch.stack([torch.arange(sq.start - K + 1, sq.start) for sq in seqs]) % K
    ring_cols = torch.stack([torch.arange(sq.start + sq.n - K, sq.start + sq.n) for sq in seqs]) % K
    nk = len(keep_ext)
    ext_all = torch.cat(ext_src)
    tok_chunk, tok_pos = torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long)
    for j, sq in enumerate(seqs):
        tok_chunk[sq.offset:sq.offset + sq.n] = j
        tok_pos[sq.offset:sq.offset + sq.n] = torch.arange(sq.n)
    named = dict(
        slots=torch.tensor([sq.slot for sq in seqs]), past=torch.tensor([int(sq.start > 0) for sq in seqs]),
        take=torch.cat(take), last=last, prev_cols=prev_cols.reshape(-1), ring_cols=ring_cols.reshape(-1),
        ext_src=ext_all, ring_src=torch.cat(ring_src),
        keep_rows=torch.tensor([row for sq in seqs for _, row in sq.keeps], dtype=torch.long),
        keep_ext=torch.cat(keep_ext) if nk else torch.zeros(0, dtype=torch.long),
        keep_cols=torch.cat(keep_cols) if nk else torch.zeros(0, dtype=torch.long),
        tok_chunk=tok_chunk, tok_pos=tok_pos, chunk_start=torch.tensor([sq.start for sq in seqs]),
        ring_idx=ext_all[torch.cat(ring_src)],
        keep_idx=ext_all[torch.cat(keep_ext)] if nk else torch.zeros(0, dtype=torch.long), **index)
    parts = [sq.rows.cpu() for sq in seqs] + list(named.values())
    sizes = [p.numel() for p in parts]
    starts = [0, *accumulate(-(-size // ALIGN) * ALIGN for size in sizes)]
    flat = torch.zeros(starts[-1], dtype=torch.long)
    for p, at, size in zip(parts, starts, sizes):
        flat[at:at + size] = p.reshape(-1)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    pieces = [flat[at:at + size] for at, size in zip(starts, sizes)]
    seqs = [PrefillRows(sq.slot, sq.start, sq.n, sq.offset, rows, sq.logits, sq.keeps)
            for sq, rows in zip(seqs, pieces)]
    n = len(seqs)
    meta = dict(zip(named, pieces[n:]), seg=seg)
    meta.update(past=meta["past"].bool(), prev_cols=meta["prev_cols"].view(n, K - 1),
                ring_cols=meta["ring_cols"].view(n, K), keep_ext=meta["keep_ext"].view(nk, K),
                keep_cols=meta["keep_cols"].view(nk, K))
    meta.update(delta_rule.host_bounds(index))
    return seqs, meta
