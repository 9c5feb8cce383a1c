"""The measurement commands: `moagen bench` (the sweep and the paper's experiments),
`moagen tune`, `moagen report` and `moagen slurm`."""
from pathlib import Path

from moagen.bench.calls import BASELINES, DEFAULT_BASELINES
from moagen.bench.suite import DEFAULT_OUT
from moagen.commands.common import name_equals_size, positive_integer
from moagen.onf.signature import DTYPES
from moagen.targets import TARGETS, of_kind
from moagen.tuning import DEFAULT_FILE


def add_parser(top):
    # no abbreviations here: `bench memory --d 8` (the size d) would read as an ambiguous
    # prefix of the sweep's own --dtype and --dry-run
    bench = top.add_parser("bench", help="benchmarks: the sweep (no BENCHMARK), memory, "
                                         "atomics, topology, c-vs-fortran", allow_abbrev=False)
    benchmarks = bench.add_subparsers(required=False, metavar="BENCHMARK")

    bench.add_argument("--quick", action="store_true", help="a sanity sweep, under a minute")
    bench.add_argument("--kernels", nargs="+", metavar="KERNEL[:VARIANT]",
                       help="a kernel (every variant) or one variant of it; default: every kernel")
    bench.add_argument("--lang", action="append", metavar="LANG",
                       help=f"{', '.join(TARGETS)} (repeatable; default: "
                            f"{' and '.join(of_kind('cpu'))})")
    bench.add_argument("--threads", type=positive_integer, nargs="+", help="default: 1, 2, 4, ... the cores")
    bench.add_argument("--n", type=positive_integer, nargs="+", help="lengths (default: per kernel)")
    bench.add_argument("--dtype", choices=DTYPES, default="float64")
    bench.add_argument("--size", action="append", default=[], type=name_equals_size,
                       metavar="NAME=VALUE", help="another size for the kernels that have it "
                                                  "(heads=8, d=128); repeatable")
    bench.add_argument("--baselines", nargs="*", choices=BASELINES,
                       help="which baselines run next to ours: the numpy reference, the PyTorch "
                            "a user would write, and that PyTorch under torch.compile (default: "
                            f"{' and '.join(DEFAULT_BASELINES)}; torch alone for CUDA, on the "
                            "same GPU; none with no name)")
    _dry_run_option(bench)
    bench.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON-lines file, appended to")
    bench.add_argument("--tuning", type=Path, default=DEFAULT_FILE,
                       help="schedule parameters `moagen tune` chose on this machine (default: "
                            f"{DEFAULT_FILE}, when it exists)")
    bench.add_argument("--untuned", action="store_true",
                       help="run every variant with its default schedule parameters")
    bench.set_defaults(run=_run("moagen.bench.suite"))

    p = top.add_parser("tune", help="choose the schedule parameters of kernel variants on this "
                                    "machine by timing every candidate")
    p.add_argument("kernels", nargs="+", metavar="KERNEL")
    p.add_argument("--variant", help="default: every variant with parameters")
    p.add_argument("--lang", action="append", choices=of_kind("cpu"), help="default: c")
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument("--n", type=positive_integer, help="length (default: the kernel's largest bench length)")
    p.add_argument("--size", action="append", default=[], type=name_equals_size,
                   metavar="NAME=VALUE", help="another size, as for the bench")
    p.add_argument("--threads", type=positive_integer, help="default: OMP_NUM_THREADS, else every core")
    p.add_argument("--repeats", type=positive_integer, default=5)
    p.add_argument("--out", type=Path, default=DEFAULT_FILE, help="tuning file, updated")
    p.set_defaults(run=_run("moagen.bench.tune"))

    p = benchmarks.add_parser("memory", help="the extra peak memory of one call of each kernel "
                                             "variant, each in a fresh process, next to the ONF's temps")
    from moagen.bench.memory import DEFAULT_KERNELS, DEFAULT_SIZES
    p.add_argument("--kernels", nargs="+", default=DEFAULT_KERNELS, metavar="KERNEL[:VARIANT]",
                   help="a kernel (every variant) or one variant of it; default: "
                        + " ".join(DEFAULT_KERNELS))
    for size, default in DEFAULT_SIZES.items():
        p.add_argument(f"--{size}", type=positive_integer, default=default)
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument("--lang", choices=of_kind("cpu"), default="c")  # host memory only
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the records as JSON")
    p.set_defaults(run=_run("moagen.bench.memory"))

    p = benchmarks.add_parser("atomics", help="paper V, result 1: fused atomic vs owner vs "
                                              "separate forward and backward")
    p.add_argument("--n", type=positive_integer, nargs="+", default=[256, 1024])
    p.add_argument("--lang", action="append", metavar="LANG", help="default: c (and cuda with a GPU)")
    _dry_run_option(p)
    _experiment_options(p, _run("moagen.bench.atomics"))

    p = benchmarks.add_parser("topology", help="paper V, result 2: decode over threads, binding, "
                                               "first touch and parallel regions per call")
    p.add_argument("--n", type=positive_integer, nargs="+", default=[1024, 8192])
    p.add_argument("--max-threads", type=positive_integer, help="default: 4 x the cores")
    _experiment_options(p, _run("moagen.bench.topology"))

    p = benchmarks.add_parser("c-vs-fortran", help="paper V, result 3: the same ONF in C (with "
                                                   "and without restrict) and Fortran")
    p.add_argument("--kernels", nargs="+", metavar="KERNEL[:VARIANT]")
    p.add_argument("--n", type=positive_integer, help="default: per kernel")
    p.add_argument("--valgrind", action="store_true",
                   help="also count instructions and cache misses under cachegrind (slow)")
    p.add_argument("--target", choices=("cpu", "openacc"), default="cpu",
                   help="openacc: OpenACC C, C without restrict and Fortran on a GPU, next "
                        "to CUDA (moagen.bench.offload)")
    p.add_argument("--ptx", action="store_true",
                   help="with --target openacc: the device code side by side (PTX, ptxas, "
                        "SASS), no GPU needed; default kernels: every kernel")
    _experiment_options(p, _c_vs_fortran)

    p = top.add_parser("report", help="summary (markdown) and plots of a benchmark results file")
    p.add_argument("results", type=Path)
    p.add_argument("--run", dest="run_id", help="the run's id (default: the latest in the file)")
    p.add_argument("--out", type=Path, help="folder (default: RESULTS without its suffix)")
    p.set_defaults(run=_report)

    p = top.add_parser("slurm", help="write a Slurm batch script that runs the topology sweep "
                                     "on a cluster node")
    p.add_argument("--partition")
    p.add_argument("--cores", type=positive_integer, required=True, help="cores of the node")
    p.add_argument("--numa-nodes", type=positive_integer, default=1)
    p.add_argument("--time", default="01:00:00")
    p.add_argument("-o", "--output", type=Path, help="default: print it")
    p.add_argument("--ring", action="store_true",
                   help="instead: the distributed kernels verified and ring attention measured "
                        "on a multi-node allocation, one MPI rank per NUMA node")
    p.add_argument("--nodes", type=positive_integer, default=2, help="with --ring (default: %(default)s)")
    p.add_argument("--ranks-per-numa", type=positive_integer, default=1,
                   help="with --ring: MPI ranks per NUMA node (default: %(default)s)")
    p.add_argument("--python", default=".venv/bin/python",
                   help="with --ring: the Python with moagen and mpi4py (default: %(default)s)")
    p.add_argument("--ring-n", type=positive_integer, default=65536,
                   help="with --ring: the sequence measured (default: %(default)s)")
    p.add_argument("--verify", nargs="+", metavar="KERNEL",
                   help="with --ring: the distributed kernels verified first (default: every "
                        "one)")
    p.set_defaults(run=_run("moagen.bench.slurm"))


def _dry_run_option(p):
    p.add_argument("--dry-run", action="store_true",
                   help="every call once, to check the run end to end before a GPU is at hand "
                        "(cuda-emulated allowed); the times mean nothing")


def _experiment_options(p, run):
    p.add_argument("--repeats", type=positive_integer, default=5)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT.with_name(f"{p.prog.split()[-1]}.jsonl"),
                   help="JSON-lines file, appended to; the figure goes beside it")
    p.set_defaults(run=run)


def _run(module):
    def run(args):
        import importlib
        return importlib.import_module(module).main(args)
    return run


def _c_vs_fortran(args):
    """Its CPU half (moagen.bench.languages) or its GPU half (moagen.bench.offload)."""
    return _run("moagen.bench.offload" if args.target == "openacc" else "moagen.bench.languages")(args)


def _report(args):
    from moagen.bench import report
    print(report.write(args.results, args.run_id, args.out).read_text())
