"""What every backend shares: walking an ONF's statements and printing expressions with the
right precedence. A backend implements the hooks (loop, parallel loop, let, update, store,
literals, function names) and a Jinja2 template holds its file skeleton."""
from functools import lru_cache

import sympy

from moagen.moa import scalar as S
from moagen.moa.dnf import PRECEDENCE
from moagen.moa.expr import elements_read, idiv
from moagen.onf.loops import Let, Loop, ONF, Store, Update, parallel_chain, stmt_exprs, walk
from moagen.onf.names import Names, kernel_names
from moagen.onf.signature import signature

def omp_schedule(loop) -> str:
    """A parallel loop's OpenMP schedule (C and Fortran): a block of iterations per thread,
    or the iterations dealt to the threads one at a time."""
    return "static, 1" if loop.interleave else "static"


def updated_names(stmts) -> set:
    return {s.name for s in walk(stmts) if isinstance(s, Update)}


# the least argument of exp_flushed's exponential: within glibc's vector exp's fast path
# (its special cases start below about -708.4 in float64, -87.3 in float32), and below
# FLUSHED_BELOW, so that every value the select keeps is the exponential of the argument
EXP_FLOOR = {"float64": -708.0, "float32": -87.0}


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
        self.row_offsets = _row_offsets(onf, self.quotients)
        self.row_scope = []  # the row offsets of the loops being printed, outermost first
        self.loop_vars = {lp.var for n in onf.nests for lp in walk(n.body) if isinstance(lp, Loop)}
        self.uses_keep = False  # whether a statement calls dropout's moagen_keep
        self.masks = {a.name for a in self.sig.arrays if a.element == "bool"}

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
                    s.array, self.offset(s.array, s.index[0]), self.expr(s.value),
                    s.accumulate, s.atomic)]
        return lines

    def loop_body(self, loop: Loop, depth) -> list:
        """A loop's body: first the row offsets its iterations change (_row_offsets), which
        the accesses inside it then print as `O[O_row + c]`."""
        pad = self.indent * depth
        offsets = self.row_offsets.get(id(loop), [])
        lines = [pad + self.index_let(r.name, self.index(r.base)) for r in offsets]
        self.row_scope.append(offsets)
        lines += self.block(loop.body, depth)
        self.row_scope.pop()
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

    def nest_block(self, nest, depth) -> list:
        """A nest's statements (a target may put a nest that runs no parallel loop in a
        region of its own)."""
        return self.block(nest.body, depth)

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

    def offset(self, array, e) -> str:
        """An access's offset: a row offset of the array in scope plus what the loops inside
        add to it (`O_row + c`, `probs_row1 + 4*j_tile + 1`), or the whole expression."""
        best = None
        for r in (r for level in self.row_scope for r in level if r.array == array):
            rest, key = _rest(sympy.sympify(e), r.expanded)
            if not rest.free_symbols <= self.loop_vars:
                continue
            if best is None or key < best[0]:
                best = key, r.name, rest
        if best is None:
            return self.index(e)
        _, name, rest = best
        return name if rest == 0 else f"{name} + {self.index(rest)}".replace("+ -", "- ")

    def expr(self, e) -> str:
        if isinstance(e, S.Load):
            return self.load(e.array, self.offset(e.array, e.offset))
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
        mask = S.kept_by(e)
        if mask is not None and mask.array in self.masks:
            return self.kept(self.expr(e.then), self.expr(mask))
        if isinstance(e, S.IfGreater):
            return self.select(f"{self.expr(e.left)} > {self.expr(e.right)}", self.expr(e.then),
                               self.expr(e.other))
        if isinstance(e, S.Dropout):
            self.uses_keep = True  # the file then defines moagen_keep (templates/c/keep.c.j2)
            p, one = self.expr(e.p), self.number(1.0)
            group, piece = e.draw()
            return self.select(self.keep(self.index(e.row), self.index(group),
                                         self.index(piece), self.index(e.seed), p),
                               f"{one} / ({one} - {p})", self.number(0.0))
        raise TypeError(f"{type(self).__name__} cannot print {e!r}: lower reductions and "
                        f"apply the layout first")

    def _operand(self, child, op, right_side):
        text = self.expr(child)
        infix = (child.op if isinstance(child, S.Bin) else
                 "/" if isinstance(child, S.Un) and child.fn in self.QUOTIENTS else None)
        if infix in PRECEDENCE:
            mine, theirs = PRECEDENCE[op], PRECEDENCE[infix]
            if theirs < mine or (right_side and theirs == mine and op in "-/"):
                return f"({text})"
        if isinstance(child, S.Num) and child.value < 0:
            return f"({text})"
        return text

    # the functions `unary` prints as a quotient, 1 / (their denominator of the printer, the
    # argument's text and that text wrapped as an operand): an operand then as a "/" is
    QUOTIENTS = {"rsqrt": lambda p, arg, wrapped: p.call("sqrt", arg),
                 "sigmoid": lambda p, arg, wrapped:
                     f"({p.number(1.0)} + {p.call('exp', '-' + wrapped)})"}

    def unary(self, fn, arg, node) -> str:
        wrapped = arg if isinstance(node, (S.Load, S.Local, S.Param, S.Dim, S.Un)) else f"({arg})"
        if fn == "neg":
            return f"-{wrapped}"
        if fn in self.QUOTIENTS:
            return f"{self.number(1.0)} / {self.QUOTIENTS[fn](self, arg, wrapped)}"
        if fn == "exp_flushed":
            return self.flushed_exp(arg, wrapped)
        return self.call(fn, arg)

    def flushed_exp(self, arg, wrapped) -> str:
        """exp_flushed (moagen.steps.loop.flush_exp): 0 below FLUSHED_BELOW, else the
        exponential of the argument clamped at EXP_FLOOR, which a vector exp computes on its
        fast path (a select picks one of the two; max is an instruction, as gfortran's MAX)."""
        below = f"{wrapped} < {self.number(S.FLUSHED_BELOW[self.dtype])}"
        clamped = self.call("max", arg, self.number(EXP_FLOOR[self.dtype]))
        return self.select(below, self.number(0.0), self.call("exp", clamped))

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

    def keep(self, row, group, piece, seed, p) -> str:
        """Whether dropout keeps an element, a condition (a call of moagen_keep)."""
        raise NotImplementedError

    def kept(self, value, flag) -> str:
        """value where the mask's byte flag is nonzero, else -inf."""
        return self.select(f"{flag} > 0", value, self.number(float("-inf")))

    # ---- shared helpers -----------------------------------------------------------------
    def nest_comment(self, nest):
        """What a reader needs above a nest: its label, the arrays it writes and reads, and
        its loops level by level (the kernel's DNF is printed once, at the top of the file)."""
        return nest_summary(nest, {b.name for b in self.onf.temps})

    def offsets_in(self, stmts):
        """The row offsets assigned in stmts (loops whose bodies start with them)."""
        return list(dict.fromkeys(r.name for s in walk(stmts)
                                  for r in self.row_offsets.get(id(s), [])))

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


