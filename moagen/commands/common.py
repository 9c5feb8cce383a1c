"""What several subcommands share: argument types that refuse bad values with a clear
message, where generated/ is, and the shape stage's printer."""
import argparse
from pathlib import Path

GENERATED = Path(__file__).resolve().parents[2] / "generated"


def positive_integer(text):
    """An integer of 1 or more, for argparse (a length, a count of threads or repeats)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected 1 or more")
    return value


def name_equals_integer(text):
    """NAME=VALUE with an integer value, for argparse."""
    name, _, value = text.partition("=")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=INTEGER") from None


def name_equals_size(text):
    """NAME=VALUE with a size of 1 or more (heads=8), for argparse."""
    name, value = name_equals_integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is 1 or more")
    return name, value


def print_shapes(spec):
    """Every node of every output with its shape: the `shape` stage."""
    from moagen.moa.shape import annotate, fmt_shape
    spec.validate()
    for out in spec.outputs:
        print(f"output {out.name}[{', '.join(out.index)}]:")
        for depth, path, what, shape in annotate(out.value, f"{spec.name}.{out.name}"):
            print(f"  {'  ' * depth + what:<48} {fmt_shape(shape):<28} {path}")
