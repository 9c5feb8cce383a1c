"""#54's two ratios for moagen.torch.attention, in one run: (a) 512 queries against n keys
(default 4096) against SDPA; (b) n queries against n keys, half of them padded out
(key_lengths), against none padded, and SDPA under the same boolean mask against it;
2 threads, 8 heads, d 64, float64 and float32, the calls in turn over 7 rounds after 2
warm-ups, each ratio the median of the rounds' own (moagen.bench.timing.ratio_rounds;
docs/PERFORMANCE.md, "Other lengths, padding, dropout, masks").
Run: OMP_NUM_THREADS=2 python bench/cross_padded_ratios.py 4096"""
import sys

import torch
import torch.nn.functional as F

import moagen.torch as mt
from moagen.bench.timing import ratio_rounds
torch.set_num_threads(2)
n_q, n, heads, d = 512, int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 8, 64

for dtype in (torch.float64, torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, m, d, dtype=dtype, generator=g) for m in (n, n, n))
    cross = q[:, :, :n_q].contiguous()
    mask = (torch.arange(n) < n // 2).view(1, 1, 1, n)
    with torch.no_grad():
        (ours, sdpa), (_, sdpa_over) = ratio_rounds([
            lambda: mt.attention(cross, k, v), lambda: F.scaled_dot_product_attention(cross, k, v)])
        (padded, unpadded, sdpa_padded), (_, unpadded_over, sdpa_padded_over) = ratio_rounds([
            lambda: mt.attention(q, k, v, key_lengths=[n // 2]), lambda: mt.attention(q, k, v),
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)])
    print(f"{dtype} n_q {n_q} n_k {n}: moagen {ours*1e3:.1f} ms, SDPA {sdpa*1e3:.1f} ms, "
          f"SDPA/moagen {sdpa_over:.2f}; n_q {n}: half padded {padded*1e3:.1f} ms, "
          f"padded/unpadded {1 / unpadded_over:.2f}; SDPA padded {sdpa_padded*1e3:.1f} ms, "
          f"SDPA padded/moagen padded {sdpa_padded_over:.2f}", flush=True)