class RowOffset:
    """`name = base`, printed at the top of a loop's body: an array's offset that the loops
    inside it add their indices to."""
    def __init__(self, name, array, base):
        self.name, self.array, self.base = name, array, base
        self.expanded = _expanded(base)


def _row_offsets(onf: ONF, quotients) -> dict:
    """id(loop) -> [RowOffset]: the offsets of the form `base + v`, v the index of the loop
    around the access, with base not changed by that loop, that are long or shared (several
    accesses, or unrolled rows, repeat them), each named once (`O_row`, `O_row0`, ...)
    at the top of the body of the innermost loop that changes it: of the loops whose
    indices base reads, and of those before which a quotient it holds is computed
    (_invariant_quotients). A collapsed parallel chain counts as its last loop; a simd loop
    takes none (its body stays the plain statements the vectorizer sees). The names avoid
    every name of the kernel, as Fortran sees them (without case)."""
    taken = kernel_names(onf).reserved | {n for q in quotients.values() for n in q.values()}
    names = Names(taken)
    out = {}
    for nest in onf.nests:
        found = {}  # (array, expanded base) -> [base, uses, {id(home): home}]

        collapsed = {}  # id(loop of a parallel chain) -> the chain's last loop

        def visit(stmts, path, defined):
            for st in stmts:
                if isinstance(st, Loop):
                    if st.parallel > 1:
                        chain = parallel_chain(st)
                        collapsed.update((id(lp), chain[-1]) for lp in chain)
                    home = collapsed.get(id(st), st)
                    at = {**defined, st.var: (len(path), home)}
                    for q in quotients.get(id(st), {}):
                        at[q] = (len(path), home)  # computed before st, used inside it
                    visit(st.body, path + [st], at)
                    continue
                if not path:
                    continue
                v = path[-1].var
                for array, off in _accesses(st):
                    base = sympy.sympify(off) - v
                    if v in base.free_symbols or base.is_Number:
                        continue
                    deps = [defined[x] for x in base.free_symbols if x in defined]
                    deps += [defined[q] for q in base.atoms(idiv) if q in defined]
                    if not deps:
                        continue
                    home = max(deps, key=lambda d: d[0])[1]
                    if home.simd:
                        continue
                    at = next(k for k, lp in enumerate(path) if lp is home)
                    entry = found.setdefault((array, _expanded(base)), [base, 0, {}, set(), True])
                    entry[1] += 1
                    entry[2][id(home)] = home
                    entry[3].add((id(home), id(path[at + 1]) if at + 1 < len(path) else None))
                    entry[4] &= len(path) - at <= 2

        visit(nest.body, [], {})
        # the rows of one array that one loop changes (a tile's rows) are numbered
        groups = {}
        for (array, _), (base, uses, homes, users, direct) in found.items():
            # one loop inside the home uses it, directly: gcc computes an offset that outer
            # loops do not change where they change it, and one named higher up stays live
            # (in a register or spilled) across the loops between, which costs more
            # (docs/PERFORMANCE.md, "The printer's choices")
            if not direct or len(users) != len(homes):
                continue
            if sympy.count_ops(base) >= 4 or (uses >= 2 and sympy.count_ops(base) >= 2):
                where = tuple(sorted({str(h.var) for h in homes.values()}))
                groups.setdefault((array, where), []).append((base, homes))
        in_nest = set()
        for (array, where), rows in groups.items():
            for k, (base, homes) in enumerate(rows):
                hint = f"{array}_row" if len(rows) == 1 else f"{array}_row{k}"
                if hint in in_nest:  # another loop's row of the same array
                    hint = f"{array}_row_{'_'.join(where)}"
                name = names.new(hint, _Caseless(taken | in_nest))
                in_nest.add(name)
                for home_id in homes:
                    out.setdefault(home_id, []).append(RowOffset(name, array, base))
    return out


