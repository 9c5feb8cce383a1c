"""`moagen cost`: the cost model of a kernel's variants, and its measured counterparts."""
import json
import sys

from moagen.cost.model import SizeError

SWEEP_EXAMPLE = "n=256,512,1024"


def add_parser(sub):
    from moagen.cost.measure import CacheConfig
    from moagen.onf.signature import DTYPES

    p = sub.add_parser("cost", help="F, M, scratch and atomics of a kernel, derived from its ONF; "
                                    "measured with --measure (cachegrind) and --cuda (ptxas, SASS)")
    p.add_argument("kernel")
    p.add_argument("--variant", action="append", help="one variant (repeatable); default: all")
    p.add_argument("-D", dest="define", action="append", default=[], metavar="SIZE=N",
                   help="a size, for numbers (every size of the kernel is then needed)")
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument("--measure", action="store_true",
                   help="run the C kernel once under cachegrind at these sizes: predicted M next "
                        "to the measured last-level traffic")
    p.add_argument("--sweep", metavar="SIZE=N,N,...",
                   help=f"one size over several values (e.g. {SWEEP_EXAMPLE}), the others from -D")
    p.add_argument("--ll", type=int, default=CacheConfig.ll_bytes, metavar="BYTES",
                   help="the simulated last-level cache (default: %(default)s)")
    p.add_argument("--cuda", action="store_true",
                   help="compile the CUDA kernels (sm_80, sm_90): registers, shared memory, "
                        "spills and SASS atomics next to the ONF's atomic updates; on an H200 "
                        "(sm_90) at the -D sizes (the bench's for those not given): grid, "
                        "waves, occupancy, the innermost loops' SASS instruction mix, bytes, "
                        "flops and a roofline bound beside PyTorch's measured time")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--ranks", metavar="P,P,...",
                   help="a distributed kernel (moagen.ranks) on P ranks: time, bytes and memory "
                        "per rank from the -D sizes of the whole problem (moagen.cost.ranks)")
    p.add_argument("--rate", type=float, metavar="FLOP/S",
                   help="with --ranks: one rank's rate (default: measured here)")
    p.add_argument("--bandwidth", type=float, default=25e9, metavar="BYTES/S",
                   help="with --ranks: a link's bandwidth (default: %(default)g)")
    p.add_argument("--latency", type=float, default=2e-6, metavar="S",
                   help="with --ranks: a message's latency (default: %(default)g)")
    p.add_argument("--plot", metavar="PNG", help="with --ranks: time and memory per rank, plotted")
    p.set_defaults(run=run)


def run(args):
    from moagen.cost import report
    from moagen.cost.gpu import H200
    from moagen.cost.measure import CacheConfig
    from moagen.cost.model import predict
    from moagen.kernels import get_kernel

    if args.ranks:
        return _over_ranks(args)
    kernel = get_kernel(args.kernel)
    # every variant of the kind measured: the CPU's, or CUDA's with --cuda (its tensor cores)
    costs = [predict(kernel.name, kernel.variant(v).name, args.dtype)
             for v in (args.variant or kernel.variants_on("cuda" if args.cuda else "cpu"))]
    points = _points(args.define, args.sweep)
    if args.cuda:  # the GPU's numbers need sizes: the bench's where -D gives none
        points = [_with_bench_sizes(kernel, p) for p in points or [{}]]
    # every error before the first long run; the sizes a call chooses as on the modelled
    # GPU (--cuda) or this CPU, for each variant that has some
    sms = H200.sms if args.cuda else None
    envs = [{s: v for c in costs for s, v in c.sizes_from(_own(c, p, costs), sms).items()}
            for p in points]
    if args.measure and not envs:
        raise SizeError(f"--measure needs sizes: -D SIZE=N for each of "
                        f"{', '.join(s.name for s in costs[0].sizes)}")
    cache = CacheConfig(ll_bytes=args.ll)
    records = _measured(costs, points, envs, args.dtype, cache) if args.measure else None
    cuda, gpu = {}, []
    if args.cuda:
        from moagen.cost.gpu_metrics import gpu_metrics
        from moagen.cost.sass import inspect
        cuda = {c.variant: inspect(c.kernel, c.variant, args.dtype) for c in costs}
        gpu = [gpu_metrics(c.kernel, c.variant, args.dtype,
                           {s.name: v for s, v in _of(c, env).items()},
                           H200, cuda[c.variant]) for c in costs for env in envs]
    if args.json:
        doc = ({"measured": records} if records else
               {"costs": [report.cost_json(c, _of(c, env)) for c in costs for env in envs or [None]]})
        if cuda:
            doc["cuda"] = {variant: report.cuda_json(r) for variant, r in cuda.items()}
            doc["gpu"] = [report.gpu_json(m) for m in gpu]
        print(json.dumps(doc, indent=1))
        return
    if records:
        print(report.format_measured(records, cache))
    else:
        for c in costs:
            for env in envs or [None]:
                print(report.format_cost(c, _of(c, env)))
    for variant, reports in cuda.items():
        print(f"{costs[0].kernel}, variant {variant}: CUDA kernels ({args.dtype})")
        print(report.format_cuda(reports))
    for m in gpu:
        print(report.format_gpu(m))


