"""#54's dropout criterion for moagen.torch.attention, in one run: the time with dropout_p 0.1
over the time without it (dropout 0 runs attention_gqa's kernels), forward under no_grad and
forward + backward; 2 threads, 8 query heads over 2 KV heads, d 64, float64 and float32,
the calls in turn over 7 rounds after 2 warm-ups, each ratio the median of the rounds' own
(moagen.bench.timing.ratio_rounds; docs/PERFORMANCE.md, "Other lengths, padding, dropout,
masks").
Run: OMP_NUM_THREADS=2 python bench/dropout_ratio.py 1024 [4096 ...]"""
import sys

import torch

import moagen.torch as mt
from moagen.bench.timing import ratio_rounds
torch.set_num_threads(2)
heads, kv_heads, d, p = 8, 2, 64, 0.1


def forward(q, k, v, dropout_p):
    def run():
        with torch.no_grad():
            mt.attention(q, k, v, dropout_p=dropout_p)
    return run


def forward_backward(q, k, v, dropout_p):
    def run():
        mt.attention(q, k, v, dropout_p=dropout_p).sum().backward()
    return run


for n in (int(a) for a in sys.argv[1:] or ["1024"]):
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, n, d, dtype=dtype, generator=g, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        (plain, dropped), (_, ratio) = ratio_rounds([forward(q, k, v, 0.0), forward(q, k, v, p)])
        (plain_fb, dropped_fb), (_, ratio_fb) = ratio_rounds(
            [forward_backward(q, k, v, 0.0), forward_backward(q, k, v, p)])
        print(f"{dtype} n {n}: forward {plain*1e3:.1f} ms, with dropout {p} {dropped*1e3:.1f} "
              f"ms, ratio {ratio:.2f}; forward + backward {plain_fb*1e3:.1f} ms, with "
              f"dropout {dropped_fb*1e3:.1f} ms, ratio {ratio_fb:.2f}", flush=True)
