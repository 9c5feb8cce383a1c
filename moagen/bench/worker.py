"""One benchmark process: OpenMP reads its settings (threads, binding, places) once, at
process start, so the sweep runs one of these per setting. It reads a job (JSON) from
argv and prints one JSON line per measurement (a group's as soon as it has them), and
nothing else, on stdout.

A job: {"groups": [{"kernel", "dtype", "sizes", "impls": [[lang, variant(, params)], ...]}, ...],
        "warmup", "repeats", "roof": bool, "touch": "serial" | "parallel",
        "calls": "one" | "per-batch", "triad_in_rounds": bool}
Every impl of a group is timed on the same inputs, round-robin. With triad_in_rounds, a
STREAM triad runs in the same rounds, and each of our results records its bandwidth: on a
shared machine the memory bandwidth moves from minute to minute, so a kernel's share of it
is only meaningful against a triad measured alongside.
"""
import json
import sys

from moagen.bench import cases, roof
from moagen.bench.timing import time_calls


def run(job):
    if job.get("roof"):
        _emit(dict(record="roof", **roof.measure(quick=job.get("quick", False))))
    empty = _allocator(job.get("touch", "serial"))
    triad = None
    if job.get("triad_in_rounds"):
        triad, triad_bytes = roof.triad_call(roof.triad_elements(job.get("quick", False)))
    for group in job["groups"]:
        kernel, dtype, sizes = group["kernel"], group["dtype"], group["sizes"]
        args = cases.inputs(kernel, sizes, dtype, empty=empty)
        scalars = cases.scalars(kernel, sizes)
        calls, first = [], {}
        for lang, variant, *params in group["impls"]:
            fn = cases.kernel_callable(kernel, variant, lang, dtype, *params)
            calls.append(_call(fn, args, cases.outputs(fn, sizes), scalars, job.get("calls", "one")))
            if lang == "compiled":  # its first call compiles: timed apart, out of the rounds
                first[lang] = time_calls([calls[-1]], warmup=0, repeats=1)[0]["median_s"]
        timed = time_calls(calls + ([triad] if triad else []), job.get("warmup", 1),
                           job.get("repeats", 5))
        alongside = {}
        if triad:
            alongside = dict(triad_gbs_alongside=triad_bytes / timed.pop()["median_s"] / 1e9)
        for (lang, variant, *params), stats in zip(group["impls"], timed):
            ours = lang not in cases.BASELINES
            theirs = dict(computes=cases.computes(kernel, lang),
                          **({"compile_s": first[lang]} if lang in first else {}))
            _emit(dict(record="result", kernel=kernel, variant=variant if ours else None,
                       lang=lang, dtype=dtype, sizes=sizes, **stats,
                       **(dict(_schedule(kernel, variant, *params), **alongside) if ours else
                          theirs)))


def _schedule(kernel, variant, params=None):
    """The schedule parameters a result ran with, and whether `moagen tune` chose them."""
    from moagen.kernels import get_kernel
    return dict(params=get_kernel(kernel).variant(variant).params(params), tuned=bool(params))


def _call(fn, args, out, scalars, calls):
    """One call over the whole batch, or one call per batch entry (as many parallel
    regions as entries: what a caller looping over sequences pays)."""
    if calls == "one":
        return lambda: fn(*args, out=out, **scalars)
    outs = () if out is None else out if isinstance(out, tuple) else (out,)

    def per_batch():
        for b in range(args[0].shape[0]):
            part = tuple(o[b:b + 1] for o in outs)
            fn(*(a[b:b + 1] for a in args), out=part[0] if len(part) == 1 else part or None,
               **scalars)
    return per_batch


def _allocator(touch):
    if touch == "parallel":
        from moagen.bench.native import empty_touched
        return empty_touched
    import numpy as np
    return np.empty


def _emit(record):
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
