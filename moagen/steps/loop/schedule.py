"""Schedule transformations: named, composable functions from one ONF to the next.

A variant's schedule is a tuple of these, applied in order. Each checks its precondition
and raises ScheduleError when it cannot be honoured; none changes the value computed
(tests check each against the untransformed ONF).
"""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv, simplified
from moagen.onf.loops import (Let, Loop, Nest, ONF, Store, Update, defined_names, loop_vars,
                              map_stmt_exprs, perfect_chain, stmt_exprs, tails, walk)
from moagen.steps.loop.fusion import independent
from moagen.onf.names import Names, base_name, loop_role
from moagen.steps.step import Step


def kernel_names(onf: ONF) -> Names:
    """The names in use in a kernel, for choosing new ones."""
    fixed = ({b.name for b in onf.inputs + onf.outputs + onf.temps}
             | {s.name for s in onf.sizes} | set(onf.scalars))
    locals_, used = set(), set(fixed)
    for nest in onf.nests:
        for s in walk(nest.body):
            if isinstance(s, Loop):
                used.add(s.var.name)
            if isinstance(s, (Let, Update)):
                locals_.add(s.name)
            for e in stmt_exprs(s):
                used |= {x.var.name for x in S.subexpressions(e) if isinstance(x, S.Reduction)}
    return Names(used | locals_, fixed, locals_)


def claim_loop(names: Names, name: str, scope, who) -> sympy.Symbol:
    """The variable of a loop a step creates, called exactly `name`: it may repeat a loop
    variable of another nest or of a sibling loop, never one of the loops around or inside it
    (`scope`), a local or an array, size or scalar of the kernel."""
    if name in names.fixed | names.locals | set(scope):
        raise ScheduleError(f"{who}: the loop name {name} is taken where the step puts its "
                            "loop; give the step another")
    return sympy.Symbol(names.claim(name), integer=True)


class NotApplicable(ScheduleError):
    """The nest lacks what the transform works on (as opposed to a violated precondition)."""


class Transform(Step):
    """A step that rewrites nests one at a time: `nest_fn` on the selected nest, or, when
    `nest` is None, on every nest it applies to (at least one)."""
    nest: Optional[str] = None

    def chosen(self, onf: ONF):
        return [n for n in onf.nests if self.nest is None or n.label == self.nest]

    def __call__(self, onf: ONF) -> ONF:
        chosen = self.chosen(onf)
        if not chosen:
            raise ScheduleError(f"{self}: {onf.name} has no nest {self.nest!r}; it has "
                                f"{', '.join(n.label for n in onf.nests)}")
        names = kernel_names(onf)
        nests, misses = [], []
        for n in onf.nests:
            try:
                nests.append(replace(n, body=self.nest_fn(n, names)) if n in chosen else n)
            except NotApplicable as miss:
                if self.nest is not None:
                    raise
                misses.append(miss)
                nests.append(n)
        if len(misses) == len(chosen):
            raise misses[0]
        return onf.with_nests(nests, str(self))

    def nest_fn(self, nest: Nest, names: Names):
        raise NotImplementedError

    def _on(self):
        return f", nest={self.nest}" if self.nest else ""


# ---- accumulate: move a reduction loop outside an output loop --------------------------

@dataclass(frozen=True)
class Accumulate(Transform):
    """`for c: out[.., c] = op_j body(j, c)` becomes
    `for c: out[.., c] = identity;  for j: for c: out[.., c] op= body(j, c)`,
    so that whatever in body depends on j but not on c can be computed once per j.
    `for c: out[.., c] op= op_j body(j, c)` (an outer sum's terms, after that sum's own
    Accumulate) becomes `for j: for c: out[.., c] op= body(j, c)`."""
    loop: str
    over: str
    nest: Optional[str] = None

    def __str__(self):
        return f"accumulate({self.loop}, over={self.over}{self._on()})"

    def nest_fn(self, nest, names):
        done = []
        body = rewrite_loops(nest.body, self.loop,
                              lambda lp, scope: self._interchange(lp, scope, names, done))
        if not done:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop {self.loop} whose body is "
                                f"a single store of a reduction over {self.over}")
        return body

    def _interchange(self, loop, scope, names, done):
        if len(loop.body) != 1 or not isinstance(loop.body[0], Store):
            return None
        store = loop.body[0]
        red = store.value
        if (not isinstance(red, S.Reduction) or base_name(red.var.name) != self.over
                or store.accumulate not in (None, red.op)):
            return None
        if loop.var in red.extent.free_symbols:
            raise ScheduleError(f"{self}: the extent {red.extent} of {red.var} depends on "
                                f"{loop.var}")
        # the role's own name: only the loop itself, enclosing loops and locals can clash
        taken = scope | {loop.var.name} | names.fixed | names.locals
        var = sympy.Symbol(Names(taken).new(self.over), integer=True)
        update = replace(store, value=S.subs(red.body, {red.var: var}), accumulate=red.op)
        done.append(loop)
        sweep = Loop(var, sympy.Integer(0), red.extent, (replace(loop, body=(update,)),))
        if store.accumulate:  # already adding into out (an outer sum's loop): no identity
            return (sweep,)
        init = replace(loop, body=(replace(store, value=S.Num(S.IDENTITY[red.op])),))
        return (init, sweep)


