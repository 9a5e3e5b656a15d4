"""Benchmark cupy_gqa.attention against PyTorch's attention backends.

Usage (from the repository root, on a machine with an NVIDIA GPU):

    python benchmarks/bench_attention.py                 # every case, plot, results files
    python benchmarks/bench_attention.py --quick         # smoke run: fewer reps, 3-point sweep
    python benchmarks/bench_attention.py --cases S0,H1 --out /tmp/bench --no-plot
    python benchmarks/bench_attention.py --cases L1,L2,L3 --out /tmp/bench --no-plot   # per-call latency
    python benchmarks/bench_attention.py --list          # print the case table (no GPU needed)

What is measured
    * Time: CUDA events around each call, after a warm-up, on torch's current stream,
      with a 256 MB buffer zeroed before every repetition so no call finds its inputs
      in L2 (as triton.testing.do_bench does), then a GPU spin of HEAD_START_CYCLES
      (torch.cuda._sleep) before the start event, so that the host has queued the
      call's kernels before the GPU reaches it: the events time the GPU's work, not
      the host's (a torch call through sdpa_kernel takes longer on the host than the
      flush alone hides). The median is reported. A call measured
      under SLOW_CALL_MS = 50 ms gets FAST_REPS = 20 repetitions (--quick: 5), a slower
      one SLOW_REPS = 3 (--quick: 1), rounded up to whole rounds: a case's
      implementations (cupy_gqa's and torch's) are timed in TIMING_ROUNDS = 4 rounds,
      in turn, the order reversed every other round, because a long run heats the
      GPU and slows whatever is timed after it. The count is in every row.
    * TFLOP/s = 4 * head_dim * visible (query, key) pairs * batch * num_q_heads / time,
      with causal masking aligned bottom-right (see visible_pairs).
    * GB/s = bytes of K and V (batch * seqlen_k * num_kv_heads * head_dim * itemsize * 2)
      / time, for every row; it is the meaningful figure for decode.
    * rel_err = ||out - ref|| / ||ref|| against a float64 reference of the definition
      (KV heads repeated, mask written out), on the whole output when the case has at
      most REF_FULL_MAX_SCORES = 1e10 score elements (batch * num_q_heads * seqlen_q *
      seqlen_k), else on batch 0 and the query heads of KV head 0 (column ref says which).
    * vs_<anchor> (cupy_gqa rows) = cupy_gqa time / anchor time from the same run;
      below 1 means cupy_gqa is faster.
    * compile_s: the process sets CUPY_CACHE_DIR to a fresh temporary folder before
      importing CuPy, so the first call of each cupy_gqa kernel compiles cold; compile_s
      is that first call's wall time minus the kernel's median time. compile_cached_s is
      the same for a second process that reuses the folder (on-disk NVRTC cache hit).
      A value near zero for a kernel means an earlier row of the same process already
      built the same specialization.
    * Backward cases (G1-G3) time the backward pass alone: cupy_gqa.attention_backward
      given dout, out and lse from cupy_gqa's forward, and for torch
      torch.autograd.grad on a forward run once, beforehand, in the same backend (its
      graph retained). TFLOP/s counts 10 * head_dim per visible pair (five matrix
      products: 2.5x the forward's); rel_err is the largest of dq's, dk's and dv's
      against float64 gradients of the definition. G1's first call also reports the
      peak memory beyond the inputs (and the forward's saved graph) and the gradients.
    * Per-call cases (L1-L3, kind "call") time a call as a loop of calls sees it:
      CALLS = 2000 calls back to back (--quick: 200) after CALL_WARMUP = 100, no L2
      flush between them, perf_counter around the loop, which ends with a device
      synchronize; ms is that time / CALLS, so it holds the kernel and whatever host
      time the GPU can't hide behind it. Three impls: cupy_gqa[auto] on the torch
      tensors, cupy_gqa[auto,cupy] on CuPy arrays (views of the same memory; the call's
      allocations from CuPy's own memory pool, as a CuPy program makes them) and
      torch_auto (SDPA's default backend choice, as in the other cases); vs_torch_auto
      is the ratio. host_us is the host time of one repeat call, measured as
      benchmarks/overhead.py does: the GPU idle before each call (a synchronize, then
      perf_counter around the one call), the median of HOST_CALLS = 300 calls
      (--quick: 50). rel_err is checked on the first call, as for the other cases.
    * M1 measures memory, not time: torch.cuda.max_memory_allocated during one call,
      minus what was allocated before it, minus the output. CuPy's allocator is routed
      through torch's caching allocator for the whole run, so cupy_gqa's scratch counts.

Importing this module needs neither CuPy nor torch: they are imported lazily, so the
case table and the counters can be tested on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results"

# timing
FAST_REPS, SLOW_REPS = 20, 3  # the spec: median of >= 20 runs unless a call takes > 50 ms
QUICK_FAST_REPS, QUICK_SLOW_REPS = 5, 1
SLOW_CALL_MS = 50.0
# The implementations of a case are timed in rounds, in turn, the order reversed
# every other round: a long implementation heats the GPU and the ones timed
# after it run slower (up to 13% on the H200: the same cuDNN kernel as
# torch_auto and as torch_cudnn, measured at different points of a case),
# so no implementation may owe its time to its place in the order.
TIMING_ROUNDS = 4
L2_FLUSH_BYTES = 256 * 2**20
# GPU clock cycles of the spin after the flush (about 0.3 ms on the H200): the host's
# head start on each timed call. Without it, the 256 MB flush (about 0.1 ms) was the
# only head start, and at H3 (0.1 ms calls) the torch_cudnn row, whose call enters
# sdpa_kernel first, read 0.123 ms where the same run's torch_auto, the same cuDNN
# kernel, read 0.103 (benchmarks/results/h200.md, 2026-12-04).
HEAD_START_CYCLES = 500_000
# per-call cases (kind "call"): back-to-back calls, and the host time of one call
CALLS, QUICK_CALLS = 2000, 200
CALL_WARMUP = 100
HOST_CALLS, QUICK_HOST_CALLS = 300, 50
DEVICE = "cuda"  # torch device of the inputs, the flush buffer and CuPy's allocations

# where the anchors and the reference stop
TORCH_MATH_MAX_BYTES = 8e9  # torch_math materialises batch*num_q_heads*seqlen_q*seqlen_k fp32 scores
REF_FULL_MAX_SCORES = 1e10  # above this many score elements the reference covers a subset
REF_BLOCK_SCORES = 2**28  # float64 scores per reference chunk (2 GiB)

# the prefill plot: bf16 causal Hq32 Hkv8 D128 at 16k tokens per batch
SWEEP_TOKENS = 16384
SWEEP_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SWEEP_SEQLENS = (1024, 4096, 16384)
SWEEP_IMPLS = ("cupy_gqa[auto]", "torch_flash", "torch_cudnn")

ANCHORS = ("torch_auto", "torch_flash", "torch_cudnn", "torch_math", "torch_efficient_expanded", "torch_varlen", "naive_loop",
           "seed_kernel")
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


# ---------------------------------------------------------------------------
# Case table
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One benchmark shape. q is (batch, seqlen_q, num_q_heads, head_dim)."""

    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "fp32", "bf16" or "fp16"
    causal: bool = True
    # "prefill", "decode", "backward" (the backward pass), "memory" (peak memory, not time)
    # or "call" (per-call wall time of back-to-back calls, and the host time of one call)
    kind: str = "prefill"

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def score_elements(self) -> int:
        """batch * num_q_heads * seqlen_q * seqlen_k: the size of a materialised score matrix."""
        return self.batch * self.num_q_heads * self.seqlen_q * self.seqlen_k

    def describe(self) -> str:
        s = f"S{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"Sq{self.seqlen_q} Sk{self.seqlen_k}"
        mask = "causal" if self.causal else "non-causal"
        kind = self.kind
        if kind == "paged":
            kind = f"paged {'decode' if self.seqlen_q == 1 else 'prefill'}, pages of {PAGE_SIZES[self.name]} shuffled"
        if kind == "varlen":
            s = f"varlen {self.batch} sequences of {VARLEN_MIN} to {VARLEN_MAX} tokens (seed {VARLEN_SEED})"
            return f"{s} Hq{self.num_q_heads} Hkv{self.num_kv_heads} D{self.head_dim} {self.dtype} {mask} prefill"
        if kind == "call":
            kind = f"per-call ({'decode' if self.seqlen_q == 1 else 'prefill'})"
        return f"B{self.batch} {s} Hq{self.num_q_heads} Hkv{self.num_kv_heads} D{self.head_dim} {self.dtype} {mask} {kind}"


def _prefill(name, batch, seqlen, head_dim, dtype, *, num_q_heads=32, num_kv_heads=8, causal=True, kind="prefill"):
    return Case(name, batch, seqlen, seqlen, num_q_heads, num_kv_heads, head_dim, dtype, causal, kind)


CASES: tuple[Case, ...] = (
    _prefill("S0", 2, 80, 32, "fp32", num_q_heads=8, num_kv_heads=2),  # the seed's shape
    _prefill("S0h", 2, 80, 32, "bf16", num_q_heads=8, num_kv_heads=2),
    _prefill("F1", 4, 4096, 128, "fp32"),
    _prefill("F2", 4, 1024, 64, "fp32"),
    _prefill("H1", 4, 4096, 128, "bf16"),
    _prefill("H2", 1, 16384, 128, "bf16"),
    _prefill("H3", 16, 512, 128, "fp16"),
    _prefill("H4", 4, 2048, 64, "bf16"),
    _prefill("N1", 4, 4096, 128, "bf16", causal=False),
    _prefill("H5", 4, 2048, 80, "bf16"),  # head dims of real models beyond 64 / 128
    _prefill("H6", 4, 2048, 192, "bf16"),
    _prefill("H7", 4, 2048, 256, "bf16"),
    _prefill("G1", 4, 4096, 128, "bf16", kind="backward"),  # the backward pass (time only)
    _prefill("G2", 4, 2048, 64, "bf16", kind="backward"),
    _prefill("G3", 4, 1024, 64, "fp32", kind="backward"),
    Case("D1", 16, 1, 8192, 32, 8, 128, "bf16", True, "decode"),  # one new token against a cache
    Case("D2", 64, 1, 2048, 32, 8, 128, "bf16", True, "decode"),
    _prefill("M1", 1, 32768, 128, "fp32", kind="memory"),
    # per-call latency: small calls, where the host's share of a call shows
    _prefill("L1", 2, 80, 32, "bf16", num_q_heads=8, num_kv_heads=2, kind="call"),  # S0h's shape
    Case("L2", 1, 1, 4096, 32, 8, 128, "bf16", True, "call"),  # one sequence's decode step
    Case("L3", 8, 1, 1024, 32, 8, 128, "bf16", True, "call"),
    # a paged KV cache (D1's shape, pages shuffled in the pool; GB/s as for D1) and a varlen prefill
    Case("P1", 16, 1, 8192, 32, 8, 128, "bf16", True, "paged"),
    Case("P2", 16, 1, 8192, 32, 8, 128, "bf16", True, "paged"),
    Case("P3", 16, 1, 8192, 32, 8, 128, "bf16", True, "paged"),
    # chunked prefill on a paged cache: 2048 new tokens on 6144 cached ones (TFLOP/s as for H1)
    Case("P4", 4, 2048, 8192, 32, 8, 128, "bf16", True, "paged"),
    Case("P5", 4, 2048, 8192, 32, 8, 128, "bf16", True, "paged"),
    Case("V1", 16, 4096, 4096, 32, 8, 128, "bf16", True, "varlen"),
)
PAGE_SIZES = {"P1": 16, "P2": 64, "P3": 256, "P4": 16, "P5": 256}  # tokens per page of the paged cases
VARLEN_SEED, VARLEN_MIN, VARLEN_MAX = 0, 128, 4096  # V1's lengths: uniform in [128, 4096], this seed


