"""Collectives of the tensor-parallel decode step: the all-reduce after each row-parallel projection, the
all-gather of the vocabulary-split logits, and the broadcast that gives every rank rank 0's sampled tokens.

At batch 1 a TP=2 decode step of the 9B runs 65 all-reduces of one hidden row (4,096 bf16 = 8 KiB): after the
vocabulary-split embedding and after each of the 64 row-parallel projections (24 Gated DeltaNet ``out_proj``,
8 ``o_proj``, 32 ``down_proj``; ``qwen_chat.engine.parallel.tp_layers``), and one all-gather of the lm_head's
logits.  Such small messages are bound by latency, not bandwidth, so the kernels that do them matter:

- ``symm_mem``: PyTorch's symmetric-memory one-shot all-reduce (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``,
  ``torch.distributed._symmetric_memory``): each rank copies its partial sums into a buffer that every peer maps
  over NVLink, and one kernel reads all peers' buffers and adds them.  No NVLink multicast is used (the GPU hosts
  here must run with it off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).  Used for messages up to
  ``SYMM_MEM_MAX_BYTES``;
- fused (Triton, on the same kind of memory): the projection writes its partial result straight into a staging
  slot (``staging``), and one kernel meets the peers, sums, adds the residual and applies the next RMSNorm
  (``all_reduce_add_norm``), or gathers the logits as fp32 (``all_gather_staged``);
- ``torch.distributed``: ``torch.distributed.all_reduce`` (NCCL on CUDA, gloo on CPU), for everything else and
  as the fallback when symmetric memory cannot be set up (CPU, no P2P access, an older PyTorch).

``TensorParallelComm(group, device, dtype)`` picks symmetric memory at construction (``backend="auto"``) after
checking it and the fused kernels against known results, and every rank agrees on the choice;
``backend="nccl"`` forces ``torch.distributed`` and ``fused=False`` turns the fused kernels off (the service's
``ServiceConfig.tp_allreduce`` and ``tp_fused``: ``--tp-allreduce``, ``--no-tp-fused``).  All of them can be
captured in a CUDA graph.  Measured on 2 x H200: docs/performance.md ("Tensor parallel on 2 x H200").  The
decode step calls them through ``qwen_chat.engine.parallel.tp_decode``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

try:  # Triton ships with CUDA builds of PyTorch; without it the fused all-reduce + RMSNorm is not offered.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the host
    triton = None

log = logging.getLogger(__name__)

#: Largest all-reduce (bytes) sent through symmetric memory; larger ones go to NCCL.  32 rows of the 9B's
#: 4,096-wide hidden state in bf16 = 256 KiB (the decode batches the service runs at most).
SYMM_MEM_MAX_BYTES = 256 * 1024

#: Largest decode batch (rows) whose all-reduce can be fused with the residual add and RMSNorm.
FUSED_MAX_ROWS = 32

#: Flag ranges on the signal pad of the staging allocation (each flag is set by the peer once per meeting and
#: cleared by its waiter): all-reduce start flags of slot 0 and slot 1 (FUSED_MAX_ROWS each), all-reduce end
#: flags, then gather start and end flags (GATHER_FLAGS each).
_AR_END = 2 * FUSED_MAX_ROWS
GATHER_FLAGS = 64
_GATHER_START = 3 * FUSED_MAX_ROWS
_GATHER_END = _GATHER_START + GATHER_FLAGS
#: Elements per program of the gather kernel.
GATHER_BLOCK = 4096

#: The all-reduce kinds ``TensorParallelComm(backend=)`` takes: symmetric memory when it works here, else
#: ``torch.distributed`` ("auto"); symmetric memory or an error ("symm_mem"); plain ``torch.distributed`` ("nccl").
BACKENDS = ("auto", "symm_mem", "nccl")


if triton is not None:

    @triton.jit
    def _peer_barrier(pad_ptrs, flag, RANK: tl.constexpr, WORLD: tl.constexpr):
        """All ranks' programs with the same ``flag`` meet: signal ``flag`` on every peer's signal pad (set it to 1,
        release at system scope), then wait for every peer's signal on this rank's pad and clear it (acquire).
        Every flag is back to 0 afterwards, so the kernel can be replayed in a CUDA graph.  The flag being set is
        always clear already: its last use was consumed by the peer before the peer reached a later meeting that
        this rank has passed (the slots alternate, and the last reduction of a decode step and every gather end
        with a second meeting), so the signal is a plain exchange, not a compare-and-swap loop over NVLink.
        Scalar atomics run on one thread of the program; Triton broadcasts their result through shared memory
        behind a barrier, so the whole program is ordered after the acquire.  Scheme: the block-wise barrier of
        PyTorch's symmetric-memory kernels (torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory-inl.h)."""
        for r in tl.static_range(WORLD):
            if r != RANK:
                remote = tl.load(pad_ptrs + r).to(tl.pointer_type(tl.uint32))
                tl.atomic_xchg(remote + flag * WORLD + RANK, 1, sem="release", scope="sys")
        local = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.uint32))
        for r in tl.static_range(WORLD):
            if r != RANK:
                while tl.atomic_cas(local + flag * WORLD + r, 1, 0, sem="acquire", scope="sys") != 1:
                    pass

    @triton.jit
    def _all_reduce_add_norm_kernel(buf_ptrs, pad_ptrs, res_ptr, w_ptr, h_ptr, x_ptr, offset, flag, end_flag, N,
                                    eps, RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RES: tl.constexpr,
                                    END_BARRIER: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        _peer_barrier(pad_ptrs, flag + row, RANK, WORLD)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        dtype = h_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # the same order on every rank: every rank gets the same bits
            base = tl.load(buf_ptrs + r).to(tl.pointer_type(dtype))
            v = tl.load(base + offset + row * N + cols, mask=mask, other=0.0, volatile=True)
            acc += v.to(tl.float32)
        if END_BARRIER:  # the peers have read this rank's buffer: it may be written again at once
            _peer_barrier(pad_ptrs, end_flag + row, RANK, WORLD)
        s = acc.to(dtype).to(tl.float32)                         # the all-reduce's result, rounded as NCCL's
        if HAS_RES:
            res = tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            s = (res + s).to(dtype).to(tl.float32)               # residual add in the activation dtype
        tl.store(h_ptr + row * N + cols, s.to(dtype), mask=mask)
        var = tl.sum(s * s, axis=0) / N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = s * tl.rsqrt(var + eps) * (1.0 + w)                  # Qwen3_5RMSNorm: (x / rms) * (1 + weight)
        tl.store(x_ptr + row * N + cols, x.to(dtype), mask=mask)

    @triton.jit
    def _gather_staged_kernel(buf_ptrs, pad_ptrs, out_ptr, offset, flag, end_flag, n_local, n_blocks,
                              RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
        """out[row, r * n_local + j] = fp32(rank r's staged[row, j]) for every rank r; program (row, block)."""
        row = tl.program_id(0)
        blk = tl.program_id(1)
        f = row * n_blocks + blk
        _peer_barrier(pad_ptrs, flag + f, RANK, WORLD)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_local
        for r in tl.static_range(WORLD):
            base = tl.load(buf_ptrs + r).to(tl.pointer_type(tl.bfloat16))
            v = tl.load(base + offset + row * n_local + cols, mask=mask, other=0.0, volatile=True)
            tl.store(out_ptr + row * (WORLD * n_local) + r * n_local + cols, v.to(tl.float32), mask=mask)
        _peer_barrier(pad_ptrs, end_flag + f, RANK, WORLD)


class TensorParallelComm:
    """Sum-all-reduce and token broadcast over a tensor-parallel process group.

    Args:
        group: the TP process group (default: the default group, as the service runs TP over all ranks).
        device: this rank's device.
        dtype: dtype of the activations to reduce (the symmetric buffer is allocated in it).
        backend: one of ``BACKENDS``: "auto" (symmetric memory when it works here, else ``torch.distributed``),
            "symm_mem" (raise if it cannot be set up) or "nccl" (``torch.distributed``).
        fused: offer the fused all-reduce + residual add + RMSNorm and the staged logits gather (Triton, on
            symmetric memory) when they pass their start-up check; False: never.
        max_bytes: largest message sent through symmetric memory.

    Attributes: ``world_size``, ``rank``, ``kind`` ("symm_mem" or "torch.distributed": what ``all_reduce`` uses
    for messages up to ``max_bytes``).  Every rank of ``group`` must construct it at the same time (rendezvous inside).

    Raises:
        ValueError: unknown ``backend``.
        RuntimeError: ``backend="symm_mem"`` and symmetric memory could not be set up or failed its check.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device, dtype: torch.dtype, backend: str = "auto",
                 fused: bool = True, max_bytes: int = SYMM_MEM_MAX_BYTES) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device)
        self.dtype = dtype
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        backend = str(backend).strip().lower()
        if backend not in BACKENDS:
            raise ValueError(f"the TP all-reduce backend must be auto, symm_mem or nccl (got {backend!r})")
        self.kind = "torch.distributed"
        self.max_numel = max(1, int(max_bytes) // torch.empty(0, dtype=dtype).element_size())
        self._buf: Optional[torch.Tensor] = None
        self._fused_buf: Optional[torch.Tensor] = None
        self._group_name = ""
        if backend == "symm_mem" and not (self.device.type == "cuda" and self.world_size > 1):
            raise RuntimeError("symmetric-memory all-reduce needs CUDA devices and at least two ranks")
        if backend != "nccl" and self.device.type == "cuda" and self.world_size > 1:
            problem = None
            try:
                self._setup_symm_mem()
            except Exception as exc:  # noqa: BLE001 - optional fast path
                problem = f"{type(exc).__name__}: {str(exc)[:200]}"
            if self._all_agree(problem is None):
                self.kind = "symm_mem"
            else:
                self._buf = None
                if backend == "symm_mem":
                    raise RuntimeError(f"symmetric-memory all-reduce unavailable: {problem or 'on another rank'}")
                log.info("TP all-reduce: symmetric memory unavailable (%s); using torch.distributed",
                         problem or "on another rank")
        if self.kind == "symm_mem" and triton is not None and fused:
            problem = None
            try:
                self._setup_fused()
            except Exception as exc:  # noqa: BLE001 - optional fast path
                problem = f"{type(exc).__name__}: {str(exc)[:300]}"
            if not self._all_agree(problem is None):
                self._fused_buf = None
                log.warning("TP: fused all-reduce + RMSNorm kernel unavailable (%s)", problem or "on another rank")
        log.info("TP all-reduce over %d ranks: %s (<= %d KiB), torch.distributed above", self.world_size, self.kind,
                 self.max_numel * torch.empty(0, dtype=dtype).element_size() // 1024)

    def _all_agree(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank of the group (a MIN all-reduce), so that all ranks choose the same
        kernels."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item() == 1)

    def _setup_symm_mem(self) -> None:
        """Allocate and rendezvous the symmetric buffer, then check one all-reduce against the known sum."""
        import torch.distributed._symmetric_memory as symm_mem

        name = self.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(name)  # needed by older PyTorch, a no-op or deprecated later
            except Exception:  # noqa: BLE001
                pass
        buf = symm_mem.empty(self.max_numel, dtype=self.dtype, device=self.device)
        symm_mem.rendezvous(buf, name)
        self._buf, self._group_name = buf, name
        # Check: rank r contributes r + 1 everywhere, so every element must equal W (W + 1) / 2.
        probe = torch.full((8, 128), float(self.rank + 1), dtype=self.dtype, device=self.device)
        got = self._symm_all_reduce(probe)
        want = self.world_size * (self.world_size + 1) / 2
        if not bool((got.float() == want).all()):
            raise RuntimeError(f"symmetric-memory all-reduce check failed: got {got.float().unique().tolist()}, "
                               f"want {want}")

    def _setup_fused(self) -> None:
        """A second symmetric allocation (two staging slots of ``max_numel`` elements) with its own signal pads;
        device arrays of every rank's buffer and pad address.
        Checks the fused kernels against the unfused path and raises RuntimeError when they differ."""
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(2 * self.max_numel, dtype=self.dtype, device=self.device)
        hdl = symm_mem.rendezvous(buf, self._group_name)
        shift = buf.data_ptr() - int(hdl.buffer_ptrs[hdl.rank])
        self._fused_buf = buf
        self._fused_ptrs = torch.tensor([int(p) + shift for p in hdl.buffer_ptrs], dtype=torch.int64,
                                        device=self.device)
        self._fused_pads = torch.tensor([int(p) for p in hdl.signal_pad_ptrs], dtype=torch.int64, device=self.device)
        self._turn = 0
        self._staged: Optional[tuple[torch.Tensor, int]] = None
        # Check against the unfused path: the all-reduce above, residual add and the norm in fp32 (eager).
        gen = torch.Generator(device=self.device).manual_seed(1234 + self.rank)
        shape = (3, 4096)
        for end in (False, True):
            part = self.staging(*shape)
            part.copy_(torch.randn(shape, generator=gen, device=self.device).to(self.dtype))
            res = torch.randn(shape, generator=gen, device=self.device).to(self.dtype)
            weight = (0.1 * torch.randn(shape[1], generator=gen, device=self.device)).to(self.dtype)
            want_h = res + self._symm_all_reduce(part.clone())
            hf = want_h.float()
            want_x = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.float())).to(self.dtype)
            h, x = self.all_reduce_add_norm(part, res, weight, 1e-6, end_barrier=end)
            if not torch.equal(h, want_h) or not torch.allclose(x.float(), want_x.float(), rtol=2e-2, atol=2e-2):
                raise RuntimeError(f"fused all-reduce + RMSNorm check failed: max |h - want| "
                                   f"{float((h.float() - want_h.float()).abs().max()):.3g}, max |x - want| "
                                   f"{float((x.float() - want_x.float()).abs().max()):.3g}")
        # gather: a 2-block shard with a partial block
        n = GATHER_BLOCK + 904
        part = self.staging(1, n)
        part.copy_(torch.randn(1, n, generator=gen, device=self.device).to(self.dtype))
        want = [torch.empty_like(part) for _ in range(self.world_size)]
        dist.all_gather(want, part.clone(), group=self.group)
        got = self.all_gather_staged(part)
        if self.dtype == torch.bfloat16 and not torch.equal(got, torch.cat(want, dim=-1).float()):
            raise RuntimeError("fused all-gather check failed")
        torch.cuda.synchronize(self.device)

    def fused_rows(self, cols: int) -> int:
        """Most rows of width ``cols`` that ``staging``/``all_reduce_add_norm`` take (0: not available here)."""
        if self._fused_buf is None:
            return 0
        return min(FUSED_MAX_ROWS, self.max_numel // max(1, int(cols)))

    def staging(self, rows: int, cols: int) -> torch.Tensor:
        """The next of two symmetric staging slots as a [rows, cols] tensor, for a row-parallel projection to write
        its partial result into (no copy); pass it to ``all_reduce_add_norm`` next.  The slots alternate, so the
        one written here was last read by the peers two reductions ago, before the reduction in between could
        start.  Raises ValueError when ``rows`` exceeds ``fused_rows(cols)``."""
        if not 1 <= rows <= self.fused_rows(cols):
            raise ValueError(f"staging holds at most {self.fused_rows(cols)} rows of {cols} (asked {rows})")
        t = self._turn
        self._turn ^= 1
        view = self._fused_buf[t * self.max_numel:t * self.max_numel + rows * cols].view(rows, cols)
        self._staged = (view, t)
        return view

    def all_reduce_add_norm(self, partial: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                            eps: float, end_barrier: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel for ``h = residual + all_reduce(partial)`` and ``x = Qwen3_5RMSNorm(h)`` (x / rms(x) *
        (1 + weight), fp32 inside; transformers' modeling_qwen3_5.py), what the decode step does after every
        row-parallel projection.

        partial: the tensor ``staging`` returned last, [B, N], holding this rank's partial sums; residual: [B, N]
        (same dtype) or None (h = the sum); weight: the norm's [N] weight; eps: its epsilon.  ``end_barrier``:
        wait until every peer has read this rank's slot before returning (the last reduction of a decode step,
        so that the next step, from whichever CUDA graph, may write either slot at once).  Returns (h, x), new
        [B, N] tensors.  The sum is added in rank order on every rank, so all ranks get the same bits.
        Raises ValueError when ``partial`` is not the last staged slot.
        """
        t = self._take_staged(partial, "all_reduce_add_norm")
        B, N = partial.shape
        h = torch.empty_like(partial)
        x = torch.empty_like(partial)
        _all_reduce_add_norm_kernel[(B,)](
            self._fused_ptrs, self._fused_pads, residual if residual is not None else partial, weight, h, x,
            t * self.max_numel, t * FUSED_MAX_ROWS, _AR_END, N, float(eps), RANK=self.rank,
            WORLD=self.world_size, HAS_RES=residual is not None, END_BARRIER=bool(end_barrier),
            BLOCK=triton.next_power_of_2(N), num_warps=8)
        return h, x

    def _take_staged(self, partial: torch.Tensor, caller: str) -> int:
        """The slot index of ``partial``, which must be the tensor ``staging`` returned last (ValueError
        otherwise); the slot is handed over to the kernel that reads it."""
        if self._staged is None or partial is not self._staged[0]:
            raise ValueError(f"{caller} needs the tensor that staging() returned last")
        t = self._staged[1]
        self._staged = None
        return t

    def gather_rows(self, cols: int) -> int:
        """Most rows of a [rows, cols] local shard that ``all_gather_staged`` takes (0: not available here)."""
        if self._fused_buf is None or self.dtype != torch.bfloat16:
            return 0
        per_row = -(-int(cols) // GATHER_BLOCK)
        return min(self.max_numel // max(1, int(cols)), GATHER_FLAGS // per_row)

    def all_gather_staged(self, partial: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's staged [B, n] shard along the last dimension in rank order, as fp32 [B, W * n]
        (the vocabulary-split lm_head's logits, converted for the sampler in the same pass).  ``partial`` must be
        the tensor ``staging`` returned last, with at most ``gather_rows(n)`` rows.  Waits at the end until every
        peer has read this rank's slot.  Raises ValueError otherwise."""
        B, n = partial.shape
        if B > self.gather_rows(n):
            raise ValueError(f"all_gather_staged takes at most {self.gather_rows(n)} rows of {n} (got {B})")
        t = self._take_staged(partial, "all_gather_staged")
        out = torch.empty(B, self.world_size * n, dtype=torch.float32, device=partial.device)
        blocks = -(-n // GATHER_BLOCK)
        _gather_staged_kernel[(B, blocks)](
            self._fused_ptrs, self._fused_pads, out, t * self.max_numel, _GATHER_START, _GATHER_END, n, blocks,
            RANK=self.rank, WORLD=self.world_size, BLOCK=GATHER_BLOCK, num_warps=8)
        return out

    def _symm_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        view = self._buf[:x.numel()].view_as(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", self._group_name, out)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group's ranks (same shape and dtype).  Returns a new tensor (symmetric memory)
        or ``x`` itself, reduced in place (``torch.distributed``).  Queued on the current stream; capturable in a CUDA graph.

        With two ranks every rank gets the same bits (each adds the same two partial results, and one
        addition does not depend on the order).  Sampled tokens never depend on it: ``broadcast_from_rank0``.
        """
        if self.world_size == 1:
            return x
        if (self._buf is not None and x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.max_numel
                and (x.numel() * x.element_size()) % 16 == 0):
            return self._symm_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` [..., n] along the last dimension in rank order: [..., W * n]
        (``all_gather_into_tensor``, one NCCL call)."""
        if self.world_size == 1:
            return x
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).contiguous()                      # [R, n]
        parts = torch.empty((self.world_size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(parts, x, group=self.group)           # rank blocks along dim 0: [W * R, n]
        full = parts.view(self.world_size, x.shape[0], x.shape[1]).permute(1, 0, 2)
        return full.reshape(*lead, self.world_size * x.shape[1])


def broadcast_from_rank0(tokens: torch.Tensor) -> torch.Tensor:
    """Replace ``tokens`` (int64 [B], on the device) in place with rank 0's values over the default process group
    and return it (queued, no host wait).  Used as ``Sampler.token_sync`` when several ranks run: each rank then
    records and feeds rank 0's sampled tokens, even where the ranks' logits differ in the last bit."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tokens, src=0)
    return tokens