def rewrite_loops(stmts, var_name, fn, scope=frozenset()):
    """Replace each loop over var_name for which fn(loop, enclosing loop variables) returns
    statements (not None)."""
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            new = fn(s, scope) if s.var.name == var_name else None
            if new is not None:
                out += new
                continue
            s = replace(s, body=rewrite_loops(s.body, var_name, fn, scope | {s.var.name}))
        out.append(s)
    return tuple(out)


# ---- hoist: loop-invariant code motion, reductions included, with CSE ------------------

@dataclass(frozen=True)
class Hoist(Transform):
    """Compute every loop-invariant value once, just before the loop it does not depend on:
    a row's max and sum leave the loops over columns and keys, and values that appear twice
    (the row max inside the row sum and inside each probability) are computed once."""
    nest: Optional[str] = None

    def __str__(self):
        return f"hoist({self.nest or ''})"

    def nest_fn(self, nest, names):
        return _hoist_block(nest.body, names)


def _hoist_block(stmts, names):
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            pre, body = _hoist_out_of_loop(_hoist_block(s.body, names), s.var.name, names)
            out += pre
            out.append(replace(s, body=body))
        else:
            pre = []
            stmt = map_stmt_exprs(s, lambda e: _extract(e, frozenset(), False, pre, names))
            out += pre + [stmt]
    return _share_subexpressions(_cse(out), names)


def _hoist_out_of_loop(body, var, names):
    updated = {s.name for s in walk(body) if isinstance(s, Update)}
    variant = {var} | updated | {"@" + s.array for s in walk(body) if isinstance(s, Store)}
    pre, kept = [], []
    for s in body:
        if (isinstance(s, Let) and s.name not in updated
                and not S.free_names(s.value) & variant):
            pre.append(s)
            continue
        inner = frozenset(variant | defined_names([s]))
        kept.append(map_stmt_exprs(s, lambda e: _extract(e, inner, True, pre, names)))
        if isinstance(s, Let):
            variant.add(s.name)
    return pre, tuple(kept)


def _extract(e, variant, may_extract, pre, names):
    """Replace each maximal subexpression of e that depends on nothing in `variant` by a new
    local, defined in `pre`. At statement level (may_extract False) only subexpressions
    inside a reduction qualify: the statement itself stays where it is."""
    if may_extract and not isinstance(e, S.LEAVES) and not S.free_names(e) & variant:
        value = _extract(e, frozenset(), False, pre, names)
        name = names.claim(names.new(e.name if isinstance(e, S.Reduction) else "t"))
        names.locals.add(name)
        pre.append(Let(name, value))
        return S.Local(name)
    if isinstance(e, S.Reduction):
        body = _extract(e.body, variant | {e.var.name}, True, pre, names)
        return replace(e, body=body)
    return S.map_children(e, lambda c: _extract(c, variant, may_extract, pre, names))


def _cse(block):
    """Drop a Let whose value equals an earlier Let's in the same block; use the first."""
    updated = {s.name for s in walk(block) if isinstance(s, Update)}
    seen, rename, out = {}, {}, []
    for s in block:
        if rename:
            s = map_stmt_exprs(s, lambda e: S.rename_locals(e, rename))
        if isinstance(s, Let) and s.name not in updated:
            key = S.alpha_key(s.value)
            if key in seen:
                rename[s.name] = seen[key]
                continue
            seen[key] = s.name
        out.append(s)
    return tuple(out)


