"""`moagen generate`: every kernel, variant and language written to generated/, or checked
against it (--check)."""
import sys
from pathlib import Path

from moagen.commands.common import GENERATED
from moagen.files import write_text


def add_parser(sub):
    p = sub.add_parser("generate", help="write every kernel, variant and language to generated/")
    p.add_argument("--out", type=Path, default=GENERATED)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if generated/ differs from what the generator emits")
    p.set_defaults(run=run)


def every_source():
    """(file name, source) of every kernel, variant and language generated/ holds."""
    from moagen.emit import emit, filename
    from moagen.kernels import KERNELS
    from moagen.targets import LANGS, get_target
    for kernel in KERNELS.values():
        for lang in LANGS:
            for variant in kernel.variants_on(get_target(lang).kind):
                yield filename(kernel.name, variant, lang), emit(kernel.name, variant, lang)


def run(args):
    expected = dict(every_source())
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
    for path in _stale(args.out, expected):
        path.unlink()
        print(f"removed {path}: no kernel, variant and language emits it now")


def _stale(out: Path, expected):
    """The files in `out` that the generator wrote once and emits no longer (a kernel or
    variant renamed or gone): marked in their first lines as generated, named as nothing it
    emits. A file without the mark is left where it is, whatever its name."""
    from moagen.emit import GENERATED_BY
    for path in sorted(out.glob("*")):
        if path.is_file() and path.name not in expected:
            with path.open(errors="replace") as f:
                head = [f.readline() for _ in range(3)]
            if any(GENERATED_BY in line for line in head):
                yield path