def varlen_lengths(case: Case) -> list[int]:
    """The sequence lengths of a varlen case (fixed seed; seqlen_q is their bound)."""
    import random

    rng = random.Random(VARLEN_SEED)
    return [rng.randint(VARLEN_MIN, min(VARLEN_MAX, case.seqlen_q)) for _ in range(case.batch)]


CASE_BY_NAME = {c.name.lower(): c for c in CASES}


def _decode(name, batch, seqlen_k, num_q_heads, num_kv_heads, head_dim, dtype="bf16", seqlen_q=1):
    return Case(name, batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, dtype, True, "decode")


# The shape sweep (--sweep): the attention shapes of open models, one point each,
# where a model is named; the head counts are a whole model's, or one
# tensor-parallel rank's (TP8). Chosen to span group sizes 1 (MHA) to 71 (MQA
# with many heads), odd groups (7) and head counts that are not powers of two,
# head dims 64 to 256, batch 1 to 64, key lengths 1k to 128k including ones
# that are not a multiple of 64, bf16 and fp16, and a few fp32 points. Decode
# is seqlen_q 1, and 2 to 8 for speculative decoding; prefill is causal with
# seqlen_q = seqlen_k except one chunked-prefill point.
SHAPE_SWEEP: tuple[Case, ...] = (
    # decode
    _decode("D01", 1, 4096, 32, 8, 128),  # Llama-3-8B
    _decode("D02", 8, 8192, 32, 8, 128),
    _decode("D03", 32, 4000, 32, 8, 128),  # keys not a multiple of 64
    _decode("D04", 64, 2048, 32, 8, 128),
    _decode("D05", 16, 8192, 8, 1, 128),  # Llama-3-70B, one TP8 rank
    _decode("D06", 1, 32768, 8, 1, 128),
    _decode("D07", 4, 16384, 32, 8, 128, "fp16"),  # Mistral-7B
    _decode("D08", 8, 4096, 28, 4, 128),  # Qwen2.5-7B: group 7
    _decode("D09", 1, 131072, 28, 4, 128),  # 128k keys
    _decode("D10", 16, 2048, 12, 2, 128),  # Qwen2-1.5B: group 6
    _decode("D11", 8, 4096, 16, 8, 256),  # Gemma-2-9B
    _decode("D12", 4, 8192, 16, 16, 256),  # Gemma-7B (MHA)
    _decode("D13", 8, 4096, 32, 32, 96),  # Phi-3-mini (MHA, head_dim 96)
    _decode("D14", 16, 2048, 32, 32, 128),  # Llama-2-7B (MHA)
    _decode("D15", 8, 2048, 71, 1, 64),  # Falcon-7B (MQA, 71 heads)
    _decode("D16", 4, 8192, 48, 1, 128),  # StarCoder-15B (MQA, 48 heads)
    _decode("D17", 32, 4096, 32, 4, 128),  # Qwen3-30B-A3B: group 8
    _decode("D18", 16, 8192, 32, 8, 64),  # Llama-3.2-1B
    _decode("D19", 8, 4096, 32, 8, 128, seqlen_q=4),  # speculative decoding
    _decode("D20", 4, 8192, 32, 8, 128, seqlen_q=8),
    _decode("D21", 16, 2050, 28, 4, 128, seqlen_q=2),
    _decode("D22", 16, 8192, 32, 8, 128, "fp16"),
    _decode("D23", 8, 8192, 64, 8, 64),  # gpt-oss-20b
    _decode("D24", 8, 16384, 16, 1, 128),  # Llama-3-405B, one TP8 rank: group 16
    _decode("D25", 4, 4096, 32, 8, 64, "fp32"),
    _decode("D26", 1, 16384, 28, 4, 128, "fp32"),
    # prefill
    _prefill("P01", 1, 8192, 128, "bf16"),  # Llama-3-8B
    _prefill("P02", 4, 1000, 128, "bf16"),  # not a multiple of the tile
    _prefill("P03", 2, 4000, 128, "bf16"),
    _prefill("P04", 2, 4096, 128, "fp16"),  # Mistral-7B
    _prefill("P05", 2, 4096, 128, "bf16", num_q_heads=28, num_kv_heads=4),  # Qwen2.5-7B: group 7
    _prefill("P06", 1, 32768, 128, "bf16", num_q_heads=28, num_kv_heads=4),
    _prefill("P07", 8, 4096, 128, "bf16", num_q_heads=8, num_kv_heads=1),  # Llama-3-70B, TP8
    _prefill("P08", 8, 2048, 64, "bf16"),  # Llama-3.2-1B
    _prefill("P09", 4, 2048, 80, "bf16", num_q_heads=32, num_kv_heads=32),  # Phi-2 (MHA, head_dim 80)
    _prefill("P10", 4, 2048, 96, "bf16", num_q_heads=32, num_kv_heads=32),  # Phi-3-mini
    _prefill("P11", 4, 4096, 256, "bf16", num_q_heads=16, num_kv_heads=8),  # Gemma-2-9B
    _prefill("P12", 2, 8192, 256, "bf16", num_q_heads=16, num_kv_heads=16),  # Gemma-7B
    _prefill("P13", 4, 2048, 192, "bf16", num_q_heads=16, num_kv_heads=16),  # head_dim 192 (MLA-style prefill)
    _prefill("P14", 4, 2048, 64, "bf16", num_q_heads=71, num_kv_heads=1),  # Falcon-7B (MQA)
    _prefill("P15", 2, 4096, 128, "bf16", num_q_heads=48, num_kv_heads=1),  # StarCoder-15B (MQA)
    _prefill("P16", 16, 1024, 128, "bf16", num_q_heads=12, num_kv_heads=2),  # Qwen2-1.5B: group 6
    _prefill("P17", 4, 4096, 128, "bf16", num_q_heads=32, num_kv_heads=32),  # Llama-2-7B (MHA)
    _prefill("P18", 64, 256, 128, "bf16"),  # many short sequences
    _prefill("P19", 4, 4096, 64, "bf16", num_q_heads=64, num_kv_heads=8),  # gpt-oss-20b
    Case("P20", 4, 512, 8192, 32, 8, 128, "bf16", True, "prefill"),  # chunked prefill against a cache
    _prefill("P21", 8, 2048, 128, "fp16"),
    _prefill("P22", 4, 3000, 128, "bf16", num_q_heads=32, num_kv_heads=4),  # Qwen3-30B-A3B
    _prefill("P23", 2, 2048, 64, "fp32"),
    _prefill("P24", 1, 4096, 128, "fp32"),
)
SWEEP_BY_NAME = {c.name.lower(): c for c in SHAPE_SWEEP}


def parse_cases(text: str) -> list[Case]:
    """'S0,H1' -> [Case S0, Case H1] (case-insensitive, order kept, duplicates dropped)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no case named; expected e.g. --cases S0,H1")
    unknown = [n for n in names if n.lower() not in CASE_BY_NAME]
    if unknown:
        known = ", ".join(c.name for c in CASES)
        raise argparse.ArgumentTypeError(f"unknown case {', '.join(map(repr, unknown))}; known cases: {known}")
    picked = [CASE_BY_NAME[n.lower()] for n in names]
    return list(dict.fromkeys(picked))


# ---------------------------------------------------------------------------
# Counters: the one FLOP formula and the one byte count
# ---------------------------------------------------------------------------
def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of (query, key) pairs that enter the softmax, for one (batch, head).

    Causal is aligned bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q,
    i.e. min(seqlen_k, max(0, i + seqlen_k - seqlen_q + 1)) keys. The min never binds
    (i <= seqlen_q - 1), so the counts form the arithmetic run first..seqlen_k over the
    queries that see at least one key. seqlen_q 3, seqlen_k 5: 3+4+5 = 12;
    seqlen_q 5, seqlen_k 3: 0+0+1+2+3 = 6.
    """
    if not causal:
        return seqlen_q * seqlen_k
    offset = seqlen_k - seqlen_q
    first_query = max(0, -offset)  # the first query that sees any key
    n = seqlen_q - first_query
    if n <= 0:
        return 0
    first_count = first_query + offset + 1
    return n * (first_count + seqlen_k) // 2


BACKWARD_FLOP_FACTOR = 2.5  # the backward pass: five matrix products to the forward's two


def attention_flops(case: Case) -> int:
    """4 * head_dim per visible pair (QK^T and PV, a multiply-add each) * batch * num_q_heads;
    for a backward case 2.5 times that (QK^T, dO V^T, P^T dO, dS^T Q, dS K)."""
    flops = 4 * case.head_dim * visible_pairs(case.seqlen_q, case.seqlen_k, case.causal) * case.batch * case.num_q_heads
    return int(flops * BACKWARD_FLOP_FACTOR) if case.kind == "backward" else flops


# ---------------------------------------------------------------------------
# Modifier cases (--modifiers): each against a baseline from the same run
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModCase:
    """A prefill case with modifiers (``attention`` keywords), and what it is compared with."""

    name: str
    case: Case
    mods: tuple  # ((keyword, value), ...)
    baseline: str  # how the baseline time is made (see run_modifier_case)


