"""#54's ratios for moagen.torch.attention with an arbitrary boolean mask, in one run: n
queries against n keys (n default 4096) under a random (n, n) mask about 80% True, and
under the causal mask given as a mask (not is_causal: every key block computed), against
moagen unmasked and against SDPA under the same mask; 2 threads, 8 heads, d 64, float64 and
float32, forward only, the calls in turn over 7 rounds after 2 warm-ups, each ratio the
median of the rounds' own (moagen.bench.timing.ratio_rounds; docs/PERFORMANCE.md, "Other
lengths, padding, dropout, masks"). Run: OMP_NUM_THREADS=2 python bench/mask_ratios.py 4096"""
import sys

import torch
import torch.nn.functional as F

import moagen.torch as mt
from moagen.bench.timing import ratio_rounds
torch.set_num_threads(2)
n, heads, d = int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 8, 64

g = torch.Generator().manual_seed(0)
masks = {"random 80%": torch.rand(n, n, generator=g) < 0.8,
         "causal as a mask": torch.ones(n, n, dtype=torch.bool).tril()}
for dtype in (torch.float64, torch.float32):
    q, k, v = (torch.randn(1, heads, n, d, dtype=dtype, generator=g) for _ in range(3))
    with torch.no_grad():
        for label, mask in masks.items():
            (ours, unmasked, sdpa), (_, over_unmasked, over_sdpa) = ratio_rounds([
                lambda: mt.attention(q, k, v, mask), lambda: mt.attention(q, k, v),
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)])
            print(f"{dtype} n {n} {label}: moagen masked {ours*1e3:.0f} ms, unmasked "
                  f"{unmasked*1e3:.0f} ms, masked/unmasked {1 / over_unmasked:.2f}; SDPA masked "
                  f"{sdpa*1e3:.0f} ms, SDPA/moagen {over_sdpa:.2f}", flush=True)
