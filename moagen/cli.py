"""The `moagen` command line."""
import argparse
import sys
from pathlib import Path

from moagen.errors import MoagenError
from moagen.files import write_text

STAGES = ("shape", "dnf", "onf")
GENERATED = Path(__file__).resolve().parent.parent / "generated"


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except MoagenError as error:
        print(f"moagen: error: {error}", file=sys.stderr)
        return 2


def _parser():
    from moagen.onf.signature import DTYPES
    from moagen.pipeline import TARGET_KINDS
    from moagen.targets import TARGETS

    parser = argparse.ArgumentParser(prog="moagen", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("list", help="the kernels and their variants")
    p.set_defaults(run=cmd_list)

    p = sub.add_parser("show", help="print a stage of a kernel: shape, dnf or onf")
    p.add_argument("kernel")
    p.add_argument("--stage", choices=STAGES, default="dnf")
    p.add_argument("--variant")
    p.add_argument("--layout", choices=("row", "col"), default="row")
    p.add_argument("--target", choices=TARGET_KINDS, default="cpu",
                   help="the mapping and defaults the onf stage is for")
    p.add_argument("--dtype", choices=DTYPES, default="float64",
                   help="whose defaults the onf stage takes (float32 may have its own)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   type=name_equals_integer, help="a schedule parameter (moagen list shows them)")
    p.add_argument("--upto", type=int, metavar="K",
                   help="the onf after its first K steps (default: all, and the final form)")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("emit", help="print (or write) the source of a kernel")
    p.add_argument("kernel")
    p.add_argument("--lang", choices=tuple(TARGETS), default="c")
    p.add_argument("--variant")
    p.add_argument("--dtype", choices=DTYPES, help="one dtype only (default: both)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   type=name_equals_integer, help="a schedule parameter (moagen list shows them)")
    p.add_argument("-o", "--output", type=Path)
    p.set_defaults(run=cmd_emit)

    p = sub.add_parser("generate", help="write every kernel, variant and language to generated/")
    p.add_argument("--out", type=Path, default=GENERATED)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if generated/ differs from what the generator emits")
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("build", help="build every kernel (C, Fortran) and compile the CUDA")
    p.add_argument("kernels", nargs="*")
    p.add_argument("--lang", choices=tuple(TARGETS), action="append")
    p.set_defaults(run=cmd_build)

    p = sub.add_parser("verify", help="run every kernel against numpy and PyTorch")
    p.add_argument("kernels", nargs="*")
    p.add_argument("--lang", choices=tuple(TARGETS), action="append")
    p.add_argument("--variant", action="append")
    p.add_argument("--dtype", choices=DTYPES, action="append")
    p.add_argument("--emulate", action="store_true",
                   help="run CUDA on the host, each block's threads an OpenMP team "
                        "(cuda-emulated); with no --lang, CUDA only")
    p.add_argument("--ranks", action="store_true",
                   help="the distributed kernels (moagen.ranks), C and Fortran, on the ranks "
                        "of the MPI job: mpirun -np P moagen verify --ranks")
    p.set_defaults(run=cmd_verify)

    from moagen.grad_command import add_parser as add_grad_parser
    add_grad_parser(sub)  # `moagen grad`: a kernel's backward derived from its spec

    from moagen.cost.command import add_parser as add_cost_parser
    add_cost_parser(sub)  # `moagen cost`: F, M, scratch, atomics; measured with --measure, --cuda

    # no abbreviations here: `bench memory --d 8` (the size d) would read as an ambiguous
    # prefix of the sweep's own --dtype and --dry-run
    p = sub.add_parser("bench", help="benchmarks: the sweep (no BENCHMARK), memory, "
                                     "atomics, topology, c-vs-fortran", allow_abbrev=False)
    bench = p.add_subparsers(required=False, metavar="BENCHMARK")
    from moagen.bench.commands import add_parsers
    add_parsers(p, bench, sub)  # the sweep's options, memory, the experiments, report, slurm
    return parser


def cmd_list(args):
    from moagen.kernels import ALIASES, KERNELS
    for kernel in KERNELS.values():
        variants = [name + _defaults_text(variant) for name, variant in kernel.variants.items()]
        also = "".join(f" (= {a})" for a, name in ALIASES.items() if name == kernel.name)
        print(f"{kernel.name}{also}: {', '.join(variants)}")


def _defaults_text(variant):
    """ rows=4 lanes=16 (the CPU's for float64), then where others differ: the CPU's for
    another dtype, (float32: lanes=32); the CUDA ones, (cuda: rows=4 lanes=8); a CPU's with
    AVX-512, (avx512 float64: mr=8 nr=16)."""
    from moagen.onf.signature import DTYPES
    text = lambda params: "".join(f" {k}={v}" for k, v in params.items())
    cpu, notes = variant.defaults_for("cpu"), []
    for target in ("cpu", "cuda"):
        base = variant.defaults_for(target)
        if base != cpu:
            notes.append(f" ({target}:{text(base)})")
        for dtype in DTYPES[1:]:
            differ = {k: v for k, v in variant.defaults_for(target, dtype).items() if base[k] != v}
            if differ:
                notes.append(f" ({dtype if target == 'cpu' else f'{target} {dtype}'}:"
                             f"{text(differ)})")
    notes += [f" (avx512 {dtype}:{text(params)})" for dtype, params in variant.avx512.items()]
    return text(cpu) + "".join(notes)


def cmd_show(args):
    from moagen.errors import UnknownNameError
    from moagen.kernels import CompositeKernel, get_kernel
    from moagen.kernels.compose import format_stages
    from moagen.kernels.layers import format_layers
    from moagen.moa.dnf import format_dnf
    from moagen.onf.dump import format_onf

    kernel = get_kernel(args.kernel)
    variant = kernel.variant(args.variant)
    if args.stage == "onf":
        params = dict(args.param)
        if args.upto is not None and args.upto < 0:
            raise UnknownNameError(f"--upto {args.upto}: give a number of steps, 0 or more")
        if not isinstance(kernel, CompositeKernel):
            print(format_layers(variant.layers(params, args.target, args.dtype), args.target,
                                variant.params(params, args.target, args.dtype), args.upto),
                  end="")
        print(format_onf(kernel.onf(args.variant, args.layout, params, args.target, args.upto,
                                    args.dtype)), end="")
    elif isinstance(kernel, CompositeKernel):
        print(format_stages(kernel.composite, args.stage, get_kernel), end="")
    elif args.stage == "shape":
        print_shapes(kernel.spec)
    else:
        print(format_dnf(kernel.dnf(args.variant)), end="")


def print_shapes(spec):
    """Every node of every output with its shape: the `shape` stage."""
    from moagen.moa.shape import annotate, fmt_shape
    spec.validate()
    for out in spec.outputs:
        print(f"output {out.name}[{', '.join(out.index)}]:")
        for depth, path, what, shape in annotate(out.value, f"{spec.name}.{out.name}"):
            print(f"  {'  ' * depth + what:<48} {fmt_shape(shape):<28} {path}")


def name_equals_integer(text):
    """NAME=VALUE with an integer value, for argparse."""
    name, _, value = text.partition("=")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=INTEGER") from None


def cmd_emit(args):
    from moagen.codegen.emit import emit
    from moagen.onf.signature import DTYPES

    source = emit(args.kernel, args.variant, args.lang, (args.dtype,) if args.dtype else DTYPES,
                  params=dict(args.param))
    if args.output:
        write_text(args.output, source)
    else:
        print(source, end="")


def _every_source():
    from moagen.codegen.emit import emit, filename
    from moagen.kernels import KERNELS
    from moagen.targets import LANGS
    for kernel in KERNELS.values():
        for variant in kernel.variants:
            for lang in LANGS:
                yield filename(kernel.name, variant, lang), emit(kernel.name, variant, lang)


def cmd_generate(args):
    expected = dict(_every_source())
    if args.check:
        present = {p.name for p in args.out.glob("*") if p.is_file()} if args.out.is_dir() else set()
        stale = sorted(n for n, text in expected.items()
                       if not (args.out / n).is_file() or (args.out / n).read_text() != text)
        extra = sorted(present - set(expected))
        for name in stale:
            print(f"differs from the generator: {args.out / name}")
        for name in extra:
            print(f"not emitted by the generator: {args.out / name}")
        if stale or extra:
            print("run `make generated` and commit the result", file=sys.stderr)
            return 1
        print(f"{len(expected)} generated sources are up to date")
        return 0
    for name, text in expected.items():
        write_text(args.out / name, text)
    print(f"wrote {len(expected)} sources to {args.out}")


def cmd_build(args):
    from moagen.codegen.emit import emit, stem
    from moagen.kernels import KERNELS, get_kernel
    from moagen.runtime import library
    from moagen.targets import LANGS, get_target

    for name in args.kernels or KERNELS:
        kernel = get_kernel(name)
        for variant in kernel.variants:
            for lang in args.lang or LANGS:
                compile_only = get_target(lang).compile_only
                if compile_only:  # compiled for other machines too (CUDA: the GPUs we target)
                    for line in compile_only(emit(name, variant, lang), stem(name, variant)):
                        print(line)
                else:
                    library(name, variant, lang)
                    print(f"built {stem(name, variant)} ({lang})")


def cmd_verify(args):
    from moagen import verify
    from moagen.errors import DeviceUnavailable
    from moagen.onf.signature import DTYPES
    from moagen.targets import emulated

    if args.ranks:
        from moagen.ranks.verify import main as verify_ranks
        return verify_ranks(args.kernels or None, tuple(args.lang or ("c", "fortran")),
                            tuple(args.dtype or DTYPES))
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


if __name__ == "__main__":
    sys.exit(main())
