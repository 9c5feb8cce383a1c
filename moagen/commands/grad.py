"""`moagen grad KERNEL`: the backward of a kernel derived from its spec (moagen.moa.grad):
the derived spec, the rewrites that shaped it, its DNF, and the checks that no temporary of
that DNF is n x n and no reduction in it is recomputed per term of another (n^3 work)."""
import sys

from moagen.errors import UnknownNameError


def add_parser(sub):
    p = sub.add_parser("grad", help="derive a kernel's backward (vector-Jacobian product) from "
                                    "its spec: the spec, its DNF, and the n x n check")
    p.add_argument("kernel")
    p.add_argument("--wrt", action="append", metavar="INPUT",
                   help="an input to differentiate with respect to (repeatable); default: "
                        "those the kernel's module declares, else every input")
    p.add_argument("--cotangent", action="append", metavar="OUTPUT",
                   help="an output given a cotangent (repeatable); default: as declared, else "
                        "every output")
    p.add_argument("--materialize", action="append", metavar="LABEL",
                   help="a Named intermediate the DNF stores (repeatable); default: what the "
                        "registered <kernel>_vjp's first variant past naive stores, else none")
    p.add_argument("--no-rewrites", action="store_true",
                   help="the plain reverse-mode result, before moagen.moa.rewrites")
    p.add_argument("--shape", action="store_true", help="print the derived spec node by node")
    p.set_defaults(run=run)


def declared():
    """forward kernel -> grad options, as the kernel modules declare them (their VJP)."""
    from moagen.kernels import MODULES
    return {name: options for module in MODULES
            for name, options in getattr(module, "VJP", {}).items()}


def run(args):
    from moagen.commands.common import print_shapes
    from moagen.kernels import ALIASES, KERNELS, get_kernel
    from moagen.moa.dnf import format_dnf, psi_reduce
    from moagen.moa.grad import derive
    from moagen.moa.rewrites import quadratic_temporaries, recomputed_reductions
    from moagen.moa.shape import fmt_shape

    kernel = get_kernel(args.kernel)
    if not hasattr(kernel, "spec"):
        return _composite(kernel, args)
    options = dict(declared().get(kernel.name, {}))
    if args.wrt:  # with the declared index names where there are some
        index = options.get("wrt") or {}
        known = all(w in index for w in args.wrt)
        options["wrt"] = {w: index[w] for w in args.wrt} if known else args.wrt
    if args.cotangent:
        options["cotangents"] = args.cotangent
    if args.no_rewrites:
        options["rewrites"] = ()
    derivation = derive(kernel.spec, **options)
    spec = derivation.spec
    materialize = set(args.materialize or _stored(spec, KERNELS.get(ALIASES.get(spec.name))))
    dnf = psi_reduce(spec, materialize)
    print(f"{spec.name}: derived from {kernel.name}; cotangents "
          + ", ".join(a.name for a in spec.inputs if a.name.startswith("d")) + "; gradients "
          + ", ".join(o.name for o in spec.outputs))
    print("rewrites: " + (", ".join(f"{name} ({count})" for name, count in derivation.rewrites)
                          or "none applied"))
    if args.shape:
        print_shapes(spec)
    print(format_dnf(dnf), end="")
    temps = ", ".join(f"{d.target}{fmt_shape(d.shape)}" for d in dnf.temps) or "none"
    print(f"\ntemporaries: {temps}")
    failures = []
    quadratic = quadratic_temporaries(dnf)
    if quadratic:
        failures.append(f"n x n temporaries {', '.join(quadratic)}")
    recomputed = recomputed_reductions(dnf)
    if recomputed:
        failures.append(f"{', '.join(recomputed)} recompute a reduction for every term of "
                        "another over the same extent (n^3 work)")
    for failure in failures:
        print(f"FAIL: {failure}: not the memory-optimal form", file=sys.stderr)
    if failures:
        return 1
    print("no n x n temporary, no reduction recomputed per term")
    return 0


def _composite(kernel, args):
    """A composite's backward, derived by the chain rule over its stages
    (moagen.kernels.chain) and registered as <composite>_vjp: its stages, each stage
    kernel's backward derived (a <forward>_vjp) or written by hand."""
    from moagen.kernels import ALIASES, get_kernel
    from moagen.kernels.chain import role
    from moagen.kernels.compose import format_stages

    if args.wrt or args.cotangent or args.materialize or args.no_rewrites or args.shape:
        raise UnknownNameError(f"{kernel.name} is a composite: its backward is derived by the "
                               "chain rule over its stages; --wrt, --cotangent, --materialize, "
                               "--no-rewrites and --shape apply to a kernel's spec")
    name = ALIASES.get(f"{kernel.name}_vjp")
    if name is None:
        raise UnknownNameError(f"{kernel.name} declares no backward ({kernel.name}_vjp)")
    derived = {target: alias for alias, target in ALIASES.items()}
    backward = get_kernel(name).composite
    print(f"{backward.name} (= {kernel.name}_vjp): derived from {kernel.name} by the chain rule "
          "over its stages; gradients " + ", ".join(backward.outputs))
    print(f"kept from the forward: {', '.join(kernel.composite.kept()) or '(none)'}")
    for st in backward.stages:
        how = {"sum": "sums a cotangent's terms", "recompute": "recomputes forward arrays",
               "backward": f"derived ({derived.get(st.kernel)})" if st.kernel in derived
               else "written by hand"}[role(st)]
        print(f"  {st.label:<16} {st.kernel:<20} {how}")
    print()
    print(format_stages(backward, "shape", get_kernel), end="")
    return 0


def _stored(spec, registered):
    """What the registered backward's first variant past naive (the framework's way, which
    stores P) stores, of the intermediates this spec names (the registered MLP backward also
    names the transposed operands its variants store); nothing if none is registered."""
    from moagen.moa.expr import Named, walk

    if registered is None:
        return set()
    lean = next((v for name, v in registered.variants.items() if name != "naive"),
                registered.variant())
    named = {n.label for o in spec.outputs for n in walk(o.value) if isinstance(n, Named)}
    return lean.materialize & named
