"""`moagen show`: one stage of a kernel (shape, dnf, onf), as the pipeline makes it."""
from moagen.commands.common import name_equals_integer, print_shapes
from moagen.onf.signature import DTYPES
from moagen.pipeline import TARGET_KINDS

STAGES = ("shape", "dnf", "onf")


def add_parser(sub):
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
    p.set_defaults(run=run)


def run(args):
    from moagen.errors import UnknownNameError
    from moagen.kernels import CompositeKernel, get_kernel
    from moagen.kernels.compose import format_stages
    from moagen.kernels.layers import format_layers
    from moagen.moa.dnf import format_dnf
    from moagen.onf.dump import format_onf
    from moagen.pipeline import onf_of

    kernel = get_kernel(args.kernel)
    # the onf stage is a target kind's: the kind's default, or refused where it does not run
    variant = kernel.variant(args.variant, args.target if args.stage == "onf" else None,
                             args.dtype)
    if args.stage == "onf":
        params = dict(args.param)
        if args.upto is not None and args.upto < 0:
            raise UnknownNameError(f"--upto {args.upto}: give a number of steps, 0 or more")
        if not isinstance(kernel, CompositeKernel):
            print(format_layers(variant.layers(params, args.target, args.dtype), args.target,
                                variant.params(params, args.target, args.dtype), args.upto),
                  end="")
        print(format_onf(onf_of(args.kernel, args.variant, args.layout, params, args.target,
                                args.dtype, args.upto)), end="")
    elif isinstance(kernel, CompositeKernel):
        print(format_stages(kernel.composite, args.stage, get_kernel), end="")
    elif args.stage == "shape":
        print_shapes(kernel.spec)
    else:
        print(format_dnf(kernel.dnf(args.variant)), end="")
