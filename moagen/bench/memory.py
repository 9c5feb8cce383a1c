"""Peak memory of kernel variants, measured, next to what their ONF predicts.

Each kernel variant runs once in a fresh Python process of its own, so that no peak hides
another. That process loads (building if needed) the kernel, allocates its inputs and its
outputs and writes them, resets the peak resident memory the kernel keeps for it (writing
5 to /proc/self/clear_refs resets VmHWM, Linux only), reads VmRSS, calls the kernel once and
reads VmHWM. The extra peak, VmHWM - VmRSS, is what the call itself needed: the variant's
scratch and the OpenMP threads' stacks, not its arguments. The ONF predicts the scratch:
the sum over its temps of elements x itemsize.

Linux counts resident pages in per-CPU counters and reports their sum to within some pages
per CPU, so extra peaks below about a MiB (a row-wise variant's) are at the noise floor.
"""
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict

DEFAULT_KERNELS = ("attention_fwd", "attention_fwdbwd")  # every variant of each
DEFAULT_SIZES = dict(batch=1, heads=1, n=16384, d=64)
# A fixed threshold keeps glibc from raising it at run time (it does after freeing a large
# block), so every block of 128 KiB or more is mapped fresh and unmapped when freed: a
# call's scratch cannot reuse pages that earlier work left resident and escape the count.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


@dataclass(frozen=True)
class Record:
    kernel: str
    variant: str
    lang: str
    dtype: str
    sizes: Dict[str, int]
    predicted_bytes: int  # the ONF's temps at these sizes
    rss_before_kib: int  # VmRSS just before the call, arguments allocated and written
    peak_kib: int  # VmHWM just after the call, reset just before it
    maxrss_kib: int  # ru_maxrss just after the call: the same peak, as getrusage reports it
    seconds: float  # the call's wall time

    @property
    def extra_bytes(self) -> int:
        return (self.peak_kib - self.rss_before_kib) * 1024


def sizes_for(kernel: str, given: dict) -> dict:
    """The sizes the kernel takes, picked from `given`."""
    from moagen.pipeline import onf_of
    from moagen.errors import MoagenError

    names = [s.name for s in onf_of(kernel).sizes]
    missing = [s for s in names if s not in given]
    if missing:
        raise MoagenError(f"kernel {kernel} needs size(s) {', '.join(missing)}, which "
                          f"`bench memory` does not set")
    return {s: given[s] for s in names}


def predicted_temp_bytes(kernel: str, variant: str, sizes: dict, dtype: str) -> int:
    """The cost model's scratch: the ONF's temporaries at these sizes."""
    from moagen.cost import predict, value
    cost = predict(kernel, variant, dtype)
    return value(cost.scratch_bytes, cost.sizes_from(sizes))


def measure(kernel: str, variant: str, sizes: dict, dtype="float64", lang="c") -> Record:
    """Run one kernel variant once in a fresh process; its peak memory and time."""
    from moagen.errors import MoagenError

    job = dict(kernel=kernel, variant=variant, lang=lang, dtype=dtype, sizes=sizes)
    proc = subprocess.run([sys.executable, "-m", __name__, json.dumps(job)], capture_output=True,
                          text=True, env={**os.environ, **MALLOC_ENV})
    if proc.returncode != 0:
        raise MoagenError(f"measuring {kernel} {variant} failed:\n{proc.stderr[-3000:]}")
    measured = json.loads(proc.stdout.splitlines()[-1])
    return Record(kernel, variant, lang, dtype, sizes,
                  predicted_temp_bytes(kernel, variant, sizes, dtype), **measured)


def _measure_here(kernel, variant, lang, dtype, sizes) -> dict:
    """In the fresh process: the call's memory before and at its peak, and its time."""
    import numpy as np

    from moagen import runtime
    from moagen.kernels import get_kernel

    fn = runtime.load(kernel, variant, lang, dtype, tuned=False)
    sig = fn.signature
    env = {s: sizes[s.name] for s in sig.sizes if s.name in sizes}  # a chosen one shapes no input
    shape = lambda param: tuple(int(dim.subs(env)) for dim in param.shape)
    rng = np.random.default_rng(0)
    # the values do not change what memory is used: random, even where a backward would
    # want its forward's O and lse; each input of its own element type (a bool mask's)
    inputs = [rng.standard_normal(shape(p)).astype(p.dtype(dtype)) for p in sig.inputs]
    outputs = tuple(np.ones(shape(p), dtype) for p in sig.outputs)  # resident before the call
    scalars = get_kernel(kernel).check.scalars(sizes)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn(*inputs, **scalars, out=outputs if len(outputs) > 1 else outputs[0])
    seconds = time.perf_counter() - start
    return dict(rss_before_kib=before, peak_kib=_status_kib("VmHWM"),
                maxrss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, seconds=seconds)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])  # "VmRSS:   12345 kB"
    raise KeyError(field)


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def format_table(records) -> str:
    """One row per record; the ratio divides the first naive row's extra peak by each row's."""
    naive = next((r for r in records if r.variant == "naive"), None)
    lines = [f"{'kernel':<24} {'variant':<8} {'ONF temps':>11} {'extra peak':>11} "
             f"{'naive/this':>11} {'call':>9}"]
    for r in records:
        if naive is None:
            ratio = "-"
        elif r.extra_bytes <= 0:
            ratio = "inf"
        else:
            ratio = f"{naive.extra_bytes / r.extra_bytes:.1f}"
        lines.append(f"{r.kernel:<24} {r.variant:<8} {format_bytes(r.predicted_bytes):>11} "
                     f"{format_bytes(r.extra_bytes):>11} {ratio:>11} {r.seconds:>7.2f} s")
    if naive is not None:
        lines.append(f"naive = {naive.kernel} naive")
    lines.append("extra peaks under about 1 MiB are at the resolution of Linux's RSS counters")
    return "\n".join(lines)


def to_json(records) -> str:
    return json.dumps([dict(asdict(r), extra_bytes=r.extra_bytes) for r in records], indent=2)


def main(args):
    """`moagen bench memory`: every name checked before the first (long) run."""
    from moagen.bench.calls import targets
    from moagen.files import write_text

    given = {size: getattr(args, size) for size in DEFAULT_SIZES}
    cases = [(name, v, sizes_for(name, given)) for name, v in targets(args.kernels, [args.lang])]
    start = time.perf_counter()
    records = []
    for name, variant, sizes in cases:
        print(f"measuring {name} {variant} ...", file=sys.stderr, flush=True)
        records.append(measure(name, variant, sizes, args.dtype, args.lang))
    print(f"extra peak memory of one call, each in a fresh process: "
          f"{' '.join(f'{k}={v}' for k, v in given.items())}, {args.dtype}, {args.lang}")
    print(format_table(records))
    print(f"total {time.perf_counter() - start:.0f} s (loading, building and calls)")
    if args.json:
        write_text(args.json, to_json(records))


if __name__ == "__main__":
    print(json.dumps(_measure_here(**json.loads(sys.argv[1]))))