# ---- distribute: one loop per array a loop adds into -----------------------------------

@dataclass(frozen=True)
class Distribute(Transform):
    """Loop distribution: a loop over `var` whose body only adds into several arrays (the
    owner's key rows' pass: dK[j, c] += .., dV[j, c] += .., dQ[i, c] += .. in one loop over c)
    becomes one loop per array, each with that array's additions in their order. Each loop
    keeps fewer values live: the jammed key rows' pass weighed its rows by 32 scalars and
    read 12 rows in one loop, with 16 vector registers; the compiler spilled the scalars and
    reloaded one for each use. The body may begin with locals (the weights of the rows a
    step sums); each loop takes those its additions read, so a loop over query rows holding
    one loop over c per array becomes loops over the query rows that ColumnTiles can tile.
    The values are the same bit for bit: every element gets the same additions in the same
    order. Legal when no array's additions read an array another's store, and the locals
    read no array the loop stores."""
    var: str
    nest: Optional[str] = None

    def __str__(self):
        return f"distribute({self.var}{self._on()})"

    def nest_fn(self, nest, names):
        done = []
        body = rewrite_loops(nest.body, self.var, lambda loop, scope: self._split(loop, done))
        if not done:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop over {self.var} that "
                                "only adds into several arrays")
        return body

    def _split(self, loop, done):
        lets = [s for s in loop.body if isinstance(s, Let)]
        adds = loop.body[len(lets):]
        arrays = [_added_into(s) for s in adds]
        if not adds or None in arrays or len(set(arrays)) < 2:
            return None
        groups = [[s for s, a in zip(adds, arrays) if a == array]
                  for array in dict.fromkeys(arrays)]
        alone = [replace(loop, body=tuple(group)) for group in groups]
        if not all(independent(a, b) for pos, a in enumerate(alone) for b in alone[pos + 1:]):
            raise ScheduleError(f"{self}: the additions into {', '.join(dict.fromkeys(arrays))} "
                                f"in one loop over {loop.var} read each other's arrays")
        stored = {"@" + array for array in arrays}
        if any(S.free_names(let.value) & stored for let in lets):
            raise ScheduleError(f"{self}: a local of the loop over {loop.var} reads an array "
                                "the loop adds into")
        done.append(loop)
        return tuple(replace(loop, body=tuple(_lets_read(lets, group)) + tuple(group))
                     for group in groups)


def _added_into(stmt):
    """The one array a statement only adds into (a store, or a loop of them), or None."""
    stores = [s for s in walk([stmt]) if not isinstance(s, Loop)]
    if not all(isinstance(s, Store) and s.accumulate for s in stores):
        return None
    arrays = {s.array for s in stores}
    return arrays.pop() if len(arrays) == 1 else None


def _lets_read(lets, stmts):
    """The lets, in their order, that stmts read (directly or through later lets)."""
    wanted = set().union(*(S.free_names(x) for s in walk(stmts) for x in stmt_exprs(s)))
    kept = []
    for let in reversed(lets):
        if let.name in wanted:
            kept.append(let)
            wanted |= S.free_names(let.value)
    return reversed(kept)


# ---- split, reorder, parallel ----------------------------------------------------------

@dataclass(frozen=True)
class Split(Transform):
    """Dimension lifting: `for i in [0, n)` becomes
    `for i_blk in [0, ceil(n/T)): for i in [i_blk*T, min(n, i_blk*T + T))`."""
    var: str
    tile: int
    nest: Optional[str] = None

    def __str__(self):
        return f"split({self.var}, {self.tile}{self._on()})"

    @property
    def blocks(self) -> str:
        """The loop over the blocks it creates."""
        return loop_role(self.var, "blk")

    def nest_fn(self, nest, names):
        if self.tile < 1:
            raise ScheduleError(f"{self}: the tile size must be at least 1")
        done = []

        def split(loop, scope):
            if loop.start != 0:
                raise ScheduleError(f"{self}: loop {loop.var} does not start at 0")
            inside = loop_vars((loop,))
            blk = claim_loop(names, self.blocks, scope | inside, self)
            lo = blk * self.tile
            inner = replace(loop, start=lo, stop=sympy.Min(loop.stop, lo + self.tile), parallel=0)
            done.append(loop)
            return (Loop(blk, sympy.Integer(0), idiv(loop.stop + self.tile - 1, self.tile), (inner,),
                         loop.parallel),)

        body = rewrite_loops(nest.body, self.var, split)
        if not done:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop {self.var}")
        # splitting a parallel loop other than the innermost makes the tile loop's bounds
        # depend on the block loop, which neither OpenMP's collapse nor CUDA can map
        for lp in walk(body):
            if isinstance(lp, Loop) and lp.parallel:
                _check_rectangular(self, perfect_chain((lp,), lp.parallel))
        return body


