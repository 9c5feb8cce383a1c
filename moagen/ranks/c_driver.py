"""The rank layer printed in C (moagen.ranks.driver_steps): MPI's C calls around the
rank-local kernels, one translation unit beside theirs."""
from moagen.ranks.dialect import INT, INT64, Dialect
from moagen.ranks.driver_steps import driver_lines
from moagen.targets.c.loader import CTYPES, declaration


def _operand(expression):
    return expression if expression.isidentifier() else f"({expression})"


class CDialect(Dialect):
    INDENT = STEP = 4
    COMMENT = "/* {} */"
    IF, ELSE_IF, ELSE, END_IF = "if ({}) {{", "}} else if ({}) {{", "} else {", "}"
    STEPS, END_STEPS = "for (int step = 0; step < ranks; ++step) {", "}"
    CALL = "{}({});"
    COMM = "comm"
    DATATYPE = {"float64": "MPI_DOUBLE", "float32": "MPI_FLOAT"}
    KIND = {INT: "int", INT64: "int64_t"}
    negative_infinity = "-INFINITY"

    def __init__(self, dtype):
        super().__init__(dtype)
        self.real = CTYPES[dtype]

    def open_driver(self, name, comments, arrays, local, rings):
        params = ["int64_t comm_handle"]
        params += [f"{'const ' if a.intent == 'in' else ''}{self.real} *restrict {a.name}"
                   for a in arrays]
        params += [f"int64_t {s.name}" for s in local.sizes] + [f"{self.real} {s}" for s in local.scalars]
        self.head = [self.COMMENT.format(line) for line in comments]
        self.head += [f"void {name}(", ",\n".join(f"    {p}" for p in params), ")", "{"]
        self.line("MPI_Comm comm = MPI_Comm_f2c((MPI_Fint) comm_handle);")
        self.line("int rank, ranks;")
        self.mpi("MPI_Comm_rank", self.COMM, "&rank")
        self.mpi("MPI_Comm_size", self.COMM, "&ranks")

    def text(self):
        return self.head + self.body + ["}"]

    def pointer(self, ref):
        return ref.array if ref.offset is None else f"{ref.array} + {ref.offset}"

    def element(self, ref):
        """The ref's element e."""
        return f"{ref.array}[{'e' if ref.offset is None else ref.offset + ' + e'}]"

    def let(self, kind, name, value, why=""):
        self.line(f"const {self.KIND[kind]} {name} = {value};" + self.trailing(why))

    def mod(self, a, b):
        return f"{_operand(a)} % {b}"

    def select(self, condition, a, b):
        return f"{condition} ? {a} : {b}"

    def mpi_count(self, count):
        return f"(int) {_operand(count)}"

    def int64_arg(self, value):
        return value

    def requests(self, count):
        self.line(f"MPI_Request requests[{count}];")
        self.line("int pending = 0;")

    def post(self, function, *args):
        self.mpi(function, *args, "&requests[pending++]")

    def copy(self, to, source, count):
        self.line(f"memcpy({self.pointer(to)}, {self.pointer(source)}, {count} * sizeof({self.real}));")

    def add(self, to, source, count):
        self._open(f"for (int64_t e = 0; e < {count}; ++e) {{")
        self.line(f"{self.element(to)} += {self.element(source)};")
        self._close("}")

    def fill(self, to, count, value):
        self.line(f"for (int64_t e = 0; e < {count}; ++e) {self.element(to)} = {value};")


def c_file(mapping, dtypes, banner) -> str:
    """The driver translation unit: the local kernels' prototypes, then the drivers."""
    head = ["/* " + line + " */" for line in banner]
    head += ["#include <math.h>", "#include <stdint.h>", "#include <string.h>", "#include <mpi.h>", ""]
    for dtype in dtypes:
        head.append(declaration(mapping.local_signature(dtype)))
        if mapping.merged:
            head.append(declaration(mapping.merge_signature(dtype)))
        if mapping.diagonal:
            head.append(declaration(mapping.diagonal_signature(dtype)))
    drivers = ("\n".join(driver_lines(mapping, d, CDialect)) + "\n" for d in dtypes)
    return "\n".join(head) + "\n\n" + "\n".join(drivers)
