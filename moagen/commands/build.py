"""`moagen build`: every kernel built and loaded (C, Fortran), CUDA compiled for the GPUs we
target."""
from moagen.targets import TARGETS


def add_parser(sub):
    p = sub.add_parser("build", help="build every kernel (C, Fortran) and compile the CUDA")
    p.add_argument("kernels", nargs="*")
    p.add_argument("--lang", choices=tuple(TARGETS), action="append")
    p.set_defaults(run=run)


def run(args):
    from moagen.emit import emit, stem
    from moagen.kernels import KERNELS, get_kernel
    from moagen.request import resolve
    from moagen.runtime import library
    from moagen.targets import LANGS, get_target

    for name in args.kernels or KERNELS:
        kernel = get_kernel(name)
        for lang in args.lang or LANGS:
            for variant in kernel.variants_on(get_target(lang).kind):
                compile_only = get_target(lang).compile_only
                if compile_only:  # compiled for other machines too (CUDA: the GPUs we target)
                    for line in compile_only(emit(name, variant, lang), stem(name, variant)):
                        print(line)
                else:
                    library(resolve(name, variant, lang, here=False))
                    print(f"built {stem(name, variant)} ({lang})")
