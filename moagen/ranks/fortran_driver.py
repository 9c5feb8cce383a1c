"""The rank layer printed in Fortran (moagen.ranks.driver_steps): a module of bind(C) drivers
that uses MPI's `mpi` module and the rank-local kernels' module."""
from moagen.ranks.dialect import INT, INT64, Dialect
from moagen.ranks.driver_steps import driver_lines
from moagen.targets.fortran.printer import KIND, wrap_statement

INTENT = {"in": "intent(in)", "out": "intent(out)", "scratch": "intent(inout)"}


class FortranDialect(Dialect):
    INDENT, STEP = 4, 2
    COMMENT = "! {}"
    IF, ELSE_IF, ELSE, END_IF = "if ({}) then", "else if ({}) then", "else", "end if"
    STEPS, END_STEPS = "do step = 0, ranks - 1", "end do"
    CALL = "call {}({})"
    COMM = "int(comm)"
    DATATYPE = {"float64": "MPI_DOUBLE_PRECISION", "float32": "MPI_REAL"}
    KIND = {INT: "integer", INT64: "integer(c_int64_t)"}

    def __init__(self, dtype):
        super().__init__(dtype)
        self.kind = KIND[dtype]
        self.negative_infinity = f"ieee_value(0.0_{self.kind}, ieee_negative_inf)"
        self.declared = {INT: [], INT64: []}  # the locals, declared before the body

    def declare(self, kind, *names):
        self.declared[kind] += [x for x in names if x not in self.declared[kind]]

    def open_driver(self, name, comments, arrays, local, rings):
        self.name = name
        sizes = [s.name for s in local.sizes]
        args = ["comm"] + [a.name for a in arrays] + sizes + list(local.scalars)
        self.head = ["", *(f"  {self.COMMENT.format(line)}" for line in comments),
                     f"  subroutine {name}({', '.join(args)}) &", f'      bind(C, name="{name}")',
                     f"    integer(c_int64_t), value, intent(in) :: {', '.join(['comm'] + sizes)}"]
        if local.scalars:
            self.head.append(f"    real({self.kind}), value, intent(in) :: {', '.join(local.scalars)}")
        for a in arrays:
            self.head.append(f"    real({self.kind}), {INTENT[a.intent]}"
                             f"{', asynchronous' if a.name in rings else ''} :: {a.name}(0:*)")
        self.declare(INT, "rank", "ranks", "ierr")
        self.mpi("MPI_Comm_rank", self.COMM, "rank")
        self.mpi("MPI_Comm_size", self.COMM, "ranks")

    def text(self):
        declarations = [f"    {self.KIND[k]} :: {', '.join(names)}" for k, names in self.declared.items()
                   if names]
        return self.head + declarations + [""] + self.body + [f"  end subroutine {self.name}"]

    def pointer(self, ref):
        return ref.array if ref.offset is None else f"{ref.array}({ref.offset})"

    def section(self, ref, count):
        """count elements of the ref, as an array section."""
        first = ref.offset or "0"
        last = f"{count} - 1" if ref.offset is None else f"{ref.offset} + {count} - 1"
        return f"{ref.array}({first}:{last})"

    def let(self, kind, name, value, why=""):
        self.declare(kind, name)
        self.line(f"{name} = {value}" + self.trailing(why))

    def mod(self, a, b):
        return f"mod({a}, {b})"

    def select(self, condition, a, b):
        return f"merge({a}, {b}, {condition})"

    def mpi_count(self, count):
        return f"int({count})"

    def int64_arg(self, value):
        """MPI's rank count and literals are default integers."""
        return f"int({value}, c_int64_t)" if not value.isidentifier() or value == "ranks" else value

    def steps(self):
        self.declare(INT, "step")
        super().steps()

    def requests(self, count):
        self.declare(INT, "pending", f"requests({count})")
        self.line("pending = 0")

    def post(self, function, *args):
        self.mpi(function, *args, "requests(pending + 1)")
        self.line("pending = pending + 1")

    def mpi(self, function, *args):
        self.call(function, *args, "ierr")

    def copy(self, to, source, count):
        self.line(f"{self.section(to, count)} = {self.section(source, count)}")

    def add(self, to, source, count):
        target = self.section(to, count)
        self.line(f"{target} = {target} + {self.section(source, count)}")

    def fill(self, to, count, value):
        self.line(f"{self.section(to, count)} = {value}")


DRIVER_MODULE = "moagen_ranks"


def fortran_file(mapping, dtypes, banner, kernels_module) -> str:
    """The driver module: MPI's Fortran bindings and the rank-local kernels' module."""
    lines = [f"! {line}" for line in banner]
    lines += [f"module {DRIVER_MODULE}",
              "  use, intrinsic :: iso_c_binding, only: c_double, c_float, c_int64_t",
              "  use, intrinsic :: ieee_arithmetic, only: ieee_value, ieee_negative_inf",
              "  use mpi",
              f"  use {kernels_module}",
              "  implicit none",
              "", "contains"]
    for dtype in dtypes:
        lines += driver_lines(mapping, dtype, FortranDialect)
    lines += ["", f"end module {DRIVER_MODULE}"]
    return "".join(w + "\n" for line in lines for w in wrap_statement(line))
