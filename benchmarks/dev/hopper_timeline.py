#!/usr/bin/env python3
"""Where a hopper prefill tile's time goes: the kernel with timestamps.

The script takes the hopper kernel's source as cupy_gqa builds it, adds
clock64() marks at the points below (text insertions at named places of
kernels/hopper.cu; the script fails if one is not found), compiles it with the
same options, runs cupy_gqa.attention(kernel="hopper") with that kernel in
place of the real one, and reads the marks back. Nothing in the package or
kernels/ changes. One thread per role writes its marks with plain stores
into a region of its own (no atomics), so the marks cost a few instructions.

Marks (per CTA; each consumer warpgroup (two or three), and the producer):
  consumer  qwait   before the wait for its Q rows (q_full)
            qfull   Q has landed (tile index known)
            s0      S_0 = Q K_0^T is in registers
            pvlast  the tile's last P V is done (the field: the warpgroup's key tiles)
            end     the epilogue is done (out written, Q freed)
  producer  tile    starts issuing a tile's copies (after the last tile's)
            q0, q1  the wait for warpgroup h's Q rows to be free is over
            kv      Q's copies issued; K/V of the tile follow

Per tile of a warpgroup the report gives, in cycles of the SM clock and in
us at the device's clock rate: the wait for Q, Q to S_0, S_0 to the last
P V (and per key tile), the epilogue, and the time from the end of one tile
to Q of the next; for the producer, its waits for q_empty. Means over every
tile of every CTA, and for the tiles with 1, 2, .. key tiles.

    python3 benchmarks/dev/hopper_timeline.py --cases H3,H4 [--out DIR]
"""
import argparse
import contextlib
import collections
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import cupy_gqa  # noqa: E402
from cupy_gqa import _compile, _mods, _plan, _specs  # noqa: E402

# name: (batch, seqlen, num_q_heads, num_kv_heads, head_dim, dtype[, window])
CASES = {
    "H1": (4, 4096, 32, 8, 128, "bfloat16"),
    "H3": (16, 512, 32, 8, 128, "float16"),
    "H4": (4, 2048, 32, 8, 64, "bfloat16"),
    "g4_S256": (32, 256, 32, 8, 128, "bfloat16"),
    # W1 (bench_attention.py --modifiers) and the causal call at its shape
    "W1": (4, 8192, 32, 8, 128, "bfloat16", (1024, 0)),
    "H1_S8k": (4, 8192, 32, 8, 128, "bfloat16"),
}
CAP = 1024  # marks per (CTA, role)
MAX_CTAS = 256  # the persistent grid is one CTA per SM
ROLES = ("wg0", "wg1", "wg2", "producer")  # consumers first, the producer last
PRODUCER = len(ROLES) - 1
CODES = {"qwait": 1, "qfull": 2, "s0": 3, "pvlast": 4, "end": 5, "tile": 10, "q0": 11, "q1": 12, "kv": 13}
NAMES = {v: k for k, v in CODES.items()}

PRELUDE = f"""
__device__ unsigned long long cg_trace[{len(ROLES)} * {MAX_CTAS} * {CAP} * 2];
// one mark: (clock64, code << 32 | value) into the region of (CTA, role)
__device__ __forceinline__ void cg_mark(int& n, int role, int code, int value) {{
    if (n < {CAP} && blockIdx.x < {MAX_CTAS}) {{
        unsigned long long* r = cg_trace + ((unsigned long long)(blockIdx.x * {len(ROLES)} + role) * {CAP} + n) * 2;
        r[0] = clock64();
        r[1] = ((unsigned long long)code << 32) | (unsigned)value;
    }}
    ++n;
}}
"""

def _mark(indent: int, who: str, code: str, value: str) -> str:
    """The text of one mark: by thread 0 of a consumer warpgroup, or of the producer."""
    cond, role = ("(tid & 127) == 0", "wg") if who == "consumer" else ("pt == 0", str(PRODUCER))
    return " " * indent + f"if ({cond}) cg_mark(cg_n, {role}, {code}, {value});\n"