def softcap_score_mod(cupy_gqa, cap: float = 30.0):
    """softcap 30 written by a user: a score_mod in units of the cap, the built-in's spelling
    (the same bits as softcap=30 for fp16 and bf16 inputs)."""
    return cupy_gqa.ScoreMod(cuda="return fast_tanh(score);", unit=cap, bounds=(-1, 1))


MOD_CASES: tuple[ModCase, ...] = (
    # sliding window: torch's SDPA takes no window, so the baseline is cupy_gqa's own causal
    # call of the shape, its time scaled by the visible pairs (window / causal)
    ModCase("W1", _prefill("W1", 4, 8192, 128, "bf16"), (("window", (1024, 0)),), "causal_scaled"),
    # softcap on H1, against cupy_gqa's H1 without it
    ModCase("W2", _prefill("W2", 4, 4096, 128, "bf16"), (("softcap", 30.0),), "plain"),
    # the same softcap as a user's score_mod (softcap_score_mod), against H1 without it
    ModCase("W3", _prefill("W3", 4, 4096, 128, "bf16"), (("score_mod", softcap_score_mod),), "plain"),
)


def window_visible_pairs(seqlen_q: int, seqlen_k: int, window: tuple, causal: bool = True) -> int:
    """(query, key) pairs a window (left, right) leaves visible (bottom-right; -1 unbounded;
    causal caps right at 0): the FLOP basis of a windowed call."""
    left, right = window
    right = 0 if causal else right
    offset = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        lo = 0 if left < 0 else max(0, i + offset - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + offset + right)
        total += max(0, hi - lo + 1)
    return total


def modifier_flops(mc: ModCase) -> int:
    """4 * head_dim per visible pair, the window's pairs where there is one."""
    c, mods = mc.case, dict(mc.mods)
    if "window" in mods:
        pairs = window_visible_pairs(c.seqlen_q, c.seqlen_k, mods["window"], c.causal)
        return 4 * c.head_dim * pairs * c.batch * c.num_q_heads
    return attention_flops(c)


def run_modifier_case(torch, cupy_gqa, timer, mc: ModCase, log) -> dict:
    """Time cupy_gqa[auto] with the case's modifiers and its baseline in the same run:
    "plain": the same call without modifiers; "causal_scaled": the causal call without
    the window, its time scaled by window pairs / causal pairs (the time the window
    would take if cost followed the band exactly)."""
    c = mc.case
    mods = {k_: v_(cupy_gqa) if callable(v_) else v_ for k_, v_ in mc.mods}  # (a user modifier: made here)
    q, k, v = make_inputs(torch, c)
    with_mods = lambda: cupy_gqa.attention(q, k, v, causal=c.causal, **mods)  # noqa: E731
    plain = lambda: cupy_gqa.attention(q, k, v, causal=c.causal)  # noqa: E731
    for fn in (with_mods, plain):
        _first_call(torch, fn)
    timings = timer.many({"mods": with_mods, "plain": plain})
    t_mod, t_plain = timings["mods"], timings["plain"]
    base_ms = t_plain.ms
    if mc.baseline == "causal_scaled":
        base_ms *= modifier_flops(mc) / attention_flops(c)
    row = {
        "case": mc.name, "shape": c.describe(),
        "mods": {k_: list(v_) if isinstance(v_, tuple) else v_ if isinstance(v_, (int, float)) else repr(v_) for k_, v_ in mods.items()},
        "ms": t_mod.ms, "tflops": modifier_flops(mc) / (t_mod.ms * 1e-3) / 1e12, "baseline": mc.baseline,
        "baseline_ms": base_ms, "plain_ms": t_plain.ms, "vs_baseline": t_mod.ms / base_ms,
    }  # fmt: skip
    log(f"  {mc.name:3} {t_mod.ms:9.4f} ms {row['tflops']:7.1f} TF/s  baseline ({mc.baseline}) {base_ms:9.4f} ms  "
        f"ratio {row['vs_baseline']:.3f}")  # fmt: skip
    del q, k, v
    torch.cuda.empty_cache()
    return row


def kv_bytes(case: Case) -> int:
    """Bytes of K and V: the traffic that bounds decode, and the GB/s basis of every row."""
    return case.batch * case.seqlen_k * case.num_kv_heads * case.head_dim * case.itemsize * 2


def gpu_tag(gpu_name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100': the results' file stem."""
    words = gpu_name.lower().replace("nvidia", " ").replace("geforce", " ").replace("-", " ").split()
    tag = []
    for w in words:
        tag.append("".join(ch for ch in w if ch.isalnum()))
        if any(ch.isdigit() for ch in w):
            break
    return "".join(tag) or "gpu"


# ---------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------
@dataclass
class Row:
    case: str
    impl: str
    ms: float | None = None
    reps: int | None = None
    tflops: float | None = None
    gbps: float | None = None
    rel_err: float | None = None
    ref_scope: str | None = None
    compile_s: float | None = None
    compile_cached_s: float | None = None
    peak_extra_mib: float | None = None
    host_us: float | None = None  # per-call and paged cases: host time of one call, GPU idle before it
    vs: dict = field(default_factory=dict)  # anchor name -> this time / anchor time
    note: str = ""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        vs = d.pop("vs")
        d.update({f"vs_{name}": ratio for name, ratio in vs.items()})
        return d


def finish_row(row: Row, case: Case) -> Row:
    """Fill TFLOP/s and GB/s from ms."""
    if row.ms:
        row.tflops = attention_flops(case) / (row.ms * 1e-3) / 1e12
        row.gbps = kv_bytes(case) / (row.ms * 1e-3) / 1e9
    return row


def add_ratios(rows: list[Row]) -> None:
    """vs_<anchor> = cupy_gqa time / anchor time, per case."""
    anchor_ms = {(r.case, r.impl): r.ms for r in rows if r.impl in ANCHORS and r.ms}
    for r in rows:
        if r.impl.startswith("cupy_gqa") and r.ms:
            r.vs = {a: r.ms / anchor_ms[(r.case, a)] for a in ANCHORS if (r.case, a) in anchor_ms}


# ---------------------------------------------------------------------------
# GPU stack (lazy)
# ---------------------------------------------------------------------------
NO_GPU_MESSAGE = "bench_attention: no CUDA device found; this benchmark needs an NVIDIA GPU visible to torch and CuPy"


def load_gpu_stack():
    """Import torch, CuPy and cupy_gqa, or exit non-zero with one clear line."""
    try:
        import torch
    except ImportError as e:
        sys.exit(f"{NO_GPU_MESSAGE} (torch is not importable: {e})")
    if not torch.cuda.is_available():
        sys.exit(f"{NO_GPU_MESSAGE} (torch.cuda.is_available() is False)")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("getDeviceCount() is 0")
    except Exception as e:  # ImportError, CUDARuntimeError, ...
        sys.exit(f"{NO_GPU_MESSAGE} (CuPy: {type(e).__name__}: {e})")
    sys.path.insert(0, str(REPO_ROOT))  # benchmark the checkout this script belongs to
    try:
        import cupy_gqa
    except ImportError as e:
        sys.exit(f"bench_attention: cannot import cupy_gqa from {REPO_ROOT}: {e}")
    return torch, cupy, cupy_gqa


def route_cupy_through_torch(torch, cupy) -> None:
    """Make CuPy allocate from torch's caching allocator: one pool, one peak counter."""

    def alloc(size: int):
        buf = torch.empty(size, dtype=torch.uint8, device=DEVICE)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(buf.data_ptr(), size, buf), 0)

    cupy.cuda.set_allocator(alloc)


