"""Fortran 2008 + OpenMP backend: one module per kernel variant, each function a
`bind(C)` subroutine over flat 0-based arrays, so the offsets gamma computed are the same
as in C and the f90wrap binding sees plain 1-D arrays."""
import math

from sympy.core.function import AppliedUndef
from sympy.printing.fortran import FCodePrinter

from moagen.targets.printer import Printer, dnf_comment, omp_schedule
from moagen.templates import render
from moagen.errors import ScheduleError, SpecError
from moagen.onf.loops import Loop, parallel_chain, walk
from moagen.steps.loop.simd import simd_clauses

KIND = {"float64": "c_double", "float32": "c_float"}
LINE = 100  # wrap statements longer than this (the standard allows 132 characters)


class IndexPrinter(FCodePrinter):
    def __init__(self):
        super().__init__({"source_format": "free", "standard": 2008})

    def _print_idiv(self, expr):
        a, b = (self._print(x) for x in expr.args)
        divisor = b if expr.args[1].is_Atom else f"({b})"
        return f"(({a}) / {divisor})"  # whole, so that s*idiv(..) stays s*(..)

    def _print_Function(self, expr):
        """An integer input's entry (moagen.moa.expr.element: cu_q(s)), the array's read:
        its arrays are declared from 0 as C's."""
        if isinstance(expr, AppliedUndef):
            return f"{expr.func.__name__}({self._print(expr.args[0])})"
        return super()._print_Function(expr)


# an integer or bool input's element type in Fortran (moagen.moa.expr.ELEMENTS): a bool as
# C's uint8_t, a byte compared with 0 (logical(c_bool) leaves bytes other than 0 and 1
# undefined)
FORTRAN_ELEMENT = {"int64": "integer(c_int64_t)", "bool": "integer(c_int8_t)"}


class FortranPrinter(Printer):
    indent = "  "
    index_printer = IndexPrinter()
    simd_directives = True
    atomic_directive = "!$omp atomic"

    def __init__(self, onf, dtype):
        super().__init__(onf, dtype)
        self.kind = KIND[dtype]
        self.uses_neg_inf = False
        _check_case_insensitive(onf, self)

    @property
    def real(self):
        return f"real({self.kind})"

    def subroutine(self):
        body = []
        for nest in self.onf.nests:
            body += [self.indent * 2 + "! " + line for line in self.nest_comment(nest)]
            body += self.nest_block(nest, 2)
        body = self.function_body(body)
        sig = self.sig
        arrays = []
        for a in sig.arrays:
            intent = {"in": "in", "inout": "inout"}.get(a.intent, "out")
            size = " * ".join(self.index(d) for d in a.shape)
            element = FORTRAN_ELEMENT[a.element] if a.element else self.real
            arrays.append(f"{element}, intent({intent}) :: {a.name}(0:{size} - 1)")
        stmts = [s for n in self.onf.nests for s in n.body]
        loop_vars = (self.loop_vars_in(stmts) + self.quotients_in(stmts)
                     + self.offsets_in(stmts))
        locals_ = self.locals_in(stmts)
        return {
            "name": sig.name,
            "args": [a.name for a in sig.arrays] + [s.name for s in sig.sizes] + list(sig.scalars),
            "sizes": ", ".join(s.name for s in sig.sizes),
            "scalars": ", ".join(sig.scalars),
            "real": self.real, "kind": self.kind,
            "arrays": arrays,
            "loop_vars": ", ".join(loop_vars),
            "locals": ", ".join(locals_),
            "neg_inf": self.uses_neg_inf,
            "keep": self.uses_keep,
            "body": body,
        }

    def function_body(self, lines):
        """The subroutine's statements (a target may wrap them in a data region)."""
        return lines

    def quotients_in(self, stmts):
        """The indices hoisted before the vectorized loops in stmts (Printer.hoisted)."""
        return [name for s in walk(stmts) for name in self.quotients.get(id(s), {}).values()]

    # ---- statements -------------------------------------------------------------------
    def loop(self, loop: Loop, depth):
        pad = self.indent * depth
        head = f"do {loop.var} = {self.index(loop.start)}, {self.index(loop.stop - 1)}"
        # a register tile's body is the vector code: gfortran must not re-vectorize the loop
        mark = [pad + "!GCC$ novector"] if loop.vector_tile else []
        if loop.simd and self.simd_directives:
            mark.append(f"{pad}!$omp simd{simd_clauses(loop)}")
        if not loop.parallel:
            return mark + [pad + head] + self.loop_body(loop, depth + 1) + [pad + "end do"]
        before, after = self.parallel_directives(loop)
        return ([pad + line for line in before] + [pad + head] + self.loop_body(loop, depth + 1)
                + [pad + "end do"] + [pad + line for line in after])

    def parallel_directives(self, loop):
        """The lines before a parallel loop chain's first loop, and after it."""
        private = self.private_names(loop)
        clause = f" private({', '.join(private)})" if private else ""
        return ([f"!$omp parallel do collapse({loop.parallel}) schedule({omp_schedule(loop)})"
                 f"{clause}"], ["!$omp end parallel do"])

    def private_names(self, loop):
        """What each iteration of a parallel chain assigns: its own copy in each thread."""
        inner = parallel_chain(loop)[-1]
        return (self.loop_vars_in(inner.body) + self.quotients_in(inner.body)
                + self.offsets_in((inner,)) + self.locals_in(inner.body))

    def let(self, name, value, mutable):
        return f"{name} = {value}"

    def index_let(self, name, value):
        return f"{name} = {value}"

    def update(self, name, op, value):
        if op == "=":
            return f"{name} = {value}"
        if op == "+":
            return f"{name} = {name} + {value}"
        return f"{name} = {self.call(op, name, value)}"

    def store(self, array, offset, value, accumulate, atomic):
        target = f"{array}({offset})"
        if accumulate is None:
            return [f"{target} = {value}"]
        if accumulate == "+":
            return ([self.atomic_directive] if atomic else []) + [f"{target} = {target} + {value}"]
        if atomic:
            raise ScheduleError(f"atomic {accumulate} updates are not supported")
        return [f"{target} = {self.call(accumulate, target, value)}"]

    # ---- expressions ------------------------------------------------------------------
    def load(self, array, offset):
        return f"{array}({offset})"

    def to_real(self, integer_text):
        return f"real({integer_text}, {self.kind})"

    def number(self, value):
        if math.isinf(value):
            if value > 0:
                raise SpecError("the Fortran backend has no +inf literal")
            self.uses_neg_inf = True
            return "neg_inf"
        return f"{value!r}_{self.kind}"

    def call(self, fn, *args):
        return f"{fn}({', '.join(args)})"

    def select(self, cond, then, other):
        # merge() evaluates both branches: psi-reduction keeps every branch's index in range
        return f"merge({then}, {other}, {cond})"

    def keep(self, row, group, piece, seed, p):
        # a number alone (an unrolled key's piece) is a default integer: give it the kind
        wide = [f"{x}_c_int64_t" if x.isdigit() else x for x in (row, group, piece)]
        return f"moagen_keep({', '.join(wide)}, {seed}, real({p}, c_double))"