def _check_rectangular(transform, chain):
    chain_vars = {lp.var for lp in chain}
    for lp in chain:
        if (lp.start.free_symbols | lp.stop.free_symbols) & chain_vars:
            raise ScheduleError(f"{transform}: the bounds of {lp.var} depend on another parallel "
                                f"loop; the parallel iteration space must be rectangular")


@dataclass(frozen=True)
class Reorder(Transform):
    """Permute the outermost perfectly nested loops of a nest into the given order."""
    order: Tuple[str, ...]
    nest: Optional[str] = None

    def __str__(self):
        return f"reorder({', '.join(self.order)}{self._on()})"

    def nest_fn(self, nest, names):
        chain = perfect_chain(nest.body, len(self.order))
        have = [lp.var.name for lp in chain] if chain else []
        if sorted(have) != sorted(self.order):
            raise ScheduleError(f"{self}: the outermost perfectly nested loops of nest "
                                f"{nest.target} are not {', '.join(sorted(self.order))}")
        by_name = {lp.var.name: lp for lp in chain}
        body = chain[-1].body
        for pos, name in reversed(list(enumerate(self.order))):
            loop = by_name[name]
            outer = {by_name[o].var for o in self.order[pos + 1:]}
            if (loop.start.free_symbols | loop.stop.free_symbols) & outer:
                raise ScheduleError(f"{self}: the bounds of {name} depend on a loop that "
                                    f"would be inside it")
            body = (replace(loop, body=body, parallel=0),)
        return body


@dataclass(frozen=True)
class Parallel(Transform):
    """Run the outermost perfectly nested loops `vars` in parallel (an OpenMP `collapse`
    on the CPU). Legal only when every store inside is indexed by all of them and no local
    defined outside them is updated inside. The nest's tails (rows.edge: the rows past the
    last full tile) run in parallel too, over the same loops under their names there (i for
    i_tile), where they start with them; a tail that does not needs a Parallel of its own.
    interleave: the CPU threads take the iterations in turn rather than a block each, so
    that they work on neighbouring iterations at the same time (attention's query row
    groups of one head: the threads share that head's keys in the last-level cache)."""
    vars: Tuple[str, ...]
    nest: Optional[str] = None
    interleave: bool = False
    layer = "mapping"

    def __str__(self):
        turns = ", interleaved" if self.interleave else ""
        return f"parallel({', '.join(self.vars)}{turns}{self._on()})"

    def __call__(self, onf: ONF) -> ONF:
        onf = super().__call__(onf)
        if self.nest is None:
            return onf
        names, inherited = kernel_names(onf), {}
        for tail, renames in tails(onf, self.nest):
            own = replace(self, vars=tuple(renames.get(v, v) for v in self.vars), nest=tail.label)
            chain = perfect_chain(tail.body, len(own.vars))
            if chain and [lp.var.name for lp in chain] == list(own.vars) and \
                    not any(isinstance(s, Loop) and s.parallel for s in walk(tail.body)):
                inherited[tail.label] = own.nest_fn(tail, names)
        return replace(onf, nests=tuple(replace(n, body=inherited[n.label])
                                        if n.label in inherited else n for n in onf.nests))

    def nest_fn(self, nest, names):
        chain = perfect_chain(nest.body, len(self.vars))
        if not chain or [lp.var.name for lp in chain] != list(self.vars):
            raise ScheduleError(f"{self}: nest {nest.label} does not start with the perfectly "
                                f"nested loops {', '.join(self.vars)}")
        _check_rectangular(self, chain)
        inner = chain[-1].body
        lets = {s.name for s in walk(inner) if isinstance(s, Let)}
        blocks = {s.var: _block_owner(s) for s in walk(inner) if isinstance(s, Loop)}
        for s in walk(inner):
            if isinstance(s, Store) and not s.atomic:
                used = set().union(*(sympy.sympify(i).free_symbols for i in s.index))
                used |= {blocks[v] for v in used if blocks.get(v) is not None}
                missing = [lp.var.name for lp in chain if lp.var not in used]
                if missing:
                    raise ScheduleError(f"{self}: store to {s.array} is not indexed by "
                                        f"{', '.join(missing)}: parallel iterations would race")
            if isinstance(s, Update) and s.name not in lets:
                raise ScheduleError(f"{self}: {s.name} is shared by parallel iterations")
        return (self.mark(chain[0], len(chain)),)

    def mark(self, loop: Loop, count: int) -> Loop:
        return replace(loop, parallel=count, interleave=self.interleave)