# (a place in kernels/hopper.cu, found exactly once; the text put before or after it)
INSERTIONS = [
    ("    const int tid = threadIdx.x;\n", "after", "    int cg_n = 0;\n"),
    ("        mbar_wait(q_full(wg, qs), (tn / QS) & 1);\n", "before", _mark(8, "consumer", CODES["qwait"], "tn")),
    ("            break;\n        }\n", "after", _mark(8, "consumer", CODES["qfull"], "tile_index")),
    ("            mbar_arrive(k_empty(ring % STAGES));\n", "after", _mark(12, "consumer", CODES["s0"], "0")),
    ("            mbar_arrive(v_empty((ring + wg_n - 1) % STAGES));\n", "after",
     _mark(12, "consumer", CODES["pvlast"], "wg_n")),
    ("    }\n    if (wg == 0) take_turn();", "before", _mark(8, "consumer", CODES["end"], "0")),
    ("                if (num_n > 0) fill_k(0);\n", "before", _mark(16, "producer", CODES["tile"], "tile")),
    ("                    if (published >= QS) mbar_wait(q_empty(h, qs), (published / QS - 1) & 1);\n", "after",
     _mark(20, "producer", f"{CODES['q0']} + h", "published")),
    ("                for (int i = 0; i < num_n; ++i) {\n                    if (i > 0) fill_k(i);", "before",
     _mark(16, "producer", CODES["kv"], "num_n")),
]


def with_marks(spec, prelude: str, insertions, tool: str) -> str:
    """The source of ``spec`` with each (anchor, "before" / "after", text) of
    ``insertions`` put at its anchor (which must occur exactly once), ``prelude`` first."""
    src = _compile.source_for(spec)
    for anchor, where, text in insertions:
        found = src.count(anchor)
        if found != 1:
            raise SystemExit(f"{tool}: expected one {anchor!r} in {spec.source}, found {found}")
        src = src.replace(anchor, anchor + text if where == "after" else text + anchor)
    return prelude + src


def traced_source(spec) -> str:
    return with_marks(spec, PRELUDE, INSERTIONS, "hopper_timeline")


def load_traced(spec, source: str):
    """``source`` compiled as cupy_gqa compiles ``spec``: its module and kernel."""
    module = cupy.RawModule(code=source, options=_compile.compile_options(spec), name_expressions=[spec.name])
    kernel = module.get_function(spec.name)
    if spec.smem > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = spec.smem
    return module, kernel


@contextlib.contextmanager
def in_place_of(spec, kernel):
    """cupy_gqa's launches take ``kernel`` where they would take ``spec``'s, inside the block."""
    real = _plan.get_kernel
    _plan.get_kernel = lambda sp: kernel if sp.name == spec.name else real(sp)
    try:
        yield
    finally:
        _plan.get_kernel = real


def run_case(name: str, say) -> None:
    b, s, hq, hkv, d, dtype, *window = CASES[name]
    kw = {"window": window[0]} if window else {}
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
               for shape in ((b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d)))
    spec = _specs.hopper_tile(dtype, d, True, group_size=hq // hkv)  # the kernel auto runs
    if window:  # the window's instantiation (as _plan.Problem.spec makes it for a window alone)
        spec = _specs.with_mods(spec, _mods.MOD_WINDOW)
    module, kernel = load_traced(spec, traced_source(spec))
    with in_place_of(spec, kernel):
        _plan.plan_hopper.cache_clear()
        out = cupy_gqa.attention(q, k, v, kernel="hopper", **kw)  # warm-up: plans, maps
        trace = module.get_global("cg_trace")
        buf = cupy.ndarray((len(ROLES) * MAX_CTAS * CAP * 2,), cupy.uint64, trace)
        buf.fill(0)
        cupy.cuda.Device().synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        out = cupy_gqa.attention(q, k, v, kernel="hopper", **kw)
        stop.record()
        stop.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, stop)
        marks = cupy.asnumpy(buf).reshape(MAX_CTAS, len(ROLES), CAP, 2)
    _plan.plan_hopper.cache_clear()
    ref = cupy_gqa.attention(q, k, v, kernel="hopper", **kw)
    assert bool(cupy.array_equal(out.view(cupy.int16), ref.view(cupy.int16))), "the traced kernel must give the same bits"
    clock_khz = cupy.cuda.Device().attributes["ClockRate"]
    say(f"\n## {name}: B{b} S{s} Hq{hq} Hkv{hkv} D{d} {dtype}, causal{f', window {window[0]}' if window else ''}; "
        f"{ms * 1e3:.1f} us (events, one call)")
    summarize(marks, clock_khz, say)


