"""The packed prefill's indexes (``prefill_meta.pack``): one host-to-device copy whose pieces each start aligned,
so that kernels taking them (the fused conv, fla's varlen kernels) are not compiled again for a new alignment
when a step's token or chunk counts change."""
import torch

from qwen_chat.engine.model.prefill_meta import ALIGN, PrefillRows, pack


def _rows(specs):
    """PrefillRows for (slot, start, n) chunks packed one after another, KV rows 100 * slot + position."""
    out, offset = [], 0
    for slot, start, n in specs:
        out.append(PrefillRows(slot, start, n, offset, torch.arange(start + n) + 100 * slot, logits=True))
        offset += n
    return out


def test_every_index_starts_aligned_and_keeps_its_values():
    for specs in ([(0, 0, 7)], [(0, 0, 5), (1, 3, 9), (2, 0, 1)], [(3, 8, 4), (1, 0, 13)]):
        seqs, meta = pack(_rows(specs), K=4, device=torch.device("cpu"))
        base = seqs[0].rows.untyped_storage().data_ptr()
        tensors = [sq.rows for sq in seqs] + [v for v in meta.values() if isinstance(v, torch.Tensor)
                                              and v.dtype == torch.long and v.numel()]
        for t in tensors:
            if t.untyped_storage().data_ptr() == base:  # a piece of the one copy
                assert (t.data_ptr() - base) % (ALIGN * 8) == 0
        for sq, (slot, start, n) in zip(seqs, specs):
            assert torch.equal(sq.rows, torch.arange(start + n) + 100 * slot)
        T = sum(n for _, _, n in specs)
        assert torch.equal(meta["tok_pos"], torch.cat([torch.arange(n) for _, _, n in specs]))
        assert torch.equal(meta["tok_chunk"], torch.cat([torch.full((n,), j) for j, (_, _, n) in enumerate(specs)]))
        assert torch.equal(meta["slots"], torch.tensor([s for s, _, _ in specs]))
        assert torch.equal(meta["chunk_start"], torch.tensor([st for _, st, _ in specs]))
        assert torch.equal(meta["past"], torch.tensor([st > 0 for _, st, _ in specs]))
        assert meta["take"].numel() == T