def _check_case_insensitive(onf, printer):
    """Fortran ignores case: `K` (an array) and `k` (a loop) would be one name."""
    names = ([b.name for b in onf.inputs + onf.outputs + onf.temps] + [s.name for s in onf.sizes]
             + list(onf.scalars))
    stmts = [s for n in onf.nests for s in n.body]
    names += printer.loop_vars_in(stmts) + printer.locals_in(stmts)
    seen = {}
    for name in names:
        other = seen.setdefault(name.lower(), name)
        if other != name:
            raise SpecError(f"{onf.name}: names {other} and {name} are the same name in Fortran, "
                            f"which ignores case; rename one in the spec")


def wrap_statement(line):
    """Split a long statement or OpenMP / OpenACC directive with `&` continuations at
    spaces, every continuation indented as the first line plus four; a long directive's
    private list (its last clause) a name a line, which a reader can scan."""
    stripped = line.lstrip()
    sentinel = stripped[:5] if stripped[:5] in ("!$omp", "!$acc") else None
    if len(line) <= LINE or (stripped.startswith("!") and not sentinel):
        return [line]
    indent = " " * (len(line) - len(stripped))
    prefix = indent + (f"{sentinel}& " if sentinel else "    & ")
    head, private, names = line.partition(" private(")
    if sentinel and private and names.endswith(")"):
        names = names[:-1].split(", ")
        return (wrap_statement(f"{head} private( &") + [f"{prefix}  {name}, &" for name in names[:-1]]
                + [f"{prefix}  {names[-1]})"])
    lines = []
    while len(line) > LINE:
        cut = line.rfind(" ", len(prefix) + 1, LINE - 2)
        if cut < 0:
            break  # one word longer than a line: left long (free form allows 132)
        lines.append(line[:cut] + " &")
        line = prefix + line[cut + 1:]
    return lines + [line]


def emit_fortran(onfs_by_dtype, banner, module, printer=FortranPrinter):
    subs = [printer(onf, dtype).subroutine() for dtype, onf in onfs_by_dtype]
    keep = any(s["keep"] for s in subs)  # the module then holds moagen_keep (its p a double)
    masks = any(b.element == "bool" for _, onf in onfs_by_dtype for b in onf.inputs)
    kinds = sorted({s["kind"] for s in subs} | ({"c_double"} if keep else set())
                   | ({"c_int8_t"} if masks else set()))
    dnf = dnf_comment([onf for _, onf in onfs_by_dtype])
    text = render("fortran/module.f90.j2", banner=banner, dnf=dnf, module=module, subroutines=subs,
                  kinds=kinds, neg_inf=any(s["neg_inf"] for s in subs), keep=keep)
    return "".join(w + "\n" for line in text.splitlines() for w in wrap_statement(line))
