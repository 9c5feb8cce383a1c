"""C99 + OpenMP backend."""
import math

from sympy.core.function import AppliedUndef
from sympy.printing.c import C99CodePrinter

from moagen.targets.printer import EXP_FLOOR, Printer, dnf_comment, omp_schedule
from moagen.templates import render
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Loop, stmt_exprs, walk
from moagen.steps.loop.simd import simd_clauses

# each element type's C type (moagen.moa.expr.ELEMENTS): a bool as uint8_t, the byte numpy
# and torch store, any nonzero byte true (a _Bool other than 0 or 1 would be undefined)
C_TYPE = {"float64": "double", "float32": "float", "int64": "int64_t", "bool": "uint8_t"}


class IndexPrinter(C99CodePrinter):
    """sympy's C printer, with integer min and integer division for index arithmetic."""

    def _print_Min(self, expr):
        return self._fold(expr.args, "<")

    def _print_Max(self, expr):
        return self._fold(expr.args, ">")

    def _fold(self, args, op):
        """min or max of several, as nested comparisons of two."""
        if len(args) == 1:
            return self._print(args[0])
        a, b = self._fold(args[:-1], op), self._print(args[-1])
        return f"({a} {op} {b} ? {a} : {b})"

    def _print_idiv(self, expr):
        a, b = (self._print(x) for x in expr.args)
        divisor = b if expr.args[1].is_Atom else f"({b})"
        return f"(({a}) / {divisor})"  # whole, so that s*idiv(..) stays s*(..)

    def _print_Function(self, expr):
        """An integer input's entry (moagen.moa.expr.element: cu_q(s)) read as cu_q[s]."""
        if isinstance(expr, AppliedUndef):
            return f"{expr.func.__name__}[{self._print(expr.args[0])}]"
        return super()._print_Function(expr)


# (an unsigned integer as wide as the float type, -inf's bits): a mask's bias (CPrinter.kept)
KEPT_BITS = {"double": ("uint64_t", "0xFFF0000000000000u"), "float": ("uint32_t", "0xFF800000u")}


class CPrinter(Printer):
    index_printer = IndexPrinter()
    restrict = "restrict"
    simd_directives = True
    helper_directive = ""  # a line before each inline helper (where a device calls them)

    def __init__(self, onf, dtype):
        super().__init__(onf, dtype)
        self.helpers_used = set()  # (real type, "max" / "min" / "exp_flushed") printed

    @property
    def real(self):
        return C_TYPE[self.dtype]

    # ---- the function -------------------------------------------------------------------
    def params(self):
        out = []
        for a in self.sig.arrays:
            const = "const " if a.intent == "in" else ""
            out.append(f"{const}{C_TYPE[a.dtype(self.dtype)]} *{self.restrict} {a.name}")
        out += [f"int64_t {s}" for s in self.sig.sizes]
        out += [f"{self.real} {s}" for s in self.sig.scalars]
        return out

    def functions(self):
        """The kernel's function (a list: the template prints each function it is given)."""
        body = []
        for nest in self.onf.nests:
            body += [self.indent + line for line in self.comment(self.nest_comment(nest))]
            body += self.nest_block(nest, 1)
        if (self.real, "exp_flushed") in self.helpers_used:
            body = [f"{self.indent}const {self.real} {EXP_FLOOR_LOCAL} = moagen_exp_floor_{self.real};"
                    f"  /* exp_flushed's floor, a register */", *body]
        return [{"name": self.sig.name, "params": self.params(),
                 "body": self.function_body(body)}]

    def function_body(self, lines):
        """The kernel function's statements (a target may wrap them in a data region)."""
        return lines

    def comment(self, lines):
        return ["/* " + lines[0]] + [" * " + line for line in lines[1:]] + [" */"]

    # ---- statements -------------------------------------------------------------------
    def loop(self, loop: Loop, depth):
        pad = self.indent * depth
        v = loop.var
        head = (f"for (int64_t {v} = {self.index(loop.start)}; {v} < {self.index(loop.stop)}; "
                f"++{v}) {{")
        pragma = [pad + line for line in self.parallel_directives(loop)] if loop.parallel else []
        if loop.simd and self.simd_directives:
            pragma.append(f"{pad}#pragma omp simd{simd_clauses(loop)}")
        if loop.vector_tile and self.simd_directives:
            # a register tile is vector code across its statements (the compiler's SLP
            # vectorizer packs its lanes): vectorized along the loop, every accumulator would
            # become a vector of partial sums, added up across lanes at the end. OpenMP's
            # `if(simd: 0)` runs the iterations one at a time (gcc 12 has no per-loop
            # `novector`); the statements inside are still vectorized
            pragma.append(f"{pad}#pragma omp simd if(simd: 0)")
        return pragma + [pad + head] + self.loop_body(loop, depth + 1) + [pad + "}"]

    def parallel_directives(self, loop):
        """The lines before a parallel loop chain's first loop."""
        return [f"#pragma omp parallel for collapse({loop.parallel}) schedule({omp_schedule(loop)})"]

    def let(self, name, value, mutable):
        return f"{'' if mutable else 'const '}{self.real} {name} = {value};"

    def index_let(self, name, value):
        return f"const int64_t {name} = {value};"

    def update(self, name, op, value):
        if op == "=":
            return f"{name} = {value};"
        if op == "+":
            return f"{name} += {value};"
        return f"{name} = {self.call(op, name, value)};"

    def store(self, array, offset, value, accumulate, atomic):
        target = f"{array}[{offset}]"
        if accumulate is None:
            return [f"{target} = {value};"]
        if accumulate == "+":
            return self.atomic_add(target, value) if atomic else [f"{target} += {value};"]
        if atomic:
            raise ScheduleError(f"atomic {accumulate} updates are not supported")
        return [f"{target} = {self.call(accumulate, target, value)};"]

    def atomic_add(self, target, value):
        return ["#pragma omp atomic", f"{target} += {value};"]

    # ---- expressions ------------------------------------------------------------------
    def load(self, array, offset):
        return f"{array}[{offset}]"

    def to_real(self, integer_text):
        return f"({self.real}){integer_text}" if integer_text.isidentifier() else \
            f"({self.real})({integer_text})"

    def number(self, value):
        return c_number(value, self.dtype)

    def call(self, fn, *args):
        if fn in ("max", "min"):
            return self.max_or_min(fn, *args)
        name = fn + "f" if self.dtype == "float32" else fn
        return f"{name}({', '.join(args)})"

    def max_or_min(self, fn, a, b):
        """max and min through the file's own inline helpers (INLINE_MAX), not fmax/fmin:
        those are library calls on x86 unless NaNs are ruled out (-ffinite-math-only, which
        would rule out the -INFINITY a running max starts from too), so a max reduction
        would not vectorize. They differ from fmax/fmin only where an argument is NaN."""
        helper = f"{fn}_{self.real}"
        self.helpers_used.add((self.real, fn))
        return f"{helper}({a}, {b})"

    def flushed_exp(self, arg, wrapped):
        """Through the file's inline helper (FLUSHED_EXP)."""
        self.helpers_used.add((self.real, "exp_flushed"))
        return f"exp_flushed_{self.real}({arg}, {EXP_FLOOR_LOCAL})"

    def kept(self, value, flag):
        """value plus a bias made from the byte without a branch: the bits (1 - flag) times
        -inf's, +0 where it is 1, -inf where 0. A conditional, which gcc 12 leaves a branch
        an element in a register tile's unrolled statements, was 4.3x the float mask's
        time (float32, one thread); this one is vectorized as the float mask's addition."""
        bits, ones = KEPT_BITS[self.real]
        return (f"{value} + ((union {{ {bits} bits; {self.real} value; }}){{({bits})(1 - {flag}) * "
                f"{ones}}}).value")

    def select(self, cond, then, other):
        return f"({cond} ? {then} : {other})"

    def keep(self, row, group, piece, seed, p):
        return f"moagen_keep({row}, {group}, {piece}, {seed}, {p})"


