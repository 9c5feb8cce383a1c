"""`moagen emit`: the source of one kernel variant in one language, printed or written."""
from pathlib import Path

from moagen.commands.common import name_equals_integer
from moagen.files import write_text
from moagen.onf.signature import DTYPES
from moagen.targets import TARGETS


def add_parser(sub):
    p = sub.add_parser("emit", help="print (or write) the source of a kernel")
    p.add_argument("kernel")
    p.add_argument("--lang", choices=tuple(TARGETS), default="c")
    p.add_argument("--variant")
    p.add_argument("--dtype", choices=DTYPES, help="one dtype only (default: both)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   type=name_equals_integer, help="a schedule parameter (moagen list shows them)")
    p.add_argument("-o", "--output", type=Path)
    p.set_defaults(run=run)


def run(args):
    from moagen.emit import emit

    source = emit(args.kernel, args.variant, args.lang, (args.dtype,) if args.dtype else DTYPES,
                  params=dict(args.param))
    if args.output:
        write_text(args.output, source)
    else:
        print(source, end="")