def make_inputs(torch, case: Case, seed: int = 0):
    """Random normal q, k, v in (batch, seqlen, heads, head_dim) layout."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(seqlen, heads):
        return torch.randn((case.batch, seqlen, heads, case.head_dim), dtype=dtype, device=DEVICE, generator=gen)

    return randn(case.seqlen_q, case.num_q_heads), randn(case.seqlen_k, case.num_kv_heads), randn(case.seqlen_k, case.num_kv_heads)


# ---------------------------------------------------------------------------
# The one timer
# ---------------------------------------------------------------------------
@dataclass
class Timing:
    ms: float
    reps: int


class Timer:
    """CUDA-event timer: warm-up, L2 flush before each rep, median over reps.
    calls and host_calls are the counts of the per-call cases (per_call_ms, host_time_us)."""

    def __init__(self, torch, *, fast_reps: int, slow_reps: int, slow_ms: float = SLOW_CALL_MS,
                 calls: int = CALLS, host_calls: int = HOST_CALLS):
        self.torch = torch
        self.fast_reps, self.slow_reps, self.slow_ms = fast_reps, slow_reps, slow_ms
        self.calls, self.host_calls = calls, host_calls
        self.flush_buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=DEVICE)
        self.spin = getattr(torch.cuda, "_sleep", lambda cycles: None)

    def _timed(self, fn, n: int) -> list[float]:
        cuda = self.torch.cuda
        starts = [cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [cuda.Event(enable_timing=True) for _ in range(n)]
        for start, end in zip(starts, ends):
            self.flush_buf.zero_()  # evict L2
            self.spin(HEAD_START_CYCLES)  # the host's head start: it queues fn before the GPU gets to start
            start.record()
            fn()
            end.record()
        cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def _reps(self, fn) -> int:
        first = self._timed(fn, 1)[0]  # warm-up, and the slow/fast decision
        if first < self.slow_ms:
            self._timed(fn, 2)  # more warm-up for fast calls (clocks, allocator)
            return self.fast_reps
        return self.slow_reps

    def __call__(self, fn) -> Timing:
        n = self._reps(fn)
        return Timing(statistics.median(self._timed(fn, n)), n)

    def many(self, fns: dict) -> dict:
        """Time the implementations of one case (name -> fn) in TIMING_ROUNDS
        rounds, in turn, the order reversed every other round; each is warmed up
        and gets its reps as __call__ gives them (rounded up to whole rounds).
        Returns name -> Timing (the median over all its reps)."""
        reps = {name: -(-self._reps(fn) // TIMING_ROUNDS) for name, fn in fns.items()}
        times: dict = {name: [] for name in fns}
        names = list(fns)
        for r in range(TIMING_ROUNDS):
            for name in names if r % 2 == 0 else names[::-1]:
                times[name] += self._timed(fns[name], reps[name])
        return {name: Timing(statistics.median(t), len(t)) for name, t in times.items()}


def per_call_ms(fn, sync, calls: int, warmup: int = CALL_WARMUP, clock=time.perf_counter) -> float:
    """Wall milliseconds per call of `calls` back-to-back calls of fn, after `warmup` calls:
    the clock around the loop, which ends with sync() (the device's work done). No L2 flush."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - t0) / calls * 1e3


def host_time_us(fn, sync, calls: int, clock=time.perf_counter) -> float:
    """Median host microseconds of one call of fn with the device idle before it
    (sync(), then the clock around the call), as benchmarks/overhead.py measures it."""
    times = []
    for _ in range(calls):
        sync()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    sync()
    return statistics.median(times) * 1e6


# ---------------------------------------------------------------------------
# Implementations: each is (name, fn) with fn() -> out (batch, seqlen_q, num_q_heads, head_dim)
# ---------------------------------------------------------------------------
def cupy_gqa_impls(cupy_gqa, case: Case, q, k, v) -> list:
    def make(kernel):
        return lambda: cupy_gqa.attention(q, k, v, causal=case.causal, kernel=kernel)

    return [(f"cupy_gqa[{name}]", make(name)) for name in ("auto", *cupy_gqa.KERNELS)]


def auto_kernel(case: Case, q, k, v) -> str:
    """The kernel family cupy_gqa's kernel="auto" picks for this case (its own dispatch rule)."""
    import cupy

    from cupy_gqa import _plan

    qb, kb, vb = (cupy.from_dlpack(x) for x in (q, k, v))
    problem = _plan.Problem.of(qb, kb, dtype=qb.dtype.name, causal=case.causal, softmax_scale=case.head_dim**-0.5)
    return _plan.choose_kernel(problem, qb, kb, vb, qb)


def _torch_mask_kwargs(torch, case: Case, device) -> dict:
    """torch's is_causal is aligned top-left; translate our bottom-right causal."""
    if not case.causal or case.seqlen_q == 1:  # a single query sees the whole cache
        return {}
    if case.seqlen_q == case.seqlen_k:  # top-left == bottom-right
        return {"is_causal": True}
    i = torch.arange(case.seqlen_q, device=device)[:, None]
    j = torch.arange(case.seqlen_k, device=device)[None, :]
    return {"attn_mask": j <= i + case.seqlen_k - case.seqlen_q}


def torch_impls(torch, case: Case, q, k, v) -> tuple[list, list]:
    """The torch anchors for this case, and (name, reason) for those left out up front."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (batch, heads, seqlen, head_dim) views
    mask = _torch_mask_kwargs(torch, case, q.device)

    def sdpa(backend=None):
        def call():
            if backend is None:
                o = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True, **mask)
            else:
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True, **mask)
            return o.transpose(1, 2)

        return call

    def efficient_expanded():
        # the efficient backend rejects enable_gqa: repeat each KV head group_size times
        ke = k.repeat_interleave(case.group_size, dim=2).transpose(1, 2)
        ve = v.repeat_interleave(case.group_size, dim=2).transpose(1, 2)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(qt, ke, ve, **mask).transpose(1, 2)

    if case.kind == "memory":
        return [("torch_efficient_expanded", efficient_expanded)], []
    impls, left_out = [("torch_auto", sdpa())], []
    impls += [("torch_flash", sdpa(SDPBackend.FLASH_ATTENTION)), ("torch_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))]
    if case.score_elements * 4 > TORCH_MATH_MAX_BYTES:
        left_out.append(("torch_math", f"{case.score_elements * 4 / 1e9:.1f} GB of fp32 scores > {TORCH_MATH_MAX_BYTES / 1e9:.0f} GB"))
    else:
        impls.append(("torch_math", sdpa(SDPBackend.MATH)))
    impls.append(("torch_efficient_expanded", efficient_expanded))
    if case.name == "S0":
        impls.append(("naive_loop", lambda: naive_loop(torch, q, k, v, causal=case.causal)))
        try:
            impls.append(("seed_kernel", seed_kernel(torch, q, k, v)))
        except Exception as e:  # no nvcc / ninja: the ANCHORS.md figure stands alone
            left_out.append(("seed_kernel", f"{type(e).__name__}: {e}"[:120]))
    return impls, left_out


# The seed's design, rebuilt to time it in the same run as everything else: a
# torch C++/CUDA extension (load_inline, as the seed was), one thread per
# (batch, head, position) in (b, h, t) order, 256 threads a block, q and the
# accumulator in fixed 32-float arrays (head_dim <= 32), an online softmax with
# expf, contiguous fp32 only; the wrapper makes the inputs contiguous and the
# output with zeros_like, as the seed's did.
_SEED_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
__global__ void seed_design_kernel(const float* q, const float* k, const float* v, float* out,
                                   int batch, int seqlen, int num_q_heads, int num_kv_heads, int head_dim,
                                   float scale) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= batch * num_q_heads * seqlen) return;
    const int t = idx % seqlen, h = (idx / seqlen) % num_q_heads, b = idx / (seqlen * num_q_heads);
    const int kv_h = h / (num_q_heads / num_kv_heads);
    const float* qp = q + ((long long)(b * seqlen + t) * num_q_heads + h) * head_dim;
    float qv[32], acc[32];
    for (int d = 0; d < head_dim; ++d) { qv[d] = qp[d]; acc[d] = 0.f; }
    float m = -INFINITY, l = 0.f;
    for (int s = 0; s <= t; ++s) {
        const long long off = ((long long)(b * seqlen + s) * num_kv_heads + kv_h) * head_dim;
        float score = 0.f;
        for (int d = 0; d < head_dim; ++d) score += qv[d] * k[off + d];
        score *= scale;
        const float m_new = fmaxf(m, score), a = expf(m - m_new), p = expf(score - m_new);
        for (int d = 0; d < head_dim; ++d) acc[d] = acc[d] * a + p * v[off + d];
        l = l * a + p;
        m = m_new;
    }
    float* op = out + ((long long)(b * seqlen + t) * num_q_heads + h) * head_dim;
    for (int d = 0; d < head_dim; ++d) op[d] = acc[d] / l;
}
torch::Tensor seed_design(torch::Tensor q, torch::Tensor k, torch::Tensor v) {
    auto out = torch::zeros_like(q);
    const int batch = q.size(0), seqlen = q.size(1), hq = q.size(2), d = q.size(3), hkv = k.size(2);
    const int total = batch * hq * seqlen;
    seed_design_kernel<<<(total + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
        batch, seqlen, hq, hkv, d, 1.0f / sqrtf((float)d));
    return out;
}
"""


# torch builds the seed's extension under a lock file that a build killed midway
# (a run stopped by a time limit) leaves behind, and every later build then waits
# for it forever; a build takes about a minute, so a lock older than this is stale
SEED_LOCK_STALE_S = 300


def seed_kernel(torch, q, k, v):
    """A call of the seed's design on (q, k, v): fp32, head_dim <= 32, equal lengths, causal."""
    from torch.utils.cpp_extension import load_inline

    build = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cupy_gqa_bench" / "seed_design"
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > SEED_LOCK_STALE_S:
        lock.unlink(missing_ok=True)
    module = load_inline(
        name="cupy_gqa_bench_seed_design",
        cpp_sources="torch::Tensor seed_design(torch::Tensor q, torch::Tensor k, torch::Tensor v);",
        cuda_sources=_SEED_CUDA,
        functions=["seed_design"],
        extra_cuda_cflags=["-O3"],
        build_directory=str(build),
    )
    return lambda: module.seed_design(q.contiguous(), k.contiguous(), v.contiguous())


def naive_loop(torch, q, k, v, *, causal: bool):
    """The per-position PyTorch loop the seed kernel replaced."""
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group_size, dim=2)  # query head h reads kv head h // group_size
    v = v.repeat_interleave(group_size, dim=2)
    softmax_scale = head_dim**-0.5
    out = torch.zeros_like(q)
    for t in range(seqlen_q):
        n = t + seqlen_k - seqlen_q + 1 if causal else seqlen_k  # keys 0..n-1 are visible
        if n <= 0:
            continue
        s = torch.einsum("bhd,bjhd->bhj", q[:, t], k[:, :n]) * softmax_scale
        out[:, t] = torch.einsum("bhj,bjhd->bhd", s.softmax(dim=-1), v[:, :n])
    return out


# ---------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------
def reference_scope(case: Case) -> tuple[str, tuple[slice, ...]]:
    """Which part of the output the reference covers, as (label, index into out)."""
    if case.score_elements <= REF_FULL_MAX_SCORES:
        return "full", (slice(None),)
    g = case.group_size
    return f"b0 h0-{g - 1}", (slice(0, 1), slice(None), slice(0, g))


