"""The `moagen` command line: its subcommands, one module each in moagen.commands."""
import argparse
import sys

from moagen.commands import bench, build, cost, emit, generate, grad, list_kernels, show, verify
from moagen.errors import MoagenError

COMMANDS = (list_kernels, show, emit, generate, build, verify, grad, cost, bench)


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except MoagenError as error:
        print(f"moagen: error: {error}", file=sys.stderr)
        return 2


def parser():
    p = argparse.ArgumentParser(prog="moagen", description=__doc__)
    sub = p.add_subparsers(required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


if __name__ == "__main__":
    sys.exit(main())
