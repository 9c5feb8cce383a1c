"""#54's two ratios for moagen.torch.attention, in one run: (a) 512 queries against n keys
(default 4096) against SDPA; (b) n queries against n keys, half of them padded out
(key_lengths), against none padded, and SDPA under the same boolean mask against it;
2 threads, 8 heads, d 64, float64 and float32, medians of 7 calls after 2 warm-ups
(docs/PERFORMANCE.md, "Other lengths, padding, dropout, masks").
Run: OMP_NUM_THREADS=2 python bench/cross_padded_ratios.py 4096"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import moagen.torch as mt
torch.set_num_threads(2)
n_q, n, heads, d = 512, int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 8, 64

def median(f, reps=7):
    for _ in range(2):
        f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)

for dtype in (torch.float64, torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, m, d, dtype=dtype, generator=g) for m in (n, n, n))
    cross = q[:, :, :n_q].contiguous()
    mask = (torch.arange(n) < n // 2).view(1, 1, 1, n)
    with torch.no_grad():
        ours = median(lambda: mt.attention(cross, k, v))
        sdpa = median(lambda: F.scaled_dot_product_attention(cross, k, v))
        unpadded = median(lambda: mt.attention(q, k, v))
        padded = median(lambda: mt.attention(q, k, v, key_lengths=[n // 2]))
        sdpa_padded = median(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    print(f"{dtype} n_q {n_q} n_k {n}: moagen {ours*1e3:.1f} ms, SDPA {sdpa*1e3:.1f} ms, "
          f"SDPA/moagen {sdpa/ours:.2f}; n_q {n}: half padded {padded*1e3:.1f} ms, "
          f"padded/unpadded {padded/unpadded:.2f}; SDPA padded {sdpa_padded*1e3:.1f} ms, "
          f"SDPA padded/moagen padded "
          f"{sdpa_padded/padded:.2f}", flush=True)