def reference(torch, case: Case, q, k, v, index: tuple[slice, ...]):
    """float64 attention on the batches and query heads selected by index, in chunks."""
    batches = range(case.batch)[index[0]]
    q_heads = range(case.num_q_heads)[index[2]] if len(index) > 2 else range(case.num_q_heads)
    g = case.group_size
    kv_heads = sorted({h // g for h in q_heads})  # GQA: kv_head = q_head // group_size
    softmax_scale = case.head_dim**-0.5
    offset = case.seqlen_k - case.seqlen_q
    rows = max(1, REF_BLOCK_SCORES // (g * case.seqlen_k))
    key = torch.arange(case.seqlen_k, device=q.device)
    out = torch.empty((len(batches), case.seqlen_q, len(kv_heads) * g, case.head_dim), dtype=torch.float64, device=q.device)
    for bi, b in enumerate(batches):
        for hi, h in enumerate(kv_heads):
            kh, vh = k[b, :, h].double(), v[b, :, h].double()  # (seqlen_k, head_dim)
            for r0 in range(0, case.seqlen_q, rows):
                r1 = min(case.seqlen_q, r0 + rows)
                qb = q[b, r0:r1, h * g : (h + 1) * g].double().transpose(0, 1)  # (g, rows, head_dim)
                s = (qb @ kh.T) * softmax_scale
                if case.causal:  # query i sees keys j <= i + seqlen_k - seqlen_q
                    hidden = key[None, :] > torch.arange(r0, r1, device=q.device)[:, None] + offset
                    s.masked_fill_(hidden, -math.inf)
                p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a row that sees no key is 0
                out[bi, r0:r1, hi * g : (hi + 1) * g] = (p @ vh).transpose(0, 1)
    return out


def rel_err(out, ref, index) -> float:
    o = out[index].double()
    return float((o - ref).norm() / ref.norm())


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------
def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:110]}"


def _not_run(case: Case, name: str, e: BaseException, skipped: list, log) -> bool:
    """Record an impl that raised instead of running; True if that is a failure.
    A cupy_gqa kernel raises ValueError / TypeError for a case it does not
    support, and anything else from it is a bug; an anchor that raises is
    simply not available."""
    expected = not name.startswith("cupy_gqa") or isinstance(e, (ValueError, TypeError))
    skipped.append({"case": case.name, "impl": name, "reason": _short(e) if expected else f"FAILED {_short(e)}"})
    log(f"  {case.name:4} {name}: {'skipped' if expected else 'FAILED'} ({_short(e)})")
    return not expected


def _first_call(torch, fn):
    """Run fn once, synchronized; return (out, wall seconds)."""
    import warnings

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sdpa_kernel warns at length before it raises
        out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def measure_all(torch, timer: Timer, case: Case, impls: list, ref, scope: str, index, on_error) -> list[Row]:
    """The rows of a case's implementations ((name, fn) pairs): each one's first
    call and rel_err (measure_first), then all of them timed together
    (Timer.many). on_error(name, exception) hears of each that fails; its row
    is left out."""
    first = []
    for name, fn in impls:
        try:
            first.append((measure_first(torch, case, name, fn, ref, scope, index), fn))
        except Exception as e:
            on_error(name, e)
            torch.cuda.empty_cache()
    timed = {row.impl: fn for (row, _), fn in first if case.kind != "memory"}
    timings = timer.many(timed) if timed else {}
    rows = []
    for (row, first_s), _ in first:
        t = timings.get(row.impl)
        if t is not None:
            row.ms, row.reps = t.ms, t.reps
            if row.impl.startswith("cupy_gqa"):
                row.compile_s = max(0.0, first_s - t.ms * 1e-3)
        rows.append(finish_row(row, case))
    return rows


def measure_first(torch, case: Case, name: str, fn, ref, scope: str, index) -> tuple[Row, float]:
    """One row's first call (compile, or peak memory for a memory case) and
    rel_err; with the first call's seconds."""
    row = Row(case.name, name, ref_scope=scope)
    if case.kind == "memory":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()  # inputs, reference and anything else alive
        torch.cuda.reset_peak_memory_stats()
    out, first_s = _first_call(torch, fn)
    if case.kind == "memory":
        peak = torch.cuda.max_memory_allocated()  # read before rel_err allocates anything
        row.peak_extra_mib = (peak - base - out.numel() * out.element_size()) / 2**20
        row.note = "one call; peak beyond inputs and output"
    row.rel_err = rel_err(out, ref, index)
    del out
    return row, first_s


# ---------------------------------------------------------------------------
# The backward pass (kind "backward")
# ---------------------------------------------------------------------------
BACKWARD_MEMORY_CASES = ("G1",)  # backward cases whose first call also reports peak extra memory


def backward_inputs(torch, cupy_gqa, case: Case):
    """q, k, v, dout, and out, lse from cupy_gqa's forward."""
    q, k, v = make_inputs(torch, case)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    dout = torch.randn(q.shape, dtype=q.dtype, device=DEVICE, generator=gen)
    with torch.no_grad():
        out, lse = cupy_gqa.attention(q, k, v, causal=case.causal, return_lse=True)
    return q, k, v, dout, out, lse


def backward_kernel(case: Case, q, k) -> str:
    """The backward kernels cupy_gqa runs for this case: backward_mma (tensor cores; float32 in
    split TF32: backward_tf32) or backward_rows (CUDA cores)."""
    import cupy

    from cupy_gqa import _plan

    qb, kb = (cupy.from_dlpack(x) for x in (q, k))
    problem = _plan.Problem.of(qb, kb, dtype=qb.dtype.name, causal=case.causal, softmax_scale=case.head_dim**-0.5)
    mma = _plan.backward_mma_unsupported(problem, _plan.device_arch(qb.device.id)) is None
    if not mma:
        return "backward_rows"
    return "backward_tf32" if problem.dtype == "float32" else "backward_mma"


def backward_cupy_impls(cupy_gqa, case: Case, q, k, v, dout, out, lse) -> list:
    return [("cupy_gqa[auto]", lambda: cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal=case.causal))]


