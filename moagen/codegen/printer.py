"""What every backend shares: walking an ONF's statements and printing expressions with the
right precedence. A backend implements the hooks (loop, parallel loop, let, update, store,
literals, function names) and a Jinja2 template holds its file skeleton."""
from functools import lru_cache
from pathlib import Path

import jinja2
import sympy

from moagen.moa import scalar as S
from moagen.moa.dnf import PRECEDENCE
from moagen.moa.expr import idiv
from moagen.onf.loops import Let, Loop, ONF, Store, Update, parallel_chain, stmt_exprs, walk
from moagen.onf.schedule import kernel_names
from moagen.onf.signature import DTYPE_SUFFIX, ArrayParam, Signature

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
_env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                          trim_blocks=True, lstrip_blocks=True)


def omp_schedule(loop) -> str:
    """A parallel loop's OpenMP schedule (C and Fortran): a block of iterations per thread,
    or the iterations dealt to the threads one at a time."""
    return "static, 1" if loop.interleave else "static"


def render(template: str, **context) -> str:
    return _env.get_template(template).render(**context)


def signature(onf: ONF, dtype: str) -> Signature:
    """The ABI of one ONF at one dtype: inputs, outputs, scratch; sizes; scalars."""
    arrays = ([ArrayParam(b.name, b.shape, "inout" if b.name in onf.inout else "in")
               for b in onf.inputs]
              + [ArrayParam(b.name, b.shape, "out") for b in onf.outputs]
              + [ArrayParam(b.name, b.shape, "scratch") for b in onf.temps])
    return Signature(f"{onf.name}_{onf.variant}_{DTYPE_SUFFIX[dtype]}", tuple(arrays),
                     onf.sizes, onf.scalars, dtype, onf.layout)


def updated_names(stmts) -> set:
    return {s.name for s in walk(stmts) if isinstance(s, Update)}


class Printer:
    """Prints one ONF at one dtype. Subclasses set `index_printer` (a sympy code printer)
    and implement the hooks below."""
    indent = "    "
    index_printer: sympy.printing.codeprinter.CodePrinter

    def __init__(self, onf: ONF, dtype: str):
        if not onf.flat:
            raise ValueError("printers need an ONF after the layout step")
        self.onf = onf
        self.dtype = dtype
        self.sig = signature(onf, dtype)
        self.updated = {n for nest in onf.nests for n in updated_names(nest.body)}
        self.quotients = _invariant_quotients(onf)
        self.hoisted_names = {}  # quotient -> its index, inside the loops it was hoisted from

    # ---- statements -------------------------------------------------------------------
    def block(self, stmts, depth):
        lines = []
        for s in stmts:
            pad = self.indent * depth
            if isinstance(s, Loop) and id(s) in self.quotients:
                lines += self.hoisted(s, depth)
            elif isinstance(s, Loop):
                lines += self.loop(s, depth)
            elif isinstance(s, Let):
                lines.append(pad + self.let(s.name, self.expr(s.value), s.name in self.updated))
            elif isinstance(s, Update):
                lines.append(pad + self.update(s.name, s.op, self.expr(s.value)))
            elif isinstance(s, Store):
                lines += [pad + line for line in self.store(
                    s.array, self.index(s.index[0]), self.expr(s.value), s.accumulate, s.atomic)]
        return lines

    def hoisted(self, loop: Loop, depth) -> list:
        """A loop after the integer divisions in the vectorized loops inside it that its
        iterations do not change, each computed once into an index of its own, which the
        loop's index expressions then print instead."""
        quotients = self.quotients[id(loop)]
        pad = self.indent * depth
        lines = [pad + self.index_let(name, self.index(q)) for q, name in quotients.items()]
        outer = self.hoisted_names
        self.hoisted_names = {**outer, **{q: sympy.Symbol(name, integer=True)
                                          for q, name in quotients.items()}}
        lines += self.loop(loop, depth)
        self.hoisted_names = outer
        return lines

    def loop(self, loop: Loop, depth) -> list:
        raise NotImplementedError

    def index_let(self, name, value) -> str:
        raise NotImplementedError

    def let(self, name, value, mutable) -> str:
        raise NotImplementedError

    def update(self, name, op, value) -> str:
        raise NotImplementedError

    def store(self, array, offset, value, accumulate, atomic) -> list:
        """The lines of one store (an atomic update may take a directive line)."""
        raise NotImplementedError

    # ---- expressions ------------------------------------------------------------------
    def index(self, e) -> str:
        e = sympy.sympify(e)
        if self.hoisted_names:
            e = e.xreplace(self.hoisted_names)
        return _print_index(self.index_printer, e)

    def expr(self, e) -> str:
        if isinstance(e, S.Load):
            return self.load(e.array, self.index(e.offset))
        if isinstance(e, S.Num):
            return self.number(e.value)
        if isinstance(e, S.Dim):
            return self.to_real(self.index(e.value))
        if isinstance(e, (S.Param, S.Local)):
            return e.name
        if isinstance(e, S.Bin):
            if e.op in PRECEDENCE:
                return f"{self._operand(e.left, e.op, False)} {e.op} {self._operand(e.right, e.op, True)}"
            return self.call(e.op, self.expr(e.left), self.expr(e.right))
        if isinstance(e, S.Un):
            return self.unary(e.fn, self.expr(e.arg), e.arg)
        if isinstance(e, S.Select):
            return self.select(self.index(e.cond), self.expr(e.then), self.expr(e.other))
        if isinstance(e, S.IfGreater):
            return self.select(f"{self.expr(e.left)} > {self.expr(e.right)}", self.expr(e.then),
                               self.expr(e.other))
        raise TypeError(f"{type(self).__name__} cannot print {e!r}: lower reductions and "
                        f"apply the layout first")

    def _operand(self, child, op, right_side):
        text = self.expr(child)
        if isinstance(child, S.Bin) and child.op in PRECEDENCE:
            mine, theirs = PRECEDENCE[op], PRECEDENCE[child.op]
            if theirs < mine or (right_side and theirs == mine and op in "-/"):
                return f"({text})"
        if isinstance(child, S.Num) and child.value < 0:
            return f"({text})"
        return text

    def unary(self, fn, arg, node) -> str:
        one = self.number(1.0)
        wrapped = arg if isinstance(node, (S.Load, S.Local, S.Param, S.Dim, S.Un)) else f"({arg})"
        if fn == "neg":
            return f"-{wrapped}"
        if fn == "rsqrt":
            return f"{one} / {self.call('sqrt', arg)}"
        if fn == "silu":
            return f"{wrapped} / ({one} + {self.call('exp', '-' + wrapped)})"
        return self.call(fn, arg)

    def load(self, array, offset) -> str:
        raise NotImplementedError

    def to_real(self, integer_text) -> str:
        raise NotImplementedError

    def number(self, value) -> str:
        raise NotImplementedError

    def call(self, fn, *args) -> str:
        raise NotImplementedError

    def select(self, cond, then, other) -> str:
        raise NotImplementedError

    # ---- shared helpers -----------------------------------------------------------------
    def nest_comment(self, nest):
        return [f"{nest.label}: from the DNF"] + nest.origin.splitlines()

    def locals_in(self, stmts):
        """The locals a block declares, in order of first appearance."""
        return list(dict.fromkeys(s.name for s in walk(stmts) if isinstance(s, Let)))

    def loop_vars_in(self, stmts):
        return list(dict.fromkeys(s.var.name for s in walk(stmts) if isinstance(s, Loop)))


