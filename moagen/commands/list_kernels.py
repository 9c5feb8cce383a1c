"""`moagen list`: the kernels, their variants and each variant's schedule parameters with
their defaults per target kind and dtype."""
from moagen.onf.signature import DTYPES
from moagen.kinds import DEFAULT_KINDS, KINDS


def add_parser(sub):
    p = sub.add_parser("list", help="the kernels and their variants")
    p.set_defaults(run=run)


def run(args):
    from moagen.kernels import ALIASES, KERNELS
    for kernel in KERNELS.values():
        variants = [name + defaults_text(variant) for name, variant in kernel.variants.items()]
        also = "".join(f" (= {a})" for a, name in ALIASES.items() if name == kernel.name)
        print(f"{kernel.name}{also}: {', '.join(variants)}{device_defaults_text(kernel)}")


def device_defaults_text(kernel):
    """; on cuda: tensor (float32: tiled) where a target kind runs another variant than the
    first when none is named (Kernel.default_variant)."""
    first, notes = next(iter(kernel.variants)), []
    for target in DEFAULT_KINDS:
        runs = {dtype: kernel.default_variant(target, dtype) for dtype in DTYPES}
        if set(runs.values()) != {first}:
            others = "".join(f" ({dtype}: {name})" for dtype, name in runs.items()
                             if name != runs[DTYPES[0]])
            notes.append(f"; on {target}: {runs[DTYPES[0]]}{others}")
    return "".join(notes)


def defaults_text(variant):
    """ rows=4 lanes=16 (the CPU's for float64), then where others differ: the CPU's for
    another dtype, (float32: lanes=32); the CUDA ones, (cuda: rows=4 lanes=8); a CPU's with
    AVX-512, (avx512 float64: mr=8 nr=16). A variant of some kinds only says so first,
    (cuda only), and its defaults are the first of those kinds'."""
    text = lambda params: "".join(f" {k}={v}" for k, v in params.items())
    kinds = [kind for kind in DEFAULT_KINDS if variant.runs_on(kind)]
    only = f" ({' and '.join(variant.kinds)} only)" if set(variant.kinds) != set(KINDS) else ""
    first, notes = variant.defaults_for(kinds[0]), []
    for target in kinds:
        base = variant.defaults_for(target)
        if base != first:
            notes.append(f" ({target}:{text(base)})")
        for dtype in DTYPES[1:]:
            differ = {k: v for k, v in variant.defaults_for(target, dtype).items() if base[k] != v}
            if differ:
                notes.append(f" ({dtype if target == kinds[0] else f'{target} {dtype}'}:"
                             f"{text(differ)})")
    if variant.runs_on("cpu"):  # AVX-512 is a CPU's
        notes += [f" (avx512 {dtype}:{text(params)})" for dtype, params in variant.avx512.items()]
    return only + text(first) + "".join(notes)
