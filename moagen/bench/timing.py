"""Timing calls: warm-up calls first (first-call costs: page faults, lazy binding, thread
pool start), then repeats, round-robin over the calls being compared, so that a burst of
load from elsewhere on the machine falls on all of them rather than on one. The median and
the interquartile range describe each call's times. A call that runs on a GPU is timed by
the GPU's clock (the device's `elapsed`: CUDA events), others by the host's wall clock."""
import time

import numpy as np

SLOW_CALL_S = 2.0  # when a warm-up call is slower than this, 3 repeats at most


def wall_clock(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_calls(calls, warmup=1, repeats=5, clock=wall_clock) -> list:
    """Statistics for each of `calls` (callables of no argument), in order; clock(fn) runs
    fn once and returns its seconds."""
    for fn in calls:
        for _ in range(warmup):
            if clock(fn) > SLOW_CALL_S:
                repeats = min(repeats, 3)
    times = [[] for _ in calls]
    for _ in range(repeats):
        for fn, mine in zip(calls, times):
            mine.append(clock(fn))
    return [_stats(t, warmup) for t in times]


def _stats(times, warmup):
    q1, median, q3 = np.percentile(times, [25, 50, 75])
    return dict(median_s=float(median), min_s=min(times), q1_s=float(q1), q3_s=float(q3),
                repeats=len(times), warmup=warmup)