def _invariant_quotients(onf: ONF) -> dict:
    """id(loop) -> {quotient: name}: the integer divisions in the offsets of simd loops,
    each to be computed before the outermost loop around it whose iterations do not change
    it (a collapsed parallel chain counts as one loop). Compilers keep such a division
    inside the loop (it could trap when the loop runs no iteration) and cannot vectorize
    64-bit division: the loop would stay scalar, and pay a division per element."""
    names = kernel_names(onf)
    out, collapsed = {}, set()  # collapsed: loops of a parallel chain after its first

    def visit(stmts, path):
        for loop in stmts:
            if not isinstance(loop, Loop):
                continue
            if loop.parallel > 1:
                collapsed.update(id(lp) for lp in parallel_chain(loop)[1:])
            if not loop.simd:
                visit(loop.body, path + [loop])
                continue
            for q in _outer_quotients(loop):
                place = loop
                for outer in reversed(path):
                    if outer.var in q.free_symbols:
                        break
                    if id(outer) not in collapsed:
                        place = outer
                out.setdefault(id(place), {})
                if q not in out[id(place)]:
                    out[id(place)][q] = names.claim(names.new("quot"))

    for nest in onf.nests:
        visit(nest.body, [])
    return out


def _outer_quotients(loop):
    offsets = [st.index[0] for st in walk(loop.body) if isinstance(st, Store)]
    offsets += [e.offset for st in walk(loop.body) for x in stmt_exprs(st)
                for e in S.subexpressions(x) if isinstance(e, S.Load)]
    found = [q for off in offsets for q in sympy.sympify(off).atoms(idiv)  # by a size:
             if loop.var not in q.free_symbols and not q.args[1].is_Number]  # by 8 vectorizes
    return list(dict.fromkeys(q for q in found  # a division inside another goes with it
                              if not any(q != other and other.has(q) for other in found)))


@lru_cache(maxsize=None)
def _print_index(printer, e) -> str:
    """sympy's printers are slow; a register tile prints the same offsets many times."""
    return printer.doprint(e)
