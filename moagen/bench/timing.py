"""Timing calls: warm-up calls first (first-call costs: page faults, lazy binding, thread
pool start), then repeats, round-robin over the calls being compared, so that a burst of
load from elsewhere on the machine falls on all of them rather than on one. The median and
the interquartile range describe each call's times. A call that runs on a GPU is timed by
the GPU's clock (the device's `elapsed`: CUDA events), others by the host's wall clock.

A call shorter than WARM_BELOW x BATCH_S (100 ms) is timed right after an untimed call of
itself, and one shorter than BATCH_S in batches of back-to-back calls, each time the
batch's over its calls (as timeit does): alone, a short call's time is much of what the
call before it left behind (caches emptied by the triad in the rounds, threads gone to
sleep; a few ms at most), which the round-robin order, not the implementation, decides.
Short calls are so measured warm, as in a model's loop of operators."""
import math
import time

import numpy as np

SLOW_CALL_S = 2.0  # when a warm-up call is slower than this, 3 repeats at most
BATCH_S = 1e-3  # calls shorter than this (in their last warm-up) are timed in batches
MAX_BATCH = 1000
WARM_BELOW = 100  # calls under this many BATCH_S are each timed after an untimed call


def wall_clock(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_calls(calls, warmup=1, repeats=5, clock=wall_clock, batch_s=BATCH_S) -> list:
    """Statistics for each of `calls` (callables of no argument), in order; clock(fn) runs
    fn once and returns its seconds."""
    batches, warm = [], []
    for fn in calls:
        last = None
        for _ in range(warmup):
            last = clock(fn)
            if last > SLOW_CALL_S:
                repeats = min(repeats, 3)
        warm.append(last is not None and last < WARM_BELOW * batch_s)
        if warm[-1]:
            # one more call: the first's one-time costs (a thread pool started, pages
            # mapped: tens of ms) would hide a short call
            last = min(last, clock(fn))
        batches.append(_batch(last, batch_s))
    times = [[] for _ in calls]
    for _ in range(repeats):
        for fn, batch, warmed, mine in zip(calls, batches, warm, times):
            if warmed:
                fn()  # untimed: the sample starts warm whatever ran before it in the round
            mine.append(clock(fn) if batch == 1 else clock(_calls(fn, batch)) / batch)
    return [dict(_stats(t, warmup), calls_per_sample=batch) for t, batch in zip(times, batches)]


def ratio_rounds(calls, warmup=2, repeats=7, clock=wall_clock) -> tuple:
    """(each call's median seconds, each call's median ratio to the first's): the calls
    (callables of no argument, the first the baseline) each warmed up `warmup` times, then
    timed in `repeats` rounds, each call once a round in turn; a ratio is taken within a
    round and the ratios' median reported, so that load from elsewhere on the machine, which
    moves a whole round, moves no ratio (medians of separately taken medians it would)."""
    for fn in calls:
        for _ in range(warmup):
            fn()
    rounds = [[clock(fn) for fn in calls] for _ in range(repeats)]
    times = list(zip(*rounds))
    return ([float(np.median(t)) for t in times],
            [float(np.median([r[k] / r[0] for r in rounds])) for k in range(len(calls))])


def _batch(seconds, batch_s):
    """How many back-to-back calls one sample takes: enough to last batch_s."""
    if seconds is None or seconds >= batch_s:
        return 1
    return min(MAX_BATCH, math.ceil(batch_s / max(seconds, 1e-7)))


def _calls(fn, count):
    def batch():
        for _ in range(count):
            fn()
    return batch


def _stats(times, warmup):
    q1, median, q3 = np.percentile(times, [25, 50, 75])
    return dict(median_s=float(median), min_s=min(times), q1_s=float(q1), q3_s=float(q3),
                repeats=len(times), warmup=warmup)
