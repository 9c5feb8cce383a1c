"""The statements the rank layer's driver is written in (moagen.ranks.driver_steps), which a
language's dialect prints (c_driver.py, fortran_driver.py): the syntax of the ones of one
shape in both languages is a table of class attributes, the rest a method each."""
from typing import NamedTuple, Optional

INT, INT64 = "int", "int64"  # the driver's integer kinds: MPI's (rank, tag, count), the ABI's


class Ref(NamedTuple):
    """An array from an element offset on (None: from its start)."""
    array: str
    offset: Optional[str] = None


class Dialect:
    """A language's side of the driver. Besides the table, each dialect gives:
    open_driver(name, comments, arrays, local, rings), the function's head (local: the
    rank-local kernel's signature, whose sizes and scalars the driver takes; rings: the
    buffers MPI fills in the background) and text(), the whole function's lines;
    pointer(ref), a call's argument; let(kind, name, value, why), a variable set once;
    mod(a, b) and select(condition, a, b), expressions; mpi_count(count), a count as MPI
    takes it; int64_arg(value), an integer as an INT64 argument; requests(count), room for
    that many requests, none pending; post(function, *args), a nonblocking MPI call with
    its request;
    copy(to, source, count), add(to, source, count) and fill(to, count, value) on refs;
    negative_infinity, the dtype's -inf."""
    INDENT = 0  # the body's first column
    STEP = 0  # the columns each nesting adds
    COMMENT = ""  # {} the text
    IF = ELSE_IF = ELSE = END_IF = ""
    STEPS = END_STEPS = ""  # the loop over the ring's steps: `step` from 0 to ranks - 1
    CALL = ""  # {0} the function, {1} its arguments
    COMM = ""  # the communicator as MPI's calls take it
    DATATYPE = {}  # MPI's datatype of each dtype

    def __init__(self, dtype):
        self.datatype = self.DATATYPE[dtype]
        self.body = []
        self.depth = 0

    def line(self, text):
        self.body.append(" " * (self.INDENT + self.STEP * self.depth) + text)

    def trailing(self, why):
        return "  " + self.COMMENT.format(why) if why else ""

    def comment(self, text):
        self.line(self.COMMENT.format(text))

    def _open(self, text):
        self.line(text)
        self.depth += 1

    def _close(self, text):
        self.depth -= 1
        self.line(text)

    def _between(self, text):
        """An else: at the column of the if it continues."""
        self._close(text)
        self.depth += 1

    def if_(self, condition, why=""):
        self._open(self.IF.format(condition) + self.trailing(why))

    def else_if(self, condition):
        self._between(self.ELSE_IF.format(condition))

    def else_(self, why=""):
        self._between(self.ELSE + self.trailing(why))

    def end_if(self):
        self._close(self.END_IF)

    def steps(self):
        self._open(self.STEPS)

    def end_steps(self):
        self._close(self.END_STEPS)

    def call(self, function, *args):
        self.line(self.CALL.format(function, ", ".join(
            self.pointer(a) if isinstance(a, Ref) else str(a) for a in args)))

    def mpi(self, function, *args):
        self.call(function, *args)