class _Caseless:
    """Membership without case (Fortran's view of names)."""
    def __init__(self, names):
        self.lowered = {n.lower() for n in names}

    def __contains__(self, name):
        return name.lower() in self.lowered


def arrays_in(stmts) -> list:
    """The arrays the statements read or write, in order of first access."""
    return list(dict.fromkeys(a for s in walk(stmts) if not isinstance(s, Loop)
                              for a, _ in _accesses(s)))


def names_used(stmts) -> set:
    """The arrays, index and size symbols and scalar parameters the statements use: what a
    CUDA nest's kernel takes of the launcher's arguments, what a tiled kernel's statement
    reads of a thread's coordinates."""
    names = set(arrays_in(stmts))
    for s in walk(stmts):
        bounds = (s.start, s.stop) if isinstance(s, Loop) else getattr(s, "index", ())
        names |= {x.name for e in bounds for x in sympy.sympify(e).free_symbols}
        indices = list(bounds)
        for x in stmt_exprs(s):
            names |= S.free_names(x) | {e.name for e in S.subexpressions(x)
                                        if isinstance(e, S.Param)}
            indices += [i for e in S.subexpressions(x) for i in S.index_exprs(e)]
        # the integer arrays (offsets) the index expressions read
        names |= {a for e in indices for a in elements_read(e)}
    return names


def _accesses(st):
    """(array, offset) of every element a statement reads or writes."""
    out = [(st.array, st.index[0])] if isinstance(st, Store) else []
    return out + [(e.array, e.offset) for x in stmt_exprs(st) for e in S.subexpressions(x)
                  if isinstance(e, S.Load)]


@lru_cache(maxsize=None)
def _expanded(e):
    return sympy.expand(e)


