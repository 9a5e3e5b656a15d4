"""Context parallelism: ring attention over ``torch.distributed``.

A long sequence is cut into shards, one per rank of a process group. Each rank
keeps its query shard; the K/V shards travel around the ring (rank r sends to
r + 1 and receives from r - 1, ``torch.distributed.batch_isend_irecv``), and
at each step the rank attends its queries to the K/V shard it holds with
:func:`cupy_gqa.attention`. The partial results merge by their log-sum-exp, in
float32 (float64 for float64 inputs)::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

(a row that has seen no key yet has lse = -inf and weighs nothing). The
backward pass runs the same ring: the K/V shards travel again, each rank adds
its share of dK, dV (:func:`cupy_gqa.attention_backward`) to an accumulator
that travels with them, and after a full turn each accumulator comes home to
the rank that owns the shard.

Causal load balance: zigzag sharding
------------------------------------
With the causal mask, contiguous shards give rank 0 one block to compute and
the last rank all of them. Zigzag sharding cuts the sequence into
2 * world_size chunks and gives rank r chunks r and 2 * world_size - 1 - r, so
that every rank computes the same number of blocks. world_size = 4::

    chunk     0  1  2  3  4  5  6  7        (seqlen / 8 tokens each)
    rank      0  1  2  3  3  2  1  0        (zigzag_shard(x, rank, 4))

                      key chunk
                  0  1  2  3  4  5  6  7
    query chunk 0 D  .  .  .  .  .  .  .    rank 0
                1 F  D  .  .  .  .  .  .    rank 1
                2 F  F  D  .  .  .  .  .    rank 2
                3 F  F  F  D  .  .  .  .    rank 3
                4 F  F  F  F  D  .  .  .    rank 3
                5 F  F  F  F  F  D  .  .    rank 2
                6 F  F  F  F  F  F  D  .    rank 1
                7 F  F  F  F  F  F  F  D    rank 0

    D  diagonal: a causal call on two chunks of equal length (cupy_gqa's
       bottom-right alignment is then the plain lower triangle)
    F  fully visible: a non-causal call
    .  skipped: fully masked, never computed

Every rank owns 9 of the 36 computed blocks. At step s rank r holds the K/V
shard of rank j = (r - s) mod world_size, and computes one call:

    s = 0 (j = r)   its own chunks [r, 7-r] x [r, 7-r]: one causal call on the
                    whole shard (D, ., F, D in local order)
    j < r           both query chunks x key chunk j: non-causal (F, F)
    j > r           query chunk 7-r x both key chunks: non-causal (F, F)

so each step after the first computes half of a shard x shard block. With
``sharding="contiguous"`` rank r holds chunk r of world_size: step 0 is its
causal diagonal, K/V of an earlier rank are fully visible and those of a later
rank are skipped (correct, not balanced). Without the causal mask every block
is fully visible and the sharding only says where the tokens are.

Streams (CUDA): the exchange of the next K/V shard is issued from a side
stream while the current shard's attention runs on the current stream; the
side stream waits on the current stream before each exchange (the data to
send is ready), the current stream waits on the side stream after it (the
received shard is there), and received buffers are recorded on the current
stream for the caching allocator. These are stream-to-stream waits: nothing
waits on the host. One host-side exchange per call checks that every rank
passes the same shapes (over a gloo group; see ``_check_ranks``).

This module imports torch; ``import cupy_gqa`` does not import it.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import torch
import torch.distributed as dist

from . import api

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard", "SHARDINGS"]

SHARDINGS = ("zigzag", "contiguous")


# --- sharding helpers --------------------------------------------------------------------------------------------


def zigzag_shard(x, rank: int, world_size: int, *, dim: int = 1):
    """Rank ``rank``'s zigzag shard of a full tensor: the sequence axis ``dim``
    cut into 2 * world_size chunks, chunks ``rank`` and ``2 * world_size - 1 -
    rank`` concatenated (a new tensor; x is not modified). torch tensors and
    NumPy arrays. ``dim=1`` is the sequence axis of q, k, v (batch, seqlen,
    heads, head_dim); ``dim=2`` that of lse (batch, heads, seqlen)."""
    world_size, rank = _check_world(world_size, rank)
    dim = _check_dim(x, dim, "x")
    seqlen = x.shape[dim]
    if seqlen % (2 * world_size):
        raise ValueError(
            f"x: expected a seqlen (axis {dim}) divisible by 2 * world_size = {2 * world_size} for zigzag sharding, "
            f"got {seqlen}"
        )
    c = seqlen // (2 * world_size)
    chunks = [_take(x, dim, i * c, (i + 1) * c) for i in (rank, 2 * world_size - 1 - rank)]
    return _cat(chunks, dim)


def zigzag_unshard(shards, *, dim: int = 1):
    """The full tensor from the zigzag shards of ranks 0, 1, ..., world_size - 1
    (a list, e.g. from ``torch.distributed.all_gather``): the inverse of
    :func:`zigzag_shard`."""
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards: expected a non-empty list of the world_size shards, got {type(shards).__name__}")
    world_size = len(shards)
    dim = _check_dim(shards[0], dim, "shards[0]")
    length = shards[0].shape[dim]
    for r, s in enumerate(shards):
        if s.shape[dim] != length:
            raise ValueError(f"shards[{r}]: expected length {length} on axis {dim} (that of shards[0]), got {s.shape[dim]}")
    if length % 2:
        raise ValueError(f"shards[0]: expected an even length on axis {dim} (two zigzag chunks), got {length}")
    c = length // 2
    order = [None] * (2 * world_size)
    for r, s in enumerate(shards):
        order[r] = _take(s, dim, 0, c)
        order[2 * world_size - 1 - r] = _take(s, dim, c, length)
    return _cat(order, dim)


def _check_world(world_size, rank):
    for name, n in (("world_size", world_size), ("rank", rank)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
            raise TypeError(f"{name}: expected an int, got {type(n).__name__} {n!r}")
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
    return int(world_size), int(rank)


def _check_dim(x, dim, name):
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        raise TypeError(f"{name}: expected a torch tensor or NumPy array, got {type(x).__name__}")
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim: expected an axis of {name} (ndim {x.ndim}), got {dim!r}")
    return int(dim) % x.ndim


def _take(x, dim, start, stop):
    return x[(slice(None),) * dim + (slice(start, stop),)]


def _cat(parts, dim):
    return torch.cat(parts, dim=dim) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts, axis=dim)


# --- the setup of one call ---------------------------------------------------------------------------------------


class _Setup:
    """What every step of one call needs: the ring, the flags, the block plan."""

    def __init__(self, group, causal: bool, softmax_scale: float, sharding: str, local_seqlen: int):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.causal, self.scale, self.sharding = causal, softmax_scale, sharding
        self.local_seqlen = local_seqlen
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def block(self, step: int):
        return _block(self.rank, self.world, step, self.causal, self.sharding, self.local_seqlen)


def _block(rank: int, world: int, step: int, causal: bool, sharding: str, local_seqlen: int):
    """The call of ``step`` on ``rank``: (query rows, key rows, causal) of the
    local shard and the K/V shard held, or None when every pair is masked
    (module docstring: the picture)."""
    whole = slice(None)
    if not causal:
        return whole, whole, False
    j = (rank - step) % world  # whose K/V shard this rank holds
    if j == rank:
        return whole, whole, True  # equal lengths: bottom-right is the plain lower triangle
    if sharding == "contiguous":
        return (whole, whole, False) if j < rank else None
    c = local_seqlen // 2
    if j < rank:  # key chunk j is before both query chunks; chunk 2w-1-j after both
        return whole, slice(0, c), False
    return slice(c, None), whole, False  # only the late query chunk sees them, and sees both


# --- the exchange ------------------------------------------------------------------------------------------------

_SIDE_STREAMS: dict = {}


def _side_stream(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class _Exchange:
    """Send tensors to the next rank and receive the same shapes from the previous
    one (torch.distributed point to point); ``start`` returns a handle,
    ``finish`` the received tensors. A world of one sends nothing: the tensors
    come back as they are."""

    def __init__(self, setup: _Setup, device):
        self.setup = setup
        self.cuda = device.type == "cuda"
        self.side = _side_stream(device) if self.cuda and setup.world > 1 else None

    def start(self, tensors):
        s = self.setup
        if s.world == 1:
            return None, list(tensors)
        if self.cuda:
            current = torch.cuda.current_stream(self.side.device)
            self.side.wait_stream(current)  # what is sent was written on the current stream
            with torch.cuda.stream(self.side):
                received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
                requests = dist.batch_isend_irecv(self._ops(tensors, received))
        else:
            received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
            requests = dist.batch_isend_irecv(self._ops(tensors, received))
        return requests, received

    def _ops(self, tensors, received):
        s = self.setup
        ops = [dist.P2POp(dist.isend, t, s.next, s.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, s.prev, s.group) for t in received]
        return ops

    def finish(self, handle):
        requests, received = handle
        if requests is None:
            return received
        if self.cuda:
            with torch.cuda.stream(self.side):
                for r in requests:
                    r.wait()  # NCCL: the side stream waits for the transfer, the host does not
            current = torch.cuda.current_stream(self.side.device)
            current.wait_stream(self.side)
            for t in received:
                t.record_stream(current)  # allocated on the side stream, read on the current one
        else:
            for r in requests:
                r.wait()
        return received


# --- forward and backward ----------------------------------------------------------------------------------------


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _attend(q, k, v, causal: bool, scale: float):
    """(out, lse) of one block: cupy_gqa.attention; float64 CPU inputs get a float64 lse."""
    if q.dtype == torch.float64 and q.device.type == "cpu":
        return api._attention(
            q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=None, kernel="auto", precision="highest",
            seqlens_k=None, layout="bshd", workspace=None, flags=None, lse64=True,
        )  # fmt: skip
    return api.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)


def _rows(w):
    """(batch, heads, rows) weights as (batch, rows, heads, 1), to scale (batch, rows, heads, head_dim)."""
    return w.transpose(1, 2).unsqueeze(-1)


def _merge(out, lse, block_out, block_lse) -> None:
    """Fold one block's (out, lse) into the running (out, lse), in place, in
    their dtype. Rows whose lse is -inf on both sides stay out 0, lse -inf."""
    block_lse = block_lse.to(lse.dtype)
    top = torch.maximum(lse, block_lse)
    ref = top.masked_fill(top == -math.inf, 0.0)  # no (-inf) - (-inf)
    w_run = torch.exp(lse - ref)
    w_block = torch.exp(block_lse - ref)
    total = w_run + w_block  # in [1, 2] where either side has seen a key, else 0
    lse.copy_(ref + torch.log(total))
    total.masked_fill_(total == 0, 1.0)
    out.mul_(_rows(w_run / total)).add_(block_out.to(out.dtype) * _rows(w_block / total))


def _forward(q, k, v, setup: _Setup, keep_block_lse: bool):
    """This rank's (out, lse in float32 / float64, the blocks' lse by step or None)."""
    acc = _acc_dtype(q.dtype)
    batch, seqlen, heads, head_dim = q.shape
    out = torch.zeros((batch, seqlen, heads, head_dim), dtype=acc, device=q.device)
    lse = torch.full((batch, heads, seqlen), -math.inf, dtype=acc, device=q.device)
    ring = _Exchange(setup, q.device)
    kc, vc = k.contiguous(), v.contiguous()  # what is sent must be contiguous (the caller's tensors are not touched)
    block_lse = []
    for step in range(setup.world):
        pending = ring.start((kc, vc)) if step + 1 < setup.world else None
        block = setup.block(step)
        kept = None
        if block is not None:
            rows, keys, causal = block
            o, l = _attend(q[:, rows], kc[:, keys], vc[:, keys], causal, setup.scale)
            _merge(out[:, rows], lse[:, :, rows], o, l)
            kept = l if keep_block_lse else None
        block_lse.append(kept)
        if pending is not None:
            kc, vc = ring.finish(pending)
    return out.to(q.dtype), lse, block_lse


def _backward(dout, q, k, v, out, lse, block_lse, setup: _Setup):
    """(dq, dk, dv) of this rank's shards.

    fp16 / bf16: each block's attention_backward gets the merged out and lse,
    so it rebuilds the global probabilities P = exp(s - lse) of its block.
    float32 / float64: attention_backward on CUDA rebuilds each row's lse from
    the block's own scores (exact arithmetic, kernels/backward.cu), which gives
    the block's local softmax P_i = P * exp(lse - lse_i). The block then gets
    its own lse_i and dout scaled by exp(lse_i - lse) per row: with the merged
    out, delta and dP scale alike, and dS, dQ, dK, dV come out as those of the
    global P, whichever lse the backward uses (the NumPy backend takes lse_i as
    given)."""
    acc = _acc_dtype(q.dtype)
    scaled = q.dtype in (torch.float32, torch.float64)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_ref = lse.masked_fill(lse == -math.inf, 0.0)
    lse_pass = lse if q.dtype == torch.float64 else lse.to(torch.float32)
    ring = _Exchange(setup, q.device)
    kc, vc = k.contiguous(), v.contiguous()
    pending_dkv = None
    for step in range(setup.world):
        pending_kv = ring.start((kc, vc)) if step + 1 < setup.world else None
        block = setup.block(step)
        grads = None
        if block is not None:
            rows, keys, causal = block
            if scaled:
                l_i = block_lse[step]
                w = torch.exp(l_i.to(acc) - lse_ref[:, :, rows])
                d_o = (dout[:, rows].to(acc) * _rows(w)).to(q.dtype)
                l_pass = l_i
            else:
                d_o, l_pass = dout[:, rows], lse_pass[:, :, rows]
            grads = api.attention_backward(
                d_o, q[:, rows], kc[:, keys], vc[:, keys], out[:, rows], l_pass, causal=causal, softmax_scale=setup.scale
            )
            dq[:, rows] += grads[0]
        if step == 0:
            dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            dk_acc, dv_acc = ring.finish(pending_dkv)  # the shard's gradients from the ranks before
        if grads is not None:
            dk_acc[:, keys] += grads[1]
            dv_acc[:, keys] += grads[2]
        pending_dkv = ring.start((dk_acc, dv_acc))  # to the next holder; after the last step, home
        if pending_kv is not None:
            kc, vc = ring.finish(pending_kv)
    dk, dv = ring.finish(pending_dkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup):
        scaled = q.dtype in (torch.float32, torch.float64)
        out, lse, block_lse = _forward(q, k, v, setup, keep_block_lse=scaled)
        steps = [i for i, l in enumerate(block_lse) if l is not None]
        ctx.setup, ctx.steps = setup, steps
        ctx.save_for_backward(q, k, v, out, lse, *(block_lse[i] for i in steps))
        lse_out = lse.to(torch.float32)
        ctx.mark_non_differentiable(lse_out)
        return out, lse_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        block_lse = [None] * ctx.setup.world
        for i, l in zip(ctx.steps, kept):
            block_lse[i] = l
        dq, dk, dv = _backward(dout, q, k, v, out, lse, block_lse, ctx.setup)
        return dq, dk, dv, None


# --- the public function -----------------------------------------------------------------------------------------


def ring_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, return_lse=False, sharding="zigzag"):
    """Attention of a sequence sharded over the ranks of ``group``: each rank
    passes its shard and gets its shard of ``cupy_gqa.attention`` of the whole
    sequence (module docstring: the ring, the zigzag picture).

    Parameters
    ----------
    q : (batch, local_seqlen, num_q_heads, head_dim) torch tensor
    k, v : (batch, local_seqlen, num_kv_heads, head_dim) torch tensors
        This rank's shard of the sequence, in the order ``sharding`` says
        (``zigzag_shard`` of the full tensors for "zigzag"); the same shapes,
        dtype and flags on every rank. CUDA tensors with an NCCL group (each
        rank on its own device, ``torch.cuda.set_device``), CPU tensors with a
        gloo group (the NumPy backend computes each block). Same dtypes and
        GQA rules as cupy_gqa.attention; num_q_heads a multiple of
        num_kv_heads.
    group : torch.distributed process group, default the default group
        The ring: rank r sends to r + 1 and receives from r - 1 (ranks within
        the group).
    causal : bool, default True
        The causal mask over the whole sequence (query i sees keys j <= i, in
        global positions).
    softmax_scale : float, default ``1 / sqrt(head_dim)``
    return_lse : bool, default False
        Also return lse, float32 (batch, num_q_heads, local_seqlen): this
        rank's rows of the whole sequence's lse (``zigzag_unshard(..., dim=2)``
        puts them in order).
    sharding : {"zigzag", "contiguous"}, default "zigzag"
        "zigzag": rank r holds chunks r and 2 * world_size - 1 - r of
        2 * world_size (local_seqlen even). "contiguous": rank r holds tokens
        [r * local_seqlen, (r + 1) * local_seqlen).

    Returns
    -------
    out : like q (or ``(out, lse)``). torch autograd: when q, k or v requires
    grad, the backward runs the reverse ring (``cupy_gqa.attention_backward``
    per block) and returns each rank the gradients of its shards.

    Every rank of the group must call it with the same shapes: a first
    exchange checks that, and every rank raises the same ValueError when
    they differ.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding: expected one of {SHARDINGS}, got {sharding!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialized (call torch.distributed.init_process_group)")
    if group is None:
        group = dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError("group: expected a process group that contains this rank, got one that does not")
    api._check_shapes_and_dtypes(q, k, v)
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (that of q), got {x.device}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"k: expected local_seqlen {q.shape[1]} (that of q: ring attention takes shards of one sequence), "
            f"got {k.shape[1]}"
        )
    scale = api._check_scale(softmax_scale, q.shape[3])
    _check_ranks(group, q, k, bool(causal), scale, sharding)
    local_seqlen = q.shape[1]
    if sharding == "zigzag" and local_seqlen % 2:
        raise ValueError(
            f"q: expected an even local_seqlen for sharding='zigzag' (two chunks of the sequence cut into "
            f"2 * world_size), got {local_seqlen}; zigzag_shard makes the shards, or pass sharding='contiguous'"
        )
    setup = _Setup(group, bool(causal), scale, sharding, local_seqlen)
    wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if wants_grad:
        out, lse = _RingAttention.apply(q, k, v, setup)
    else:
        with torch.no_grad():
            out, lse, _ = _forward(q, k, v, setup, keep_block_lse=False)
            lse = lse.to(torch.float32)
    return (out, lse) if return_lse else out