def backward_torch_impls(torch, case: Case, q, k, v, dout) -> list:
    """(name, make) for the torch anchors: make() runs the forward once in the
    backend (raising if it can't) and returns the timed backward call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = _torch_mask_kwargs(torch, case, q.device)

    def anchor(backend, expanded):
        def make():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            ql, kl, vl = leaves
            if expanded:  # the efficient backend rejects enable_gqa: K, V repeated in the graph
                kl, vl = (x.repeat_interleave(case.group_size, dim=2) for x in (kl, vl))
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(
                    ql.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2), enable_gqa=not expanded, **mask
                )
            do = dout.transpose(1, 2)
            return lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)

        return make

    return [
        ("torch_flash", anchor(SDPBackend.FLASH_ATTENTION, False)),
        ("torch_cudnn", anchor(SDPBackend.CUDNN_ATTENTION, False)),
        ("torch_efficient_expanded", anchor(SDPBackend.EFFICIENT_ATTENTION, True)),
    ]


def reference_backward(torch, case: Case, q, k, v, dout, index: tuple[slice, ...]):
    """float64 (dq, dk, dv) of the definition on the batches and KV-head groups that
    index selects (reference_scope), by autograd through the float64 forward."""
    batches = range(case.batch)[index[0]]
    g = case.group_size
    q_heads = range(case.num_q_heads)[index[2]] if len(index) > 2 else range(case.num_q_heads)
    kv_heads = sorted({h // g for h in q_heads})
    offset = case.seqlen_k - case.seqlen_q
    key = torch.arange(case.seqlen_k, device=q.device)
    grads = [torch.empty((len(batches), n, len(kv_heads) * m, case.head_dim), dtype=torch.float64, device=q.device)
             for n, m in ((case.seqlen_q, g), (case.seqlen_k, 1), (case.seqlen_k, 1))]  # fmt: skip
    for bi, b in enumerate(batches):
        for hi, h in enumerate(kv_heads):
            qb = q[b, :, h * g : (h + 1) * g].double().transpose(0, 1).requires_grad_()  # (g, seqlen_q, head_dim)
            kh, vh = (x[b, :, h].double().requires_grad_() for x in (k, v))
            s = (qb @ kh.T) * case.head_dim**-0.5
            if case.causal:
                hidden = key[None, :] > torch.arange(case.seqlen_q, device=q.device)[:, None] + offset
                s = s.masked_fill(hidden, -math.inf)
            o = torch.softmax(s, dim=-1).nan_to_num(0.0) @ vh
            dq, dk, dv = torch.autograd.grad(o, (qb, kh, vh), dout[b, :, h * g : (h + 1) * g].double().transpose(0, 1))
            grads[0][bi, :, hi * g : (hi + 1) * g] = dq.transpose(0, 1)
            grads[1][bi, :, hi], grads[2][bi, :, hi] = dk, dv
            del s, o
    return grads


def measure_backward(torch, timer: Timer, case: Case, name: str, fn, refs, scope: str, index) -> Row:
    """One backward row: the first call (compile; peak memory for BACKWARD_MEMORY_CASES),
    rel_err of the worst gradient, then the timer."""
    row = Row(case.name, name, ref_scope=scope)
    memory = case.name in BACKWARD_MEMORY_CASES
    if memory:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    grads, first_s = _first_call(torch, fn)
    if memory:
        peak = torch.cuda.max_memory_allocated()
        row.peak_extra_mib = (peak - base - sum(g.numel() * g.element_size() for g in grads)) / 2**20
        row.note = "peak beyond inputs and gradients"
    kv_index = index if len(index) < 3 else (index[0], slice(None), slice(0, len(range(case.num_q_heads)[index[2]]) // case.group_size))
    row.rel_err = max(rel_err(g, r, i) for g, r, i in zip(grads, refs, (index, kv_index, kv_index)))
    del grads
    t = timer(fn)
    row.ms, row.reps = t.ms, t.reps
    if name.startswith("cupy_gqa"):
        row.compile_s = max(0.0, first_s - t.ms * 1e-3)
    return finish_row(row, case)


def run_backward_case(torch, cupy_gqa, timer: Timer, case: Case, log) -> tuple[list[Row], list[dict], bool]:
    """Benchmark one backward case, as run_case does a forward one."""
    q, k, v, dout, out, lse = backward_inputs(torch, cupy_gqa, case)
    scope, index = reference_scope(case)
    refs = reference_backward(torch, case, q, k, v, dout, index)
    rows, skipped, failed = [], [], False
    impls = [(name, lambda fn=fn: fn) for name, fn in backward_cupy_impls(cupy_gqa, case, q, k, v, dout, out, lse)]
    for name, make in impls + backward_torch_impls(torch, case, q, k, v, dout):
        try:
            fn = make()
            row = measure_backward(torch, timer, case, name, fn, refs, scope, index)
        except Exception as e:
            failed |= _not_run(case, name, e, skipped, log)
            fn = None
            torch.cuda.empty_cache()
            continue
        fn = None  # frees a torch anchor's retained graph
        if name == "cupy_gqa[auto]":
            row.note = (row.note + "; " if row.note else "") + f"auto runs {backward_kernel(case, q, k)}"
        rows.append(row)
        log("  " + _progress(row))
    del q, k, v, dout, out, lse, refs
    torch.cuda.empty_cache()
    return rows, skipped, failed


# ---------------------------------------------------------------------------
# Per-call cases (kind "call")
# ---------------------------------------------------------------------------
CALL_IMPLS = ("cupy_gqa[auto]", "cupy_gqa[auto,cupy]", "torch_auto")


def call_impls(torch, cupy_gqa, case: Case, q, k, v) -> list:
    """(name, fn, as_torch, allocator) per CALL_IMPLS: fn() is one call, as_torch(out)
    its output as a torch tensor (for rel_err), allocator the CuPy allocator to measure
    it under (None: the run's, which is torch's caching allocator)."""
    import cupy

    qc, kc, vc = (cupy.from_dlpack(x) for x in (q, k, v))  # CuPy arrays over the same memory
    attention, causal = cupy_gqa.attention, case.causal
    torch_auto = dict(torch_impls(torch, case, q, k, v)[0])["torch_auto"]

    def same(out):
        return out

    return [
        ("cupy_gqa[auto]", lambda: attention(q, k, v, causal=causal), same, None),
        ("cupy_gqa[auto,cupy]", lambda: attention(qc, kc, vc, causal=causal), torch.from_dlpack,
         cupy.get_default_memory_pool().malloc),
        ("torch_auto", torch_auto, same, None),
    ]


def measure_call(torch, timer: Timer, case: Case, name: str, fn, as_torch, ref, scope: str, index) -> Row:
    """One per-call row: the first call (compile; rel_err), then ms per call of
    timer.calls back-to-back calls and the host time of one call."""
    row = Row(case.name, name, ref_scope=scope, note="per call, back to back")
    out, first_s = _first_call(torch, fn)
    row.rel_err = rel_err(as_torch(out), ref, index)
    del out
    sync = torch.cuda.synchronize
    row.ms, row.reps = per_call_ms(fn, sync, timer.calls), timer.calls
    row.host_us = host_time_us(fn, sync, timer.host_calls)
    if name.startswith("cupy_gqa"):
        row.compile_s = max(0.0, first_s - row.ms * 1e-3)
    return finish_row(row, case)


def run_call_case(torch, cupy_gqa, timer: Timer, case: Case, log) -> tuple[list[Row], list[dict], bool]:
    """Benchmark one per-call case, as run_case does a forward one."""
    import contextlib

    import cupy

    q, k, v = make_inputs(torch, case)
    scope, index = reference_scope(case)
    ref = reference(torch, case, q, k, v, index)
    rows, skipped, failed = [], [], False
    for name, fn, as_torch, allocator in call_impls(torch, cupy_gqa, case, q, k, v):
        try:
            with cupy.cuda.using_allocator(allocator) if allocator else contextlib.nullcontext():
                row = measure_call(torch, timer, case, name, fn, as_torch, ref, scope, index)
        except Exception as e:
            failed |= _not_run(case, name, e, skipped, log)
            torch.cuda.empty_cache()
            continue
        finally:
            cupy.get_default_memory_pool().free_all_blocks()
        if name.startswith("cupy_gqa[auto"):
            row.note += f"; auto runs {auto_kernel(case, q, k, v)}"
        rows.append(row)
        log("  " + _progress(row))
    del q, k, v, ref
    torch.cuda.empty_cache()
    return rows, skipped, failed


def run_case(torch, cupy_gqa, timer: Timer, case: Case, log) -> tuple[list[Row], list[dict], bool]:
    """Benchmark one case. Returns (rows, skipped impls, whether a cupy_gqa call failed unexpectedly)."""
    if case.kind == "backward":
        return run_backward_case(torch, cupy_gqa, timer, case, log)
    if case.kind == "call":
        return run_call_case(torch, cupy_gqa, timer, case, log)
    if case.kind in ("paged", "varlen"):
        return run_seq_case(torch, cupy_gqa, timer, case, log)
    q, k, v = make_inputs(torch, case)
    scope, index = reference_scope(case)
    ref = reference(torch, case, q, k, v, index)
    anchors, left_out = torch_impls(torch, case, q, k, v)
    ours = cupy_gqa_impls(cupy_gqa, case, q, k, v)
    if case.kind == "memory":
        ours = ours[:1]  # cupy_gqa[auto] only
    skipped, failures = [], []
    for name, why in left_out:
        skipped.append({"case": case.name, "impl": name, "reason": why})
        log(f"  {case.name:4} {name}: skipped ({why})")
    rows = measure_all(torch, timer, case, ours + anchors, ref, scope, index,
                       lambda name, e: failures.append(_not_run(case, name, e, skipped, log)))  # fmt: skip
    failed = any(failures)
    for row in rows:
        if row.impl == "cupy_gqa[auto]":
            row.note = (row.note + "; " if row.note else "") + f"auto runs {auto_kernel(case, q, k, v)}"
        log("  " + _progress(row))
    del q, k, v, ref
    torch.cuda.empty_cache()
    return rows, skipped, failed


def run_seq_case(torch, cupy_gqa, timer: Timer, case: Case, log) -> tuple[list[Row], list[dict], bool]:
    """A paged case (P1-P3: D1's cache cut into pages of PAGE_SIZES[name] tokens,
    shuffled in the pool; P4, P5: a chunked prefill's cache so; against cupy_gqa's
    contiguous call of the same data, rel_err relative to it) or a varlen prefill
    (V1: against torch's varlen_attn, torch.nn.attention.varlen, where torch has
    it, else torch_cudnn on the batch padded to the longest sequence; rel_err
    relative to that anchor's output)."""
    rows, skipped, failed = [], [], False
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    randn = lambda *shape: torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)  # noqa: E731
    impls = []
    if case.kind == "paged":
        page = PAGE_SIZES[case.name]
        per_seq = case.seqlen_k // page
        q = randn(case.batch, case.seqlen_q, case.num_q_heads, case.head_dim)
        k_pool = randn(case.batch * per_seq, page, case.num_kv_heads, case.head_dim)
        v_pool = randn(case.batch * per_seq, page, case.num_kv_heads, case.head_dim)
        order = torch.randperm(case.batch * per_seq, generator=torch.Generator().manual_seed(0))
        table = order.reshape(case.batch, per_seq).to(device=DEVICE, dtype=torch.int32)
        lens = torch.full((case.batch,), case.seqlen_k, dtype=torch.int32, device=DEVICE)
        k_flat = k_pool[table.long()].reshape(case.batch, case.seqlen_k, case.num_kv_heads, case.head_dim)
        v_flat = v_pool[table.long()].reshape(case.batch, case.seqlen_k, case.num_kv_heads, case.head_dim)
        ref = cupy_gqa.attention(q, k_flat, v_flat).float()
        impls.append(("cupy_gqa[auto]", lambda: cupy_gqa.attention(q, k_pool, v_pool, block_table=table, seqlens_k=lens)))
        impls.append(("cupy_gqa[contiguous]", lambda: cupy_gqa.attention(q, k_flat, v_flat)))
        scope, flops, nbytes = "cupy_gqa contiguous", attention_flops(case), kv_bytes(case)
    else:
        lengths = varlen_lengths(case)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
        total, longest = int(sum(lengths)), max(lengths)
        q = randn(total, case.num_q_heads, case.head_dim)
        k = randn(total, case.num_kv_heads, case.head_dim)
        v = randn(total, case.num_kv_heads, case.head_dim)
        impls.append(("cupy_gqa[auto]", lambda: cupy_gqa.attention_varlen(q, k, v, cu, cu, longest, longest)))
        # the anchor: torch's varlen attention where this torch has it (causal and GQA as its
        # signature spells them), else torch_cudnn on the padded batch; the first that runs
        anchors = []
        try:
            import inspect

            from torch.nn.attention.varlen import varlen_attn

            params = inspect.signature(varlen_attn).parameters
            kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
                kx, vx = k, v
            else:  # the keys expanded to the query heads
                g = case.num_q_heads // case.num_kv_heads
                kx, vx = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            anchors.append(("torch_varlen", lambda: varlen_attn(q, kx, vx, cu, cu, longest, longest, **kw), "torch_varlen"))
        except ImportError:
            pass
        pad = lambda x: torch.nn.utils.rnn.pad_sequence(list(x.split(lengths)), batch_first=True).transpose(1, 2)  # noqa: E731
        qp, kp, vp = pad(q), pad(k), pad(v)

        def cudnn():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)

        anchors.append(("torch_cudnn", cudnn, "torch_cudnn (padded batch)"))
        ref, scope = None, "none (no torch anchor ran)"
        for name, fn, anchor_scope in anchors:
            try:
                out = fn()
            except Exception as e:
                skipped.append({"case": case.name, "impl": name, "reason": _short(e)})
                log(f"  {case.name:4} {name:26} not run: {_short(e)}")
                continue
            ref = out.float() if out.dim() == 3 else torch.cat([o[:, :n].transpose(0, 1) for o, n in zip(out, lengths)]).float()
            impls.append((name, fn))
            scope = anchor_scope
            break
        flops = sum(4 * case.head_dim * visible_pairs(n, n, True) * case.num_q_heads for n in lengths)
        nbytes = 2 * total * case.num_kv_heads * case.head_dim * case.itemsize
    firsts = []  # (name, fn, first call's seconds, rel_err), then all timed together
    for name, fn in impls:
        try:
            compile_start = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            first = time.perf_counter() - compile_start
        except Exception as e:
            failed |= _not_run(case, name, e, skipped, log)
            continue
        if out.dim() == 4 and case.kind == "varlen":
            out = torch.cat([o[:, :n].transpose(0, 1) for o, n in zip(out, lengths)])
        err = None if ref is None else float((out.float() - ref).norm() / ref.norm())
        firsts.append((name, fn, first, err))
        del out
    timings = timer.many({name: fn for name, fn, _, _ in firsts}) if firsts else {}
    for name, fn, first, err in firsts:
        t = timings[name]
        row = Row(case.name, name, ms=t.ms, reps=t.reps, rel_err=err, ref_scope=scope, compile_s=first)
        row.tflops = flops / (t.ms * 1e-3) / 1e12
        row.gbps = nbytes / (t.ms * 1e-3) / 1e9
        if case.kind == "paged" and case.seqlen_q == 1:  # a decode this short shows host time where it is longer
            row.host_us = host_time_us(fn, torch.cuda.synchronize, timer.host_calls)
        rows.append(row)
        log("  " + _progress(row))
    torch.cuda.empty_cache()
    return rows, skipped, failed


def _progress(r: Row) -> str:
    if r.peak_extra_mib is not None and r.ms is None:
        return f"{r.case:4} {r.impl:26} peak extra {r.peak_extra_mib:9.1f} MiB   rel_err {r.rel_err:.1e}"
    extra = f"  compile {r.compile_s:.2f} s" if r.compile_s is not None else ""
    if r.peak_extra_mib is not None:
        extra += f"  peak extra {r.peak_extra_mib:.1f} MiB"
    if r.host_us is not None:
        extra += f"  host {r.host_us:.1f} us"
    err = "n/a" if r.rel_err is None else f"{r.rel_err:.1e}"
    return f"{r.case:4} {r.impl:26} {r.ms:9.4f} ms x{r.reps:<3} {r.tflops:7.1f} TF/s {r.gbps:8.1f} GB/s  rel_err {err}{extra}"


