"""Timing one call: warm-up calls first (first-call costs: page faults, lazy binding, thread
pool start), then repeated calls; the median and the interquartile spread describe them."""
import time

import numpy as np

SLOW_CALL_S = 2.0  # calls slower than this are repeated at most 3 times


def time_call(fn, warmup=1, repeats=5) -> dict:
    for _ in range(warmup):
        start = time.perf_counter()
        fn()
        if time.perf_counter() - start > SLOW_CALL_S:
            repeats = min(repeats, 3)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    q1, median, q3 = np.percentile(times, [25, 50, 75])
    return dict(median_s=float(median), min_s=min(times), q1_s=float(q1), q3_s=float(q3),
                repeats=repeats, warmup=warmup)
