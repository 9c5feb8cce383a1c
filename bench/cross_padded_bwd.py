"""#54 item 1's padded backward: moagen.torch.attention forward and backward (autograd) over
n queries against n keys, the last half of every batch's keys padded out (key_lengths n / 2),
against none padded; one thread, process time (steady on a loaded machine), medians of 5
calls after a warm-up; 8 query heads over 2 KV heads, d 64, float64 and float32
(docs/PERFORMANCE.md, "Other lengths, padding, dropout, masks").
Run: OMP_NUM_THREADS=1 python bench/cross_padded_bwd.py 2048 4096"""
import statistics
import sys
import time

import torch

import moagen.torch as mt
torch.set_num_threads(1)
heads, kv_heads, d = 8, 2, 64


def median(f, reps=5):
    f()
    ts = []
    for _ in range(reps):
        t = time.process_time(); f(); ts.append(time.process_time() - t)
    return statistics.median(ts)


def forward_backward(q, k, v, **padding):
    for x in (q, k, v):
        x.grad = None
    mt.attention(q, k, v, **padding).sum().backward()


for n in map(int, sys.argv[1:] or ("2048", "4096")):
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, n, d, dtype=dtype, generator=g).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        unpadded = median(lambda: forward_backward(q, k, v))
        padded = median(lambda: forward_backward(q, k, v, key_lengths=[n // 2]))
        print(f"{dtype} n {n}: forward+backward unpadded {unpadded:.3f} s, half padded "
              f"{padded:.3f} s, padded/unpadded {padded / unpadded:.2f}", flush=True)