def summarize(marks: np.ndarray, clock_khz: float, say) -> None:
    """The report of marks (CTA, role, mark, (clock, code << 32 | value))."""
    us = lambda cycles: cycles / clock_khz * 1e3  # noqa: E731
    ctas = int((marks[:, :, 0, 0] != 0).any(axis=1).sum())
    say(f"{ctas} CTAs; SM clock rate {clock_khz / 1e3:.0f} MHz (us below at that rate)")
    per = collections.defaultdict(list)          # measure -> cycles
    by_n = collections.defaultdict(lambda: collections.defaultdict(list))
    tiles_per_cta = []
    for cta in range(ctas):
        for role in range(PRODUCER):
            ev = [(int(t), int(info) >> 32, int(info) & 0xFFFFFFFF) for t, info in marks[cta, role] if t]
            if not ev:  # a warpgroup the kernel does not have
                continue
            tile, last_end = {}, None
            count = 0
            for t, code, value in ev:
                name_ = NAMES.get(code)
                if name_ == "qwait":
                    tile = {"qwait": t}
                    if last_end is not None:
                        tile["gap_from_end"] = t - last_end
                elif name_ == "qfull":
                    tile["qfull"] = t
                elif name_ == "s0":
                    tile["s0"] = t
                elif name_ == "pvlast":
                    tile["pvlast"], tile["n"] = t, value
                elif name_ == "end":
                    tile["end"] = t
                    last_end = t
                    count += 1
                    if {"qwait", "qfull", "s0", "pvlast", "n"} <= tile.keys():
                        m = {
                            "wait for Q": tile["qfull"] - tile["qwait"],
                            "Q to S_0": tile["s0"] - tile["qfull"],
                            "S_0 to last P V": tile["pvlast"] - tile["s0"],
                            "epilogue": tile["end"] - tile["pvlast"],
                            "end to next Q": None,
                        }
                        for key, val in m.items():
                            if val is not None:
                                per[key].append(val)
                                by_n[tile["n"]][key].append(val)
                        if "gap_from_end" in tile:
                            per["end to next Q"].append(tile["gap_from_end"] + tile["qfull"] - tile["qwait"])
            tiles_per_cta.append(count)
        ev = [(int(t), int(info) >> 32, int(info) & 0xFFFFFFFF) for t, info in marks[cta, PRODUCER] if t]
        last = {}
        for t, code, value in ev:
            name_ = NAMES.get(code)
            if name_ == "tile":
                last = {"tile": t}
            elif name_ in ("q0", "q1") and "tile" in last:
                per[f"producer: tile start to {name_} free"].append(t - last["tile"])
            elif name_ == "kv" and "tile" in last:
                per["producer: tile start to K/V copies"].append(t - last["tile"])
    say(f"tiles per warpgroup: {statistics.mean(tiles_per_cta):.1f} (min {min(tiles_per_cta)}, max {max(tiles_per_cta)})")
    say(f"{'measure':40} {'tiles':>6} {'mean cycles':>12} {'mean us':>8} {'median us':>10}")
    for key, vals in per.items():
        say(f"{key:40} {len(vals):6} {statistics.mean(vals):12.0f} {us(statistics.mean(vals)):8.3f} {us(statistics.median(vals)):10.3f}")
    say("by key tiles per tile (mean us: wait for Q / Q to S_0 / S_0 to last P V / epilogue):")
    for n in sorted(by_n):
        row = by_n[n]
        cells = " / ".join(f"{us(statistics.mean(row[k])):.3f}" for k in ("wait for Q", "Q to S_0", "S_0 to last P V", "epilogue"))
        say(f"  {n:3} key tiles, {len(row['epilogue']):5} tiles: {cells}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="H3,H4")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"# hopper_timeline.py --cases {args.cases}; {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for name in args.cases.split(","):
        run_case(name, say)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hopper_timeline.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
