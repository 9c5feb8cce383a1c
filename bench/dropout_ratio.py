"""#54's dropout criterion for moagen.torch.attention, in one run: the time with dropout_p 0.1
over the time without it (dropout 0 runs attention_gqa's kernels), forward under no_grad and
forward + backward; 2 threads, 8 query heads over 2 KV heads, d 64, float64 and float32,
medians of 7 calls after 2 warm-ups (docs/PERFORMANCE.md, "Other lengths, padding, dropout,
masks").
Run: OMP_NUM_THREADS=2 python bench/dropout_ratio.py 1024 [4096 ...]"""
import statistics
import sys
import time

import torch

import moagen.torch as mt
torch.set_num_threads(2)
heads, kv_heads, d, p = 8, 2, 64, 0.1


def median(f, reps=7):
    for _ in range(2):
        f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def forward_backward(q, k, v, dropout_p):
    def run():
        mt.attention(q, k, v, dropout_p=dropout_p).sum().backward()
    return run


for n in (int(a) for a in sys.argv[1:] or ["1024"]):
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, n, d, dtype=dtype, generator=g, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        with torch.no_grad():
            plain = median(lambda: mt.attention(q, k, v))
            dropped = median(lambda: mt.attention(q, k, v, dropout_p=p))
        plain_fb = median(forward_backward(q, k, v, 0.0))
        dropped_fb = median(forward_backward(q, k, v, p))
        print(f"{dtype} n {n}: forward {plain*1e3:.1f} ms, with dropout {p} {dropped*1e3:.1f} "
              f"ms, ratio {dropped/plain:.2f}; forward + backward {plain_fb*1e3:.1f} ms, with "
              f"dropout {dropped_fb*1e3:.1f} ms, ratio {dropped_fb/plain_fb:.2f}", flush=True)