def emit_c(onfs_by_dtype, banner, printer=CPrinter):
    printers = [printer(onf, dtype) for dtype, onf in onfs_by_dtype]
    functions = [f for p in printers for f in p.functions()]
    vector_exp = [VECTOR_EXP[dtype] for dtype, onf in onfs_by_dtype if _calls_exp(onf)]
    helpers = sorted({h for p in printers for h in p.helpers_used})
    dnf = dnf_comment([onf for _, onf in onfs_by_dtype])
    return render("c/kernel.c.j2", banner=banner, dnf=printers[0].comment(dnf),
                  functions=functions, vector_exp=vector_exp,
                  helper_directive=printer.helper_directive,
                  keep=any(p.uses_keep for p in printers), qualifier="static inline ",
                  max_helpers=[INLINE_MAX.format(real=real, fn=fn, op=">" if fn == "max" else "<")
                               for real, fn in helpers if fn in ("max", "min")],
                  flushed_exp=[_flushed_exp(p.dtype) for p in printers
                               if (p.real, "exp_flushed") in p.helpers_used])


INLINE_MAX = "static inline {real} {fn}_{real}({real} a, {real} b) {{ return a {op} b ? a : b; }}"


# exp_flushed's helper (Printer.flushed_exp). Its floor is a global's value, which the kernel
# reads once into a local (EXP_FLOOR_LOCAL), not a constant: gcc takes a constant floor out
# of the exponential (exp of the unclamped argument, then a select of exp(floor)); read in
# the loop, a global might be what the loop's stores change, and the loop is not vectorized
FLUSHED_EXP = """__attribute__((visibility("hidden"))) {real} moagen_exp_floor_{real} = {floor};
static inline {real} exp_flushed_{real}({real} x, {real} floor)
{{
    const {real} e = {exp}(x < floor ? floor : x);
    return x < {below} ? {zero} : e;
}}"""
EXP_FLOOR_LOCAL = "moagen_exp_floor"


def _flushed_exp(dtype):
    return FLUSHED_EXP.format(real=C_TYPE[dtype], exp="exp" if dtype == "float64" else "expf",
                              floor=c_number(EXP_FLOOR[dtype], dtype),
                              below=c_number(S.FLUSHED_BELOW[dtype], dtype),
                              zero=c_number(0.0, dtype))


def c_number(value, dtype) -> str:
    """A number as a C literal of the dtype."""
    if math.isinf(value):
        return "-INFINITY" if value < 0 else "INFINITY"
    return f"{value!r}{'f' if dtype == 'float32' else ''}"


# glibc's math.h declares its vector versions (libmvec) only under -ffast-math
VECTOR_EXP = {"float64": "double exp(double)", "float32": "float expf(float)"}


def _calls_exp(onf):
    return any(isinstance(x, S.Un) and x.fn in ("exp", "exp_flushed", "sigmoid")
               for n in onf.nests for s in walk(n.body) for e in stmt_exprs(s)
               for x in S.subexpressions(e))
