"""#54: the causal varlen attention's forward + backward against the non-causal one, through
moagen.torch.attention_varlen(one_call=True): float64, 8 query heads over 2 KV heads, d 64,
sequences of equal query and key lengths (4 x 256; 256 and 1024), one thread, the two in
turn over 5 rounds after a warm-up, the ratio the median of the rounds' own
(moagen.bench.timing.ratio_rounds; docs/journal/2026-12-08-varlen-backward.md, "Causal
backward cut").
Run: OMP_NUM_THREADS=1 python bench/varlen_causal_ratio.py"""
import numpy as np
import torch

import moagen.torch as mt
from moagen.bench.timing import ratio_rounds
torch.set_num_threads(1)


def forward_backward(lengths, causal):
    """One call of the forward and its backward over a packed batch of these lengths."""
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 8, 64, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(total, 2, 64, dtype=torch.float64, generator=g, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(total, 8, 64, dtype=torch.float64, generator=g)
    offsets = [0, *np.cumsum(lengths).tolist()]

    def run():
        for t in (q, k, v):
            t.grad = None
        mt.attention_varlen(q, k, v, offsets, offsets, causal=causal,
                            one_call=True).backward(grad)
    return run


for lengths in ((256,) * 4, (256, 1024)):
    times, ratios = ratio_rounds([forward_backward(lengths, False),
                                  forward_backward(lengths, True)], warmup=1, repeats=5)
    print(f"lengths {lengths}: non-causal {times[0] * 1e3:.1f} ms, causal "
          f"{times[1] * 1e3:.1f} ms, causal / non-causal {ratios[1]:.3f}", flush=True)
