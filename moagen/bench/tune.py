"""`moagen tune`: a variant's schedule parameters (tile sizes, rows or heads unrolled
together) chosen on this machine by a small search. Every candidate in the variant's space
(the product of its parameters' values) is built, verified against the references at sizes
that cut its tiles, and timed on the same inputs, round-robin (moagen.bench.timing); the
smallest median wins. The choice, every candidate's time,
the sizes, threads and machine go to a tuning file, under the sizes set with --size;
`moagen bench` runs each variant with this machine's choice for the sizes it runs (or for
as many of them as were tuned) and records the parameters it ran with in every result."""
import itertools
import os

from moagen.bench import calls
from moagen.errors import MoagenError
from moagen.tuning import format_params, kernel_sizes, machine_key, save



def candidates(variant) -> list:
    """The combinations of the variant's space that its schedule takes."""
    names = list(variant.space)
    combinations = (dict(zip(names, values))
                    for values in itertools.product(*(variant.space[n] for n in names)))
    return [c for c in combinations if variant.accepts is None or variant.accepts(**c)]


def search(kernel: str, variant: str, lang: str, dtype: str, n: int, repeats: int = 5,
           overrides=None) -> dict:
    """Time every candidate of one variant at the sizes of length n (overrides: other sizes,
    as the bench's --size); the record of it."""
    from moagen.bench.timing import time_calls
    from moagen.kernels import get_kernel
    from moagen.targets import get_target

    v = get_kernel(kernel).variant(variant, get_target(lang).kind)
    if not v.space:
        raise MoagenError(f"{kernel} {variant} has no schedule parameters to tune")
    tried = candidates(v)
    for params in tried:
        verify(kernel, variant, lang, dtype, params)
    sizes = calls.sizes(kernel, n, overrides)
    args, scalars = calls.inputs(kernel, sizes, dtype), calls.scalars(kernel, sizes)
    timed = []
    for params in tried:
        fn = calls.kernel_callable(kernel, variant, lang, dtype, params)
        out = calls.outputs(fn, sizes)
        timed.append(lambda fn=fn, out=out: fn(*args, out=out, **scalars))
    stats = time_calls(timed, warmup=1, repeats=repeats)
    times = [dict(params=p, median_s=s["median_s"], q1_s=s["q1_s"], q3_s=s["q3_s"])
             for p, s in zip(tried, stats)]
    best = min(times, key=lambda t: t["median_s"])
    return dict(kernel=kernel, variant=variant, lang=lang, dtype=dtype, sizes=sizes,
                overrides=kernel_sizes(kernel, overrides),
                threads=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())),
                params=best["params"], candidates=times,
                # what this machine runs untuned: its AVX-512 defaults where it takes them
                defaults=calls.schedule(kernel, variant, lang, dtype)["params"])


def verify(kernel, variant, lang, dtype, params):
    """A candidate is timed only once it matches the references at every verification size
    (sizes that cut its tiles)."""
    from moagen import runtime
    from moagen.kernels import get_kernel
    from moagen.verify import check_case, format_row

    load = lambda k, v, l, d: runtime.load(k, v, l, d, params)
    for sizes in get_kernel(kernel).check.sizes:
        row = check_case(kernel, variant, lang, dtype, sizes, load)
        if row.failed:
            raise MoagenError(f"{kernel} {variant} with {format_params(params)} does not match its "
                              f"references:\n{format_row(row)}")










def main(args):
    from moagen.kernels import CompositeKernel, get_kernel
    from moagen.targets import get_target

    for kernel in map(get_kernel, args.kernels):
        if isinstance(kernel, CompositeKernel):
            stages = ", ".join(f"{st.kernel} {st.variant}" for st in kernel.composite.stages)
            raise MoagenError(f"{kernel.name} is a composite: its parameters are its stages'; "
                              f"tune its stage kernels ({stages}), and it runs each one's "
                              "choice")
    if args.threads:  # read by OpenMP when the first kernel loads, below
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    langs = args.lang or ["c"]
    for k in map(get_kernel, args.kernels):  # a named variant refused where it does not run
        if args.variant in k.variants:
            k.variant_on_each(args.variant, (get_target(lang).kind for lang in langs))
    targets = [(k.name, name, lang) for k in map(get_kernel, args.kernels) for lang in langs
               for name, v in k.variants_on(get_target(lang).kind).items() if v.space
               and (args.variant is None or name == args.variant)]
    if not targets:
        raise MoagenError("nothing to tune: none of these variants has schedule parameters")
    records = []
    for kernel, variant, lang in targets:
        n = args.n or calls.lengths(kernel, quick=False)[-1]
        r = search(kernel, variant, lang, args.dtype, n, args.repeats, dict(args.size))
        records.append(r)
        print(f"{kernel} {variant} {lang} {args.dtype} n={n} threads={r['threads']}")
        for t in sorted(r["candidates"], key=lambda t: t["median_s"]):
            mark = " <- chosen" if t["params"] == r["params"] else ""
            default = " (default)" if t["params"] == r["defaults"] else ""
            print(f"  {format_params(t['params']):<32} {t['median_s'] * 1e3:9.3f} ms{default}{mark}")
    save(records, args.out)
    print(f"choices for {machine_key()} written to {args.out}")
    return 0