def run_sweep(torch, cupy_gqa, timer: Timer, seqlens, log) -> list[dict]:
    """TFLOP/s vs seqlen for the plot: bf16 causal Hq32 Hkv8 D128, batch = SWEEP_TOKENS / seqlen."""
    results = []
    for seqlen in seqlens:
        case = _prefill(f"sweep{seqlen}", SWEEP_TOKENS // seqlen, seqlen, 128, "bf16")
        q, k, v = make_inputs(torch, case)
        impls = cupy_gqa_impls(cupy_gqa, case, q, k, v) + torch_impls(torch, case, q, k, v)[0]
        for name, fn in impls:
            if name not in SWEEP_IMPLS:
                continue
            try:
                _first_call(torch, fn)
            except Exception as e:
                log(f"  sweep S{seqlen:<6} {name}: skipped ({_short(e)})")
                continue
            t = timer(fn)
            tflops = attention_flops(case) / (t.ms * 1e-3) / 1e12
            results.append({"seqlen": seqlen, "batch": case.batch, "impl": name, "ms": t.ms, "reps": t.reps, "tflops": tflops})
            log(f"  sweep S{seqlen:<6} B{case.batch:<3} {name:16} {t.ms:9.4f} ms {tflops:7.1f} TF/s")
        del q, k, v
        torch.cuda.empty_cache()
    return results


def best_torch_anchors(case: Case) -> tuple[str, ...]:
    """The torch backends a sweep point is compared with: the faster of cuDNN and
    flash (fp16 / bf16); fp32, which neither takes, the efficient backend on
    expanded K/V (torch's auto runs the slow math backend for fp32 GQA)."""
    return ("torch_efficient_expanded",) if case.dtype == "fp32" else ("torch_cudnn", "torch_flash")


def run_shape_sweep(torch, cupy_gqa, timer: Timer, cases, log) -> list[dict]:
    """Each shape-sweep point: cupy_gqa[auto] and its torch anchors, timed and
    checked against the reference like the table's rows, as rows of the same
    format plus kind, best_torch and vs_best (cupy_gqa time / the faster anchor's)."""
    rows = []
    for case in cases:
        q, k, v = make_inputs(torch, case)
        scope, index = reference_scope(case)
        ref = reference(torch, case, q, k, v, index)
        wanted = ("cupy_gqa[auto]", *best_torch_anchors(case))
        impls = [(n, f) for n, f in cupy_gqa_impls(cupy_gqa, case, q, k, v) + torch_impls(torch, case, q, k, v)[0] if n in wanted]
        point = {}
        for row in measure_all(torch, timer, case, impls, ref, scope, index,
                               lambda name, e: log(f"  {case.name:4} {name}: skipped ({_short(e)})")):  # fmt: skip
            if row.impl == "cupy_gqa[auto]":
                row.note = f"auto runs {auto_kernel(case, q, k, v)}"
            point[row.impl] = row
            log("  " + _progress(row))
        ours = point.get("cupy_gqa[auto]")
        anchors = [point[a] for a in best_torch_anchors(case) if a in point]
        best = min(anchors, key=lambda r: r.ms) if anchors else None
        for r in point.values():
            d = r.to_json()
            d.update(kind=case.kind, shape=case.describe())
            if r is ours and best is not None:
                d.update(best_torch=best.impl, vs_best=r.ms / best.ms)
            rows.append(d)
        del q, k, v, ref
        torch.cuda.empty_cache()
    return rows


def sweep_summary(rows: list[dict]) -> dict:
    """Per kind: the geometric mean and the worst of vs_best, and the worst point."""
    out = {}
    for kind in ("prefill", "decode"):
        ratios = [(r["vs_best"], r["case"]) for r in rows if r.get("kind") == kind and "vs_best" in r]
        if ratios:
            geo = math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios))
            worst = max(ratios)
            out[kind] = {"points": len(ratios), "geomean": geo, "worst": worst[0], "worst_case": worst[1]}
    return out


def plot_shape_sweep(rows: list[dict], path: Path, gpu_name: str) -> None:
    """Each point's cupy_gqa / best-torch time, sorted, prefill and decode side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, kind in zip(axes, ("prefill", "decode")):
        pts = sorted((r["vs_best"], r["case"]) for r in rows if r.get("kind") == kind and "vs_best" in r)
        ys, names = [p[0] for p in pts], [p[1] for p in pts]
        ax.bar(range(len(ys)), ys, color=["tab:green" if y <= 1 else "tab:red" for y in ys])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(ys)), names, rotation=90, fontsize=7)
        ax.set_title(f"{kind} ({len(ys)} shapes)")
    axes[0].set_ylabel("cupy_gqa time / best torch time (below 1: faster)")
    fig.suptitle(f"cupy_gqa auto against the faster of torch's cuDNN and flash (fp32: efficient), {gpu_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def render_sweep_markdown(env: dict, rows: list[dict], summary: dict, plot_name: str | None) -> str:
    lines = [f"# cupy_gqa shape sweep on {env['gpu']}", ""]
    lines += [f"- {key}: `{env[key]}`" for key in ("date", "command", "git_commit", "torch", "cudnn", "cupy", "driver")]
    lines += ["", "Method: as `h200.md` (same harness, timer and reference); vs_best = cupy_gqa[auto] time /",
              "the faster of torch_cudnn and torch_flash (fp32: torch_efficient_expanded) in the same run.", ""]
    for kind, s in summary.items():
        lines.append(f"- {kind}: {s['points']} points, geometric mean {s['geomean']:.3f}, worst {s['worst']:.3f} ({s['worst_case']})")
    if plot_name:
        lines += ["", f"![shape sweep]({plot_name})"]
    lines += ["", "| case | kind | shape | impl | ms | rel_err | vs_best | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['vs_best']:.3f}" if "vs_best" in r else ""
        lines.append(
            f"| {r['case']} | {r['kind']} | {r['shape']} | {r['impl']} | {r['ms']:.4f} | {r['rel_err']:.1e} | {vs} | {r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def write_sweep_results(out_dir: Path, tag: str, env: dict, rows: list[dict], *, plot: bool) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = sweep_summary(rows)
    written, plot_name = [], None
    if plot:
        try:
            plot_shape_sweep(rows, out_dir / f"{tag}_sweep.png", env["gpu"])
            plot_name = f"{tag}_sweep.png"
            written.append(out_dir / plot_name)
        except ImportError as e:
            print(f"bench_attention: no plot ({e})")
    doc = {**env, "method": METHOD, "summary": summary, "rows": rows}
    (out_dir / f"{tag}_sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / f"{tag}_sweep.md").write_text(render_sweep_markdown(env, rows, summary, plot_name))
    return [out_dir / f"{tag}_sweep.json", out_dir / f"{tag}_sweep.md", *written]


def compile_probe(torch, cupy_gqa, cases: list[Case]) -> dict:
    """First-call seconds of every cupy_gqa kernel per case, in this (fresh) process."""
    result = {}
    for case in cases:
        if case.kind == "backward":
            q, k, v, dout, out, lse = backward_inputs(torch, cupy_gqa, case)
            impls = backward_cupy_impls(cupy_gqa, case, q, k, v, dout, out, lse)
        elif case.kind == "call":
            q, k, v = make_inputs(torch, case)
            impls = [(name, fn) for name, fn, _, _ in call_impls(torch, cupy_gqa, case, q, k, v) if name.startswith("cupy_gqa")]
        else:
            q, k, v = make_inputs(torch, case)
            impls = cupy_gqa_impls(cupy_gqa, case, q, k, v)
        for name, fn in impls:
            try:
                result[f"{case.name}/{name}"] = _first_call(torch, fn)[1]
            except Exception:  # unsupported here; the main process already reported why
                pass
        del q, k, v, impls
        torch.cuda.empty_cache()
    return result


def run_compile_probe_subprocess(cases: list[Case], cache_dir: str, log) -> dict:
    """Start a second process on the warm CUPY_CACHE_DIR and collect its first-call times."""
    timed = [c for c in cases if c.kind != "memory"]  # M1's single call takes ~10 s; it is not timed
    if not timed:
        return {}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-probe", "--cases", ",".join(c.name for c in timed)]
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        log("  compile probe timed out; compile_cached_s left empty")
        return {}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        log(f"  compile probe failed ({why[:120]}); compile_cached_s left empty")
        return {}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------
def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def is_call_row(r: Row) -> bool:
    """Whether a row belongs to a per-call case (kind "call"): those have their own table."""
    case = CASE_BY_NAME.get(r.case.lower())
    return case is not None and case.kind == "call"


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """The timed rows as (headers, cells); shared by the printed and the markdown table.
    The per-call cases' rows are in call_table."""
    rows = [r for r in rows if not is_call_row(r)]
    anchors = [a for a in ANCHORS if any(a in r.vs for r in rows)]
    headers = ["case", "impl", "ms", "reps", "TFLOP/s", "GB/s", "rel_err", "ref", "compile_s", "compile_cached_s"]
    headers += [f"vs_{a}" for a in anchors]
    cells = []
    for r in rows:
        if r.ms is None:
            continue
        line = [r.case, r.impl, _fmt(r.ms, ".4f"), str(r.reps), _fmt(r.tflops, ".1f"), _fmt(r.gbps, ".1f"),
                _fmt(r.rel_err, ".1e"), r.ref_scope or "—", _fmt(r.compile_s, ".2f"), _fmt(r.compile_cached_s, ".2f")]
        line += [_fmt(r.vs.get(a), ".2f") if r.vs else "" for a in anchors]
        cells.append(line)
    return headers, cells


def call_table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """The per-call cases' rows: ms per call of back-to-back calls, the host time of one
    call, and the ratio to torch_auto."""
    headers = ["case", "impl", "ms_per_call", "calls", "host_us", "rel_err", "compile_s", "compile_cached_s", "vs_torch_auto", "note"]
    cells = [[r.case, r.impl, _fmt(r.ms, ".4f"), str(r.reps), _fmt(r.host_us, ".1f"), _fmt(r.rel_err, ".1e"),
              _fmt(r.compile_s, ".2f"), _fmt(r.compile_cached_s, ".2f"),
              _fmt(r.vs.get("torch_auto"), ".2f") if r.impl != "torch_auto" else "", r.note]
             for r in rows if is_call_row(r) and r.ms is not None]  # fmt: skip
    return headers, cells


def memory_table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    headers = ["case", "impl", "peak_extra_MiB", "rel_err", "ref"]
    cells = [[r.case, r.impl, _fmt(r.peak_extra_mib, ".1f"), _fmt(r.rel_err, ".1e"), r.ref_scope or "—"]
             for r in rows if r.peak_extra_mib is not None]
    return headers, cells


def format_text(headers, cells) -> str:
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


def format_markdown(headers, cells) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines)


# the "What is measured" part of the module docstring, repeated in the results files
METHOD = textwrap.dedent((__doc__ or "").partition("What is measured")[2].partition("Importing this module")[0]).strip()


