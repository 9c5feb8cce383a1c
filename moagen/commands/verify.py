"""`moagen verify`: every kernel variant, language and dtype run against numpy and PyTorch,
a row each, at the kernel's verification sizes."""
from moagen.onf.signature import DTYPES
from moagen.targets import TARGETS


def add_parser(sub):
    p = sub.add_parser("verify", help="run every kernel against numpy and PyTorch")
    p.add_argument("kernels", nargs="*")
    p.add_argument("--lang", choices=tuple(TARGETS), action="append")
    p.add_argument("--variant", action="append")
    p.add_argument("--dtype", choices=DTYPES, action="append")
    p.add_argument("--emulate", action="store_true",
                   help="run CUDA on the host, each block's threads an OpenMP team "
                        "(cuda-emulated); with no --lang, CUDA only")
    p.add_argument("--racecheck", action="store_true",
                   help="with --emulate: build the emulation with its race check over shared "
                        "memory (MOAGEN_RACECHECK=1): a race between a block's threads, or an "
                        "index out of bounds, fails the kernel's row")
    p.add_argument("--ranks", action="store_true",
                   help="the distributed kernels (moagen.ranks), C and Fortran, on the ranks "
                        "of the MPI job: mpirun -np P moagen verify --ranks")
    p.set_defaults(run=run)


def run(args):
    from moagen import verify
    from moagen.errors import DeviceUnavailable, MoagenError
    from moagen.targets import emulated

    if args.ranks:
        from moagen.ranks.verify import main as verify_ranks
        return verify_ranks(args.kernels or None, tuple(args.lang or ("c", "fortran")),
                            tuple(args.dtype or DTYPES))
    if args.racecheck:
        if not args.emulate and "cuda-emulated" not in (args.lang or ()):
            raise MoagenError("--racecheck checks the CUDA emulation: add --emulate (or --lang "
                              "cuda-emulated)")
        import os
        from moagen.targets.cuda.build import RACECHECK_ENV
        os.environ[RACECHECK_ENV] = "1"  # build_cuda_emulated's, in this process
    if args.emulate:
        langs = tuple(emulated(lang) for lang in args.lang or ("cuda",))
    else:
        langs = tuple(args.lang or verify.default_langs())
    print(verify.HEADER)
    failures = total = 0
    for row in verify.run(args.kernels or None, langs, args.variant, tuple(args.dtype or DTYPES)):
        print(verify.format_row(row), flush=True)
        total += 1
        failures += row.failed
        if row.status.startswith("skip"):  # only CUDA skips, and only when asked for by name
            raise DeviceUnavailable(row.status[len("skip: "):])
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0