@lru_cache(maxsize=None)
def _rest(e, base):
    """What an offset adds to a row offset's expanded base, and how long it is to print
    (operations, characters): every access weighs each row offset in scope, and a register
    tile repeats the same accesses many times."""
    rest = _expanded(e) - base
    return rest, (sympy.count_ops(rest), len(str(rest)))


def nest_summary(nest, scratch) -> list:
    """Two lines or so for a nest: `rows: writes O, lse; reads Q, K, V; scratch probs` and
    its loops by depth, `for b, h, i_tile (parallel, interleaved) / j_blk / j, c (simd)`."""
    stores = [s for s in walk(nest.body) if isinstance(s, Store)]
    written = list(dict.fromkeys(s.array for s in stores if not s.atomic and s.array not in scratch))
    atomic = list(dict.fromkeys(s.array for s in stores if s.atomic))
    used = list(dict.fromkeys(s.array for s in stores if s.array in scratch))
    read = list(dict.fromkeys(a for s in walk(nest.body) if not isinstance(s, Loop)
                              for a, _ in _accesses(s)))
    used += [a for a in read if a in scratch and a not in used]
    read = [a for a in read if a not in scratch and a not in written and a not in atomic]
    parts = [f"writes {', '.join(written)}"] if written else []
    parts += [f"adds atomically to {', '.join(atomic)}"] if atomic else []
    parts += [f"reads {', '.join(read)}"] if read else []
    parts += [f"scratch {', '.join(used)}"] if used else []
    lines = [f"{nest.label}: {'; '.join(parts)}"]
    levels = []
    for lp, depth in _loops_by_depth(nest.body, 0):
        while len(levels) <= depth:
            levels.append([])
        levels[depth].append(lp)
    groups = []
    skip = 0
    for depth, loops in enumerate(levels):
        if skip:
            skip -= 1
            continue
        if len(loops) == 1 and loops[0].parallel:
            chain = parallel_chain(loops[0])
            mark = "parallel, interleaved" if loops[0].interleave else "parallel"
            groups.append(f"{', '.join(str(lp.var) for lp in chain)} ({mark})")
            skip = len(chain) - 1
            continue
        groups.append(", ".join(dict.fromkeys(_loop_text(lp) for lp in loops)))
    if groups:
        lines += _wrap_words("for " + " / ".join(groups), 88)
    return lines


def _loops_by_depth(stmts, depth):
    for s in stmts:
        if isinstance(s, Loop):
            yield s, depth
            yield from _loops_by_depth(s.body, depth + 1)


def _loop_text(lp):
    marks = (["parallel"] if lp.parallel else []) + (["simd"] if lp.simd else []) + \
        (["register tile"] if lp.vector_tile else [])
    return f"{lp.var} ({', '.join(marks)})" if marks else str(lp.var)


def _wrap_words(text, width):
    lines = [""]
    for word in text.split(" "):
        if lines[-1] and len(lines[-1]) + 1 + len(word) > width:
            lines.append("    " + word)
        else:
            lines[-1] = f"{lines[-1]} {word}" if lines[-1] else word
    return lines


def dnf_comment(onfs) -> list:
    """The kernel's definitions as psi-reduction gave them (its DNF), each once: the nests
    below realize them, and each nest's own comment names what it writes."""
    definitions = []
    for onf in onfs:
        for nest in onf.nests:
            current = []
            for line in nest.origin.splitlines():
                if current and not line.startswith(" "):
                    definitions.append("\n".join(current))
                    current = []
                current.append(line)
            if current:
                definitions.append("\n".join(current))
    lines = ["What the kernel computes, as its DNF (psi-reduced, before scheduling):"]
    for definition in dict.fromkeys(definitions):
        lines += definition.splitlines()
    return lines


@lru_cache(maxsize=None)
def _print_index(printer, e) -> str:
    """sympy's printers are slow; a register tile prints the same offsets many times, and
    the same row plus one constant after another (five in six of the offsets printed): such
    a sum is printed as its other terms, once, and the constant."""
    if isinstance(e, sympy.Add) and e.args[0].is_Integer:
        constant, rest = e.args[0], sympy.Add(*e.args[1:])
        sign = "+" if constant > 0 else "-"
        return f"{_print_index(printer, rest)} {sign} {printer.doprint(abs(constant))}"
    return printer.doprint(e)