def render_markdown(env: dict, rows: list[Row], skipped: list[dict], sweep: list[dict], plot_name: str | None) -> str:
    parts = [f"# cupy_gqa attention benchmark on {env['gpu']}", ""]
    parts += [f"- {key}: `{value}`" for key, value in env.items()]
    parts += ["", "## Method", "", "```", METHOD, "```", "", "## Time", "", format_markdown(*table(rows))]
    call_headers, call_cells = call_table(rows)
    if call_cells:
        parts += ["", "## Per call (L1-L3): back-to-back calls, and the host time of one call", "",
                  "ms_per_call: wall time of CALLS calls in a loop / CALLS, no L2 flush; host_us: one repeat call "
                  "with the GPU idle before it (median); vs_torch_auto: ms_per_call / torch_auto's.", "",
                  format_markdown(call_headers, call_cells)]
    mem_headers, mem_cells = memory_table(rows)
    if mem_cells:
        parts += ["", "## Peak device memory beyond inputs and output (M1; G1: the backward pass)", "", format_markdown(mem_headers, mem_cells)]
    if skipped:
        parts += ["", "## Not run", ""] + [f"- {s['case']} {s['impl']}: {s['reason']}" for s in skipped]
    if sweep:
        seqlens = sorted({s["seqlen"] for s in sweep})
        impls = [i for i in SWEEP_IMPLS if any(s["impl"] == i for s in sweep)]
        tf = {(s["seqlen"], s["impl"]): s["tflops"] for s in sweep}
        headers = ["seqlen", "batch"] + [f"{i} TFLOP/s" for i in impls]
        cells = [[str(n), str(SWEEP_TOKENS // n)] + [_fmt(tf.get((n, i)), ".1f") for i in impls] for n in seqlens]
        parts += ["", "## Prefill sweep: bf16 causal, Hq32 Hkv8 D128, 16k tokens per batch", "", format_markdown(headers, cells)]
        if plot_name:
            parts += ["", f"![prefill sweep]({plot_name})"]
    return "\n".join(parts) + "\n"


def plot_sweep(sweep: list[dict], path: Path, gpu_name: str) -> None:
    """Grouped bars with value labels, in the style of FlashAttention's README plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqlens = sorted({s["seqlen"] for s in sweep})
    impls = [i for i in SWEEP_IMPLS if any(s["impl"] == i for s in sweep)]
    tf = {(s["seqlen"], s["impl"]): s["tflops"] for s in sweep}
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(10, 5))
    for n, impl in enumerate(impls):
        xs = [x + (n - (len(impls) - 1) / 2) * width for x in range(len(seqlens))]
        ys = [tf.get((s, impl), 0.0) for s in seqlens]
        bars = ax.bar(xs, ys, width, label=impl)
        ax.bar_label(bars, labels=[f"{y:.0f}" if y else "" for y in ys], fontsize=8, padding=2)
    ax.set_xticks(range(len(seqlens)), [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
    ax.set_xlabel(f"Sequence length (batch = {SWEEP_TOKENS // 1024}k tokens / seqlen)")
    ax.set_ylabel("Speed (TFLOP/s)")
    ax.set_title(f"Attention forward, causal, bf16, head_dim 128, Hq32 Hkv8 ({gpu_name})")
    ax.legend(loc="upper left")
    ax.margins(y=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def command_output(cmd) -> str | None:
    """What a command prints (stripped), or None if it fails or prints nothing."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except Exception:
        return None


def tree_commit() -> str | None:
    """The commit the results come from: CUPY_GQA_COMMIT (a copied working tree
    whose .git is stale or absent), else HEAD, marked when tracked files differ
    from it (a results file of an uncommitted or mislabelled tree says so)."""
    given = os.environ.get("CUPY_GQA_COMMIT")
    if given:
        return given
    head = command_output(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
    changed = command_output(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"])
    if head and changed:
        head += f" (and {len(changed.splitlines())} tracked files changed since)"
    return head


def environment(torch, cupy, cupy_gqa) -> dict:
    def cuda_version(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"

    run = command_output

    return {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "git_commit": tree_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "cupy": cupy.__version__,
        "cuda_runtime": cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        "cuda_driver_api": cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"]),
        "cupy_gqa": f"{cupy_gqa.__version__} ({Path(cupy_gqa.__file__).parent})",
        "cupy_gqa_kernels": ",".join(cupy_gqa.KERNELS),
    }


def write_results(out_dir: Path, tag: str, env: dict, rows, skipped, sweep, *, plot: bool) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    plot_name = None
    if plot and sweep:
        try:
            plot_sweep(sweep, out_dir / f"{tag}_prefill.png", env["gpu"])
            plot_name = f"{tag}_prefill.png"
            written.append(out_dir / plot_name)
        except ImportError as e:
            print(f"bench_attention: no plot ({e})")
    doc = {**env, "method": METHOD, "rows": [r.to_json() for r in rows], "skipped": skipped, "sweep": sweep}
    (out_dir / f"{tag}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / f"{tag}.md").write_text(render_markdown(env, rows, skipped, sweep, plot_name))
    return [out_dir / f"{tag}.json", out_dir / f"{tag}.md", *written]


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_attention",
        description="Benchmark cupy_gqa.attention against torch's SDPA backends on one NVIDIA GPU.",
        epilog="cases:\n" + "\n".join(f"  {c.name:4} {c.describe()}" for c in CASES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cases", type=parse_cases, default=list(CASES), metavar="S0,H1,...",
                   help="comma-separated case names (default: all)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_FAST_REPS} reps (fast calls) / {QUICK_SLOW_REPS} (slow), "
                        f"{QUICK_CALLS} calls in the per-call cases, 3-point sweep")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default: benchmarks/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the prefill sweep and its plot")
    p.add_argument("--no-compile-probe", action="store_true", help="skip the second process that measures compile_cached_s")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit (no GPU needed)")
    p.add_argument("--sweep", action="store_true",
                   help=f"run the shape sweep ({len(SHAPE_SWEEP)} shapes of open models, SHAPE_SWEEP) instead of the "
                        "table: <gpu>_sweep.json, .md and .png")
    p.add_argument("--sweep-kind", choices=("decode", "prefill"), default=None,
                   help="with --sweep: only the shapes of this kind")
    p.add_argument("--modifiers", action="store_true",
                   help="run the modifier cases (W1 window, W2 softcap, W3 softcap as a score_mod) against their baselines instead of the table")
    p.add_argument("--compile-probe", action="store_true", help=argparse.SUPPRESS)  # the second process
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cases: list[Case] = [c for c in SHAPE_SWEEP if args.sweep_kind in (None, c.kind)] if args.sweep else args.cases
    if args.list:
        for c in [] if args.modifiers else cases:
            print(f"{c.name:4} {c.describe()}")
        for mc in MOD_CASES if args.modifiers else ():
            mods = {k_: f"{v_.__name__}(cupy_gqa)" if callable(v_) else v_ for k_, v_ in mc.mods}
            print(f"{mc.name:4} {mc.case.describe()} {mods} (--modifiers; baseline: {mc.baseline})")
        return 0

    if args.compile_probe:  # CUPY_CACHE_DIR is set by the parent
        torch, cupy, cupy_gqa = load_gpu_stack()
        print(json.dumps(compile_probe(torch, cupy_gqa, cases)))
        return 0

    # cold compile: a fresh NVRTC disk cache, set before CuPy is imported
    cache_dir = tempfile.mkdtemp(prefix="bench_attention_cupy_cache_")
    os.environ["CUPY_CACHE_DIR"] = cache_dir
    try:
        return _bench(args, cases, cache_dir)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def _bench(args, cases: list[Case], cache_dir: str) -> int:
    torch, cupy, cupy_gqa = load_gpu_stack()
    route_cupy_through_torch(torch, cupy)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    env = environment(torch, cupy, cupy_gqa)
    log(f"{env['gpu']}  torch {env['torch']}  cupy {env['cupy']}  cupy_gqa kernels {env['cupy_gqa_kernels']}")
    reps = (QUICK_FAST_REPS, QUICK_SLOW_REPS) if args.quick else (FAST_REPS, SLOW_REPS)
    timer = Timer(torch, fast_reps=reps[0], slow_reps=reps[1],
                  calls=QUICK_CALLS if args.quick else CALLS, host_calls=QUICK_HOST_CALLS if args.quick else HOST_CALLS)
    if args.modifiers:
        mod_rows = [run_modifier_case(torch, cupy_gqa, timer, mc, log) for mc in MOD_CASES]
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{gpu_tag(env['gpu'])}_modifiers.json"
        path.write_text(json.dumps({"environment": env, "rows": mod_rows}, indent=1) + "\n")
        log(f"wrote {path}")
        return 0
    if args.sweep:
        rows = run_shape_sweep(torch, cupy_gqa, timer, cases, log)
        written = write_sweep_results(args.out, gpu_tag(env["gpu"]), env, rows, plot=not args.no_plot)
        for kind, s in sweep_summary(rows).items():
            print(f"{kind}: {s['points']} points, geometric mean {s['geomean']:.3f}, worst {s['worst']:.3f} ({s['worst_case']})")
        log("wrote " + ", ".join(str(p) for p in written))
        return 0

    rows, skipped, failed = [], [], False
    tag = gpu_tag(env["gpu"])
    partial = []  # <tag>_partial.*: the rows so far, rewritten after each case (a run cut short keeps them)
    for case in cases:
        log(f"{case.name}: {case.describe()}")
        case_rows, case_skipped, case_failed = run_case(torch, cupy_gqa, timer, case, log)
        rows += case_rows
        skipped += case_skipped
        failed |= case_failed
        add_ratios(rows)
        partial = write_results(args.out, f"{tag}_partial", env, rows, skipped, [], plot=False)

    if not args.no_compile_probe:
        log("compile probe: a second process on the warm CUPY_CACHE_DIR")
        cached = run_compile_probe_subprocess(cases, cache_dir, log)
        for r in rows:
            first_s = cached.get(f"{r.case}/{r.impl}")
            if first_s is not None and r.ms is not None:
                r.compile_cached_s = max(0.0, first_s - r.ms * 1e-3)

    sweep = []
    if not args.no_plot:
        log("prefill sweep")
        sweep = run_sweep(torch, cupy_gqa, timer, QUICK_SWEEP_SEQLENS if args.quick else SWEEP_SEQLENS, log)

    print()
    print(format_text(*table(rows)))
    calls = call_table(rows)
    if calls[1]:
        print()
        print(format_text(*calls))
    mem = memory_table(rows)
    if mem[1]:
        print()
        print(format_text(*mem))
    written = write_results(args.out, tag, env, rows, skipped, sweep, plot=not args.no_plot)
    for path in partial:
        path.unlink(missing_ok=True)
    log("wrote " + ", ".join(str(p) for p in written))
    if failed:
        print("bench_attention: some cupy_gqa calls failed unexpectedly (see 'FAILED' above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