# --- the check across ranks --------------------------------------------------------------------------------------

_HOST_GROUPS: dict = {}
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def _host_group(group):
    """A group over the same ranks that exchanges CPU tensors: the group itself
    when it has gloo, else a gloo group made once (only its ranks take part)."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    host = _HOST_GROUPS.get(ranks)
    if host is None:
        host = _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return host


def _check_ranks(group, q, k, causal: bool, scale: float, sharding: str) -> None:
    """Every rank passes the same shapes, dtype and flags: an all_gather of
    small CPU tensors on the host (no device work, no wait on the GPU), after
    which every rank raises the same ValueError if they differ."""
    world = dist.get_world_size(group)
    (scale_bits,) = struct.unpack("<q", struct.pack("<d", scale))
    fields = [
        *q.shape, *k.shape, _DTYPE_CODES.get(q.dtype, -1), int(causal), SHARDINGS.index(sharding), scale_bits,
    ]  # fmt: skip
    mine = torch.tensor(fields, dtype=torch.int64)
    if world == 1:
        return
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=_host_group(group))
    first = gathered[0].tolist()
    for r, t in enumerate(gathered[1:], start=1):
        other = t.tolist()
        if other == first:
            continue
        if other[1] != first[1] or other[5] != first[5]:
            raise ValueError(
                f"q: expected local_seqlen {first[1]} on every rank (that of rank 0), got {other[1]} on rank {r}; "
                "ring attention takes shards of equal length (zigzag_shard makes them)"
            )
        for name, sl in (("q", slice(0, 4)), ("k", slice(4, 8))):
            if other[sl] != first[sl]:
                raise ValueError(f"{name}: expected shape {tuple(first[sl])} on every rank (that of rank 0), got {tuple(other[sl])} on rank {r}")
        names = {8: "dtype", 9: "causal", 10: "sharding", 11: "softmax_scale"}
        for i, name in names.items():
            if other[i] != first[i]:
                show = {
                    8: lambda c: {v: str(k_).removeprefix("torch.") for k_, v in _DTYPE_CODES.items()}.get(c, "other"),
                    9: bool,
                    10: lambda c: SHARDINGS[c],
                    11: lambda b: struct.unpack("<d", struct.pack("<q", b))[0],
                }[i]
                raise ValueError(f"{name}: expected {show(first[i])!r} on every rank (that of rank 0), got {show(other[i])!r} on rank {r}")