def _over_ranks(args):
    from dataclasses import asdict

    from moagen.cost import ranks as model
    _, counts = size_assignment(f"ranks={args.ranks}", many=True)
    sizes = dict(size_assignment(d) for d in args.define)
    rate, measured_at = args.rate, None
    if rate is None:
        rate, measured_at = model.measured_rate(args.kernel, sizes, args.dtype)
    costs = [model.rank_cost(args.kernel, sizes, p, rate, args.bandwidth, args.latency, args.dtype)
             for p in counts]
    threshold = (model.hiding_block(args.kernel, sizes, rate, args.bandwidth, args.latency,
                                    args.dtype)
                 if model.get_rank_kernel(args.kernel).pattern != "gather" else None)
    if args.json:
        print(json.dumps({"rate": rate, "rate_measured_at": measured_at,
                          "bandwidth": args.bandwidth, "latency": args.latency,
                          "hiding_block": threshold,
                          "costs": [dict(asdict(c), hidden=c.hidden) for c in costs]}, indent=1))
    else:
        if measured_at:
            print(f"R measured here (one process, {args.dtype}) at "
                  f"{' '.join(f'{k}={v}' for k, v in measured_at.items())}")
        print(model.format_table(costs, rate, args.bandwidth, args.latency, threshold))
    if args.plot:
        print(f"wrote {model.plot(costs, args.plot)}", file=sys.stderr)


def _measured(costs, points, envs, dtype, cache):
    from moagen.cost import report
    from moagen.cost.measure import measure

    records = []
    for cost in costs:
        for sizes, env in zip(points, envs):
            print(f"measuring {cost.kernel} {cost.variant} "
                  f"{' '.join(f'{k}={v}' for k, v in sizes.items())} ...", file=sys.stderr, flush=True)
            counts = measure(cost.kernel, cost.variant, sizes, dtype, cache)
            records.append(report.measured_json(cost, _of(cost, env), counts, cache.line))
    return records


def _own(cost, given, costs):
    """The -D sizes less those only another variant chooses (-D w for grouped's, where
    every variant is costed): a name no variant has stays, refused as unknown."""
    others = {name for c in costs for name, _ in c.chosen} - {s.name for s in cost.sizes}
    return {k: v for k, v in given.items() if k not in others}


def _of(cost, env):
    """A variant's own sizes of env (None where there are none)."""
    return env and {s: v for s, v in env.items() if s in cost.sizes}


def _with_bench_sizes(kernel, given):
    """The -D sizes, and the kernel's bench sizes (at its middle length, or at -D n) for
    those not given; just the -D sizes for a kernel with no bench."""
    from moagen.bench import calls
    if kernel.bench is None:
        return given
    lengths = calls.lengths(kernel.name, quick=False)
    n = given.get("n", lengths[len(lengths) // 2])
    return {**calls.sizes(kernel.name, n), **given}


def _points(defines, sweep):
    """The size assignments to evaluate: the -D ones, once per swept value."""
    given = dict(size_assignment(d) for d in defines)
    if not sweep:
        return [given] if given else []
    name, values = size_assignment(sweep, many=True)
    return [{**given, name: v} for v in values]


def size_assignment(text, many=False):
    name, sep, values = text.partition("=")
    try:
        numbers = [int(v) for v in values.split(",")] if sep else []
    except ValueError:
        numbers = []
    if not name.isidentifier() or not numbers or (len(numbers) > 1 and not many) \
            or any(v < 0 for v in numbers):
        form = f"SIZE=N,N,... (e.g. {SWEEP_EXAMPLE})" if many else "SIZE=N (e.g. n=4096)"
        raise SizeError(f"cannot read {text!r} as {form}")
    return name, numbers if many else numbers[0]
