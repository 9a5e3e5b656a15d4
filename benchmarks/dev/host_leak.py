"""Does host time leak into the bench's event timing? Times D1, D2, H4 and S0 as
benchmarks/bench_attention.py does (flush, start event, call, end event) and
with the GPU kept busy by torch.cuda._sleep before the start event (host launch
hidden), plus the host time of one call. python benchmarks/dev/host_leak.py"""
import statistics
import time

import torch, torch.nn.functional as F
import cupy_gqa

cases = {"D1": (16, 1, 8192, 32, 8, 128, torch.bfloat16, False), "D2": (64, 1, 2048, 32, 8, 128, torch.bfloat16, False),
         "H4": (4, 2048, 2048, 32, 8, 64, torch.bfloat16, True), "S0": (2, 80, 80, 8, 2, 32, torch.float32, True)}
flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
def timed(fn, n=30, sleep=0):
    st = [torch.cuda.Event(enable_timing=True) for _ in range(n)]; en = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(st, en):
        flush.zero_()
        if sleep: torch.cuda._sleep(sleep)
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(st, en))
def host(fn, n=200):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6
for name, (B, Sq, Sk, Hq, Hkv, D, dt, causal) in cases.items():
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt); k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt); v = torch.randn_like(k)
    fns = {"cupy_gqa": lambda: cupy_gqa.attention(q, k, v, causal=causal)}
    if dt != torch.float32:
        from torch.nn.attention import sdpa_kernel, SDPBackend
        def fl():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal and Sq > 1, enable_gqa=True)
        fns["torch_flash"] = fl
    for fname, fn in fns.items():
        for _ in range(5): fn()
        a = timed(fn); b = timed(fn, sleep=2_000_000); a2 = timed(fn)
        print(f"{name:3} {fname:12} bench-style {a*1e3:8.1f} us (again {a2*1e3:8.1f})  host-hidden {b*1e3:8.1f} us  host {host(fn):6.1f} us", flush=True)