@dataclass(frozen=True)
class GpuThreads(Parallel):
    """The CUDA mapping of parallel loops: one GPU thread per iteration of `vars`, `block`
    threads a thread block (the iterations in order, the innermost loop fastest, so that
    neighbouring threads touch neighbouring elements). The same legality as Parallel."""
    block: int = 128

    def __str__(self):
        return f"gpu_threads({', '.join(self.vars)}, {self.block} a block{self._on()})"

    def mark(self, loop: Loop, count: int) -> Loop:
        if self.interleave or self.block < 1:
            raise ScheduleError(f"{self}: a thread block holds at least one thread, and GPU "
                                "threads are not dealt in turns")
        return replace(loop, parallel=count, threads=self.block)


def _block_owner(loop):
    """The variable v whose iterations own disjoint blocks of this loop, if its range is
    [T*v + a, at most T*v + a + T) with T free of v (a block's rows; T = 0 or less leaves
    the range empty): a store indexed by the loop is then indexed by v as far as races go.
    None otherwise."""
    for v in loop.start.free_symbols:
        step = sympy.diff(loop.start, v)
        if step == 0 or v in step.free_symbols or loop.start.diff(v, 2) != 0:
            continue
        ends = loop.stop.args if isinstance(loop.stop, sympy.Min) else (loop.stop,)
        if any(simplified(end - loop.start - step).is_nonpositive for end in ends):
            return v
    return None


def _share_subexpressions(block, names):
    """Compute a value that two statements of a block share (the probability inside both
    dS and the dV update) once, in a local before the first of them. Reduction bodies are
    not searched: their values depend on the bound variable."""
    block = list(block)
    changing = {s.name for s in walk(block) if isinstance(s, Update)}
    changing |= {"@" + s.array for s in walk(block) if isinstance(s, Store)}
    while True:
        seen = {}  # alpha key -> [occurrences, first statement, size, expression]
        for pos, s in enumerate(block):
            for e in stmt_exprs(s):
                for sub in _shareable(e):
                    if not S.free_names(sub) & changing:
                        seen.setdefault(S.alpha_key(sub), [0, pos, _size(sub), sub])[0] += 1
        repeated = [v for v in seen.values() if v[0] > 1]
        if not repeated:
            return tuple(block)
        _, pos, _, expr = max(repeated, key=lambda v: v[2])
        key = S.alpha_key(expr)
        first = block[pos]
        if isinstance(first, Let) and S.alpha_key(first.value) == key:
            name, start = first.name, pos + 1  # the first use already names the value
        else:
            name = names.claim(names.new(expr.name if isinstance(expr, S.Reduction) else "t"))
            names.locals.add(name)
            block.insert(pos, Let(name, expr))
            start = pos + 1
        block[start:] = [map_stmt_exprs(s, lambda e: _replace(e, key, S.Local(name)))
                         if not isinstance(s, Loop) else s for s in block[start:]]


def _shareable(e):
    """The non-leaf subexpressions of e, outside reduction bodies."""
    if isinstance(e, S.LEAVES):
        return
    yield e
    if not isinstance(e, S.Reduction):
        for c in S.children(e):
            yield from _shareable(c)


def _replace(e, key, local):
    if not isinstance(e, S.LEAVES) and S.alpha_key(e) == key:
        return local
    if isinstance(e, S.Reduction):
        return e
    return S.map_children(e, lambda c: _replace(c, key, local))


def _size(e):
    return 1 + sum(_size(c) for c in S.children(e))
