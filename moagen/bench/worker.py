"""One benchmark process: OpenMP reads its settings (threads, binding, places) once, at
process start, so the sweep runs one of these per setting. It reads a job (JSON) from
argv and prints one JSON line per measurement (a group's as soon as it has them), and
nothing else, on stdout.

A job: {"groups": [{"kernel", "dtype", "sizes", "impls": [[lang, variant(, params)], ...]}, ...],
        "warmup", "repeats", "roof": bool, "touch": "serial" | "parallel",
        "calls": "one" | "per-batch", "triad_in_rounds": bool, "device": target name or null}
Every impl of a group is timed on the same inputs, round-robin. With a device (the name
of a target whose kernels run on one: "cuda"), the inputs and outputs live in its memory,
copied there before the timing, the baselines run there too, every call is timed by the
device's clock (CUDA events: no transfer inside), and a roof job also measures the
device's copy bandwidth. With triad_in_rounds, a
STREAM triad runs in the same rounds, and each of our results records its bandwidth: on a
shared machine the memory bandwidth moves from minute to minute, so a kernel's share of it
is only meaningful against a triad measured alongside.
"""
import json
import sys

from moagen.bench import calls, roof
from moagen.bench.timing import wall_clock, time_calls
from moagen.targets.cuda.arrays import to_device


def run(job):
    device = _device(job.get("device"))
    if job.get("roof"):
        _emit(dict(record="roof", **roof.measure(quick=job.get("quick", False))))
        if device:
            _emit(dict(record="device_roof", device=device.name,
                       **roof.device_copy(device, quick=job.get("quick", False))))
    empty = _allocator(job.get("touch", "serial"))
    clock = device.elapsed if device else wall_clock
    triad = None
    if job.get("triad_in_rounds"):
        triad, triad_bytes = roof.triad_call(roof.triad_elements(job.get("quick", False)))
    for group in job["groups"]:
        kernel, dtype, sizes = group["kernel"], group["dtype"], group["sizes"]
        args = calls.inputs(kernel, sizes, dtype, empty=empty)
        if device:
            args = [to_device(device, a) for a in args]
        scalars = calls.scalars(kernel, sizes)
        timed_calls, first = [], {}
        for lang, variant, *params in group["impls"]:
            fn = calls.kernel_callable(kernel, variant, lang, dtype, *params, device=device)
            timed_calls.append(_call(fn, args, calls.outputs(fn, sizes, on_device=device is not None),
                               scalars, job.get("calls", "one")))
            if lang == "compiled":  # its first call compiles: timed apart, out of the rounds
                first[lang] = time_calls([timed_calls[-1]], warmup=0, repeats=1, clock=clock)[0]["median_s"]
        timed = time_calls(timed_calls + ([triad] if triad else []), job.get("warmup", 1),
                           job.get("repeats", 5), clock=clock)
        alongside = {}
        if triad:
            alongside = dict(triad_gbs_alongside=triad_bytes / timed.pop()["median_s"] / 1e9)
        for (lang, variant, *params), stats in zip(group["impls"], timed):
            ours = lang not in calls.BASELINES
            theirs = dict(computes=calls.computes(kernel, lang),
                          **({"compile_s": first[lang]} if lang in first else {}))
            schedule = calls.schedule(kernel, variant, lang, dtype, *params) if ours else {}
            _emit(dict(record="result", kernel=kernel, variant=variant if ours else None,
                       lang=lang, dtype=dtype, sizes=sizes, **stats,
                       **(dict(schedule, **alongside) if ours else theirs)))


def _call(fn, args, out, scalars, how):
    """One call over the whole batch, or one call per batch entry (as many parallel
    regions as entries: what a caller looping over sequences pays)."""
    if how == "one":
        return lambda: fn(*args, out=out, **scalars)
    outs = () if out is None else out if isinstance(out, tuple) else (out,)

    def per_batch():
        for b in range(args[0].shape[0]):
            part = tuple(o[b:b + 1] for o in outs)
            fn(*(a[b:b + 1] for a in args), out=part[0] if len(part) == 1 else part or None,
               **scalars)
    return per_batch


def _device(target):
    """The device of a target (by name) whose kernels run on one, or None."""
    if target is None:
        return None
    from moagen.targets import get_target
    return get_target(target).device()


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
