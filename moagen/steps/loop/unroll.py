"""Unroll and jam: several iterations of an outer loop share one pass of the loops inside.

    for i: B(i)      ->   tiles  for i_tile in [0, n // f):  jam(B(f*i_tile), .., B(f*i_tile + f-1))
                          edge   for i in [f * (n // f), n): B(i)

jam interleaves the f copies statement by statement: a loop in B becomes one loop whose
body is the copies' bodies jammed, every other statement is repeated once per copy, each
copy with locals of its own. In attention, f query rows then walk the keys together: each
key row and value row is loaded once for f rows, and the f dot products are f independent
sums instead of one long chain of dependent adds. In decode, f query heads of a group read
their shared KV rows once.

Legal when the iterations of i are independent: every array B stores is indexed by i at one
position, in every store and every read of it (the locals are B's own: i is one of the
perfectly nested loops a nest starts with). Jamming then only interleaves statements of
different iterations, which touch different elements. Or when they share only additions
into an array they do not index and never read (UnrollSum's condition: the owner's key rows
adding dS K into dQ's part): the copies' additions to one element are then merged into one
addition of their sum, regrouped as UnrollSum regroups. The loops inside B may not depend on
i: the copies share them."""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import divides, idiv
from moagen.onf.loops import (Let, Loop, Nest, ONF, Store, Update, ancestors, arrays_read,
                              enclose, loop_nest, loop_vars, map_stmt_exprs, rewrite_loops,
                              stmt_exprs, subs_stmts, walk)
from moagen.onf.names import claim_loop, kernel_names, loop_role, nest_role
from moagen.philox import KEYS_PER_RUN
from moagen.steps.loop.reductions import require_lowered
from moagen.steps.step import NotApplicable, Step


@dataclass(frozen=True)
class UnrollJam(Step):
    nest: str
    loop: str
    factor: int

    @property
    def tiles(self) -> str:
        """The loop over groups of `factor` iterations it creates (i_tile)."""
        return tiled(self.loop, self.factor)

    @property
    def edge(self) -> str:
        """The tail nest it creates: the iterations past the last full group."""
        return nest_role(self.nest, "edge")

    def __call__(self, onf: ONF) -> ONF:
        if self.factor < 2:
            raise ScheduleError(f"{self}: the factor must be at least 2")
        nest = self.nest_called(onf)
        # the copies' sums must already be loops, to be jammed into one
        require_lowered(nest, self)
        if any(n.label == self.edge for n in onf.nests):
            raise ScheduleError(f"{self}: {onf.name} already has a nest {self.edge}")
        # an edge's loop starts past its parent's tiles: its groups start there too
        outer, loop = outer_loop(self, nest.body, self.loop, any_start=True)
        summed = summed_arrays(loop)
        if summed:
            check_sum_only(self, loop, summed)
        else:
            check_independent(self, loop)

        names = kernel_names(onf)
        in_nest = loop_vars(nest.body)
        tile = claim_loop(names, self.tiles, in_nest, self)
        copies = [copy_iteration(loop.body, loop.var, loop.start + self.factor * tile + u, u,
                                 names) for u in range(self.factor)]
        full = idiv(loop.stop - loop.start, self.factor)
        jammed = jam(self, copies)
        tiles = enclose(outer, (Loop(tile, sympy.Integer(0), full,
                                     _merge_sums(jammed) if summed else jammed),))
        edge = enclose(outer, (replace(loop, start=loop.start + self.factor * full),))
        tail = Nest(nest.target, edge, nest.origin, self.edge, parent=nest.label,
                    renames=((tile.name, loop.var.name),))
        # a tail's parent loop that ran under the name of the loop now tiled runs under the
        # tiles' (so that the parent's mapping reaches the tiles, Parallel)
        renames = tuple((p, tile.name if own == loop.var.name else own) for p, own in nest.renames)
        nests = []
        for n in onf.nests:
            nests += [replace(n, body=tiles, renames=renames), tail] if n is nest else [n]
        return onf.with_nests(nests, str(self))


def outer_loop(transform, stmts, var, any_start=False):
    """(the loops around the one over var, outermost first; that loop), among the perfectly
    nested loops stmts start with; refused unless it starts at 0 (any_start: anywhere) and
    no loop is parallel yet."""
    chain, _ = loop_nest(stmts)
    names = [lp.var.name for lp in chain]
    if var not in names:
        raise ScheduleError(f"{transform}: nest {transform.nest} does not start with perfectly "
                            f"nested loops down to one over {var}")
    loop = chain[names.index(var)]
    if (loop.start != 0 and not any_start) or any(lp.parallel for lp in chain):
        raise ScheduleError(f"{transform}: the loop over {var} must start at 0, and be "
                            "transformed before any loop is made parallel")
    return chain[:names.index(var)], loop


def rows_together(nest: str, loop: str, rows: int) -> Tuple:
    """The step that runs `rows` iterations of a nest's loop `loop` together (UnrollJam);
    none for one row."""
    if rows < 1:
        raise ScheduleError(f"{nest}: {rows} rows together: there must be at least one")
    return (UnrollJam(nest, loop, rows),) if rows > 1 else ()


def tiled(loop: str, rows: int) -> str:
    """The name of the loop over `loop` once rows_together has run `rows` of its iterations
    together: the loop over the groups (UnrollJam's), or itself for one row."""
    return loop_role(loop, "tile") if rows > 1 else loop


def keys_summed(nest: str, keys: int, loop: str = "j") -> Tuple:
    """The step that sums `keys` iterations of the loops over `loop` at a time (UnrollSum);
    keys = 1: none."""
    if keys < 1:
        raise ScheduleError(f"{nest}: {keys} keys summed together: there must be at least one")
    return (UnrollSum(nest, loop, keys),) if keys > 1 else ()


def copy_iteration(stmts, var, value, u, names):
    """stmts for var = value, every local they declare renamed for copy u."""
    rename = {}
    for s in walk(stmts):
        if isinstance(s, Let) and s.name not in rename:
            rename[s.name] = names.claim(names.new(f"{s.name}_{u}"))
            names.locals.add(rename[s.name])
    renamed = (map_stmt_exprs(s, lambda e: S.rename_locals(e, rename)) for s in stmts)
    return tuple(_rename_lets(s, rename) for s in subs_stmts(renamed, {var: value}))


def _rename_lets(s, rename):
    if isinstance(s, Loop):
        return replace(s, body=tuple(_rename_lets(b, rename) for b in s.body))
    return replace(s, name=rename.get(s.name, s.name)) if isinstance(s, (Let, Update)) else s


def jam(transform, copies):
    """The copies interleaved statement by statement; their loops merged into one (their
    bounds must agree)."""
    out = []
    for stmts in zip(*copies):
        first = stmts[0]
        if not isinstance(first, Loop):
            out += stmts
            continue
        if any((s.start, s.stop) != (first.start, first.stop) for s in stmts):
            raise ScheduleError(f"{transform}: the bounds of the loop over {first.var} depend "
                                f"on {transform.loop}: the copies cannot share it")
        out.append(replace(first, body=jam(transform, [s.body for s in stmts])))
    return tuple(out)


def in_groups(transform, loop, body, f, tile, names, finish=tuple):
    """The loop f iterations a step, then the rest:

        for v in [s, e): body(v)  ->  for tile in [s / f, e // f): finish(jam(body(f tile), ..,
                                                                            body(f tile + f - 1)))
                                      for v in [f (e // f), e): body(v)

    s a multiple of f (the caller's check: its groups must line up with what it tiles)."""
    copies = [copy_iteration(body, loop.var, f * tile + u, u, names) for u in range(f)]
    full = idiv(loop.stop, f)
    return [Loop(tile, sympy.expand(loop.start / f), full, finish(jam(transform, copies))),
            replace(loop, start=f * full)]


def check_independent(transform, loop):
    """Every array the loop stores is indexed by its variable at one position, in every
    store and every read, by expressions that step with it (i; a group's query head G g + r;
    the rows of a jammed tile, 4 j_tile + u for u < 4): the iterations touch disjoint
    elements."""
    body = loop.body
    for array in dict.fromkeys(s.array for s in walk(body) if isinstance(s, Store)):
        indices = [s.index for s in walk(body) if isinstance(s, Store) and s.array == array]
        indices += [e.index for s in walk(body) for x in stmt_exprs(s)
                    for e in S.subexpressions(x) if isinstance(e, S.Access) and e.array == array]
        if not any(_owned([index[pos] for index in indices], loop.var)
                   for pos in range(len(indices[0]))):
            raise ScheduleError(f"{transform}: {array} is not indexed by {loop.var} at "
                                "one position in every store and read: iterations would share "
                                "its elements")


def _owned(exprs, var) -> bool:
    """Whether the expressions are var times one nonzero number s plus terms that differ
    between them by integers less than |s| apart: each iteration's values are its own."""
    slopes = {sympy.diff(e, var) for e in exprs}
    if len(slopes) != 1:
        return False
    slope = slopes.pop()
    if not slope.is_Number or slope == 0:
        return False
    offsets = [sympy.expand(e - exprs[0]) for e in exprs]
    return all(o.is_Integer for o in offsets) and max(offsets) - min(offsets) < abs(slope)


@dataclass(frozen=True)
class UnrollSum(Step):
    """`factor` iterations at a time of every loop over `loop` in a nest that adds into
    array elements the loop does not index (the weighted sum of attention, O[i, c] += p[j] *
    V[j, c] over keys j):

        for j in [s, e): B(j)  ->  for j_tile in [s / f, e // f): merge(jam(B(f j_tile), ..))
                                   for j in [f (e // f), e): B(j)

    jam is UnrollJam's; merge then joins the copies' additions to one element into one,
    O[i, c] += p[j] V[j, c] + p[j+1] V[j+1, c] + ..: the element is loaded and stored once
    for f terms, where one store per multiply-add bounds the loop. The sum is regrouped by f
    terms (floating point: the same to rounding).

    Legal when the iterations share nothing else: every other array the loop stores is
    indexed by it at one position in every store and read (UnrollJam's condition), a summed
    array is not read in the loop, and the outer locals it changes are accumulated; and
    when s is a multiple of f (a block of keys starts at 64 j_blk), so that the groups are
    the f-aligned ones (the cost model sees their copies as the lanes of one range)."""
    nest: str
    loop: str
    factor: int

    @property
    def tiles(self) -> str:
        """The loops over groups of `factor` iterations it creates (j_tile)."""
        return loop_role(self.loop, "tile")

    def rewrite_nest(self, nest, names):
        if self.factor < 2:
            raise ScheduleError(f"{self}: the factor must be at least 2")
        body, unrolled = rewrite_loops(
            nest.body, lambda loop: loop.var.name == self.loop and summed_arrays(loop),
            lambda loop, scope: self._unroll(loop, names, scope))
        if not unrolled:
            raise NotApplicable(f"{self}: nest {self.nest} has no loop over {self.loop} that "
                                "adds into array elements it does not index")
        return body

    def _unroll(self, loop, names, scope):
        summed = summed_arrays(loop)
        check_sum_only(self, loop, summed)
        f = self.factor
        if not divides(f, loop.start):
            raise ScheduleError(f"{self}: the loop starts at {loop.start}, not a multiple of "
                                f"{f}: its groups of {f} would not line up")
        tile = claim_loop(names, self.tiles, scope | loop_vars((loop,)), self)
        return in_groups(self, loop, loop.body, f, tile, names, finish=_merge_sums)


def summed_arrays(loop):
    """The arrays the loop adds into at elements it does not index."""
    return {s.array for s in walk(loop.body) if isinstance(s, Store) and s.accumulate == "+"
            and not any(loop.var in sympy.sympify(i).free_symbols for i in s.index)}


def check_sum_only(transform, loop, summed):
    """Refuses a loop whose iterations share anything but their additions to `summed`."""
    reads = arrays_read(loop.body)
    if summed & reads:
        raise ScheduleError(f"{transform}: the loop reads {', '.join(sorted(summed & reads))}, "
                            "which it sums into: its iterations depend on each other")
    if any(isinstance(s, Store) and s.array in summed and (s.accumulate != "+" or s.atomic)
           for s in walk(loop.body)):
        raise ScheduleError(f"{transform}: an array the loop sums into is also set in it")
    declared = {s.name for s in walk(loop.body) if isinstance(s, Let)}
    if any(isinstance(s, Update) and s.name not in declared and s.op == "="
           for s in walk(loop.body)):
        raise ScheduleError(f"{transform}: the loop assigns a local of the code around it: "
                            "its iterations depend on each other")
    others = replace(loop, body=tuple(_without_sums(loop.body, summed)))
    check_independent(transform, others)


def _without_sums(stmts, summed):
    for s in stmts:
        if isinstance(s, Loop):
            yield replace(s, body=tuple(_without_sums(s.body, summed)))
        elif not (isinstance(s, Store) and s.array in summed):
            yield s


def _merge_sums(stmts):
    """Additions to the same element, one after another, as one addition of their sum."""
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            s = replace(s, body=tuple(_merge_sums(s.body)))
        last = out[-1] if out else None
        if isinstance(s, Store) and isinstance(last, Store) and s.accumulate == "+" and \
                not s.atomic and (last.array, last.index, last.accumulate, last.atomic) == \
                (s.array, s.index, "+", False):
            out[-1] = replace(last, value=S.Bin("+", last.value, s.value))
        else:
            out.append(s)
    return tuple(out)


@dataclass(frozen=True)
class UnrollDraws(Step):
    """The draws of dropout's factors in every loop over `loop` whose body draws by its
    variable, each group of KEYS_PER_RUN (8) keys naming one (row, group): the copies' keys
    read 8 t + v (moagen.moa.scalar.Dropout.draw), and the compiler makes one Philox run
    for the 8 where each key made its own. A loop that draws a key an iteration (the flash
    forward's factors applied to a block's row) runs 8 at a time:

        for j in [s, e): B(j)  ->  for j_tile in [s / 8, e // 8): jam(B(8 j_tile), .., B(8 j_tile + 7))
                                   for j in [8 (e // 8), e): B(j)

    jam is UnrollJam's; j_tile, innermost, is marked simd, so that the compiler runs several
    groups' rounds in the lanes of its vectors. A loop that draws 8 keys an iteration (the
    owner backward's tiles of 8 key rows, UnrollJam's) is left as it is. In both, a loop
    around it that takes one value (the backward's j_part, of one part: 0) is that value in
    the draws' keys, so that they read as groups.

    Legal where UnrollJam is (the iterations independent), when s is a multiple of 8 (a key
    an iteration), and when every key is then 8 t + v (v < 8 a number, the rest a multiple
    of 8): the loop's keys are Philox's groups. Refused otherwise: a tile of 6 keys, whose
    runs of 8 straddle two groups, or a part's keys starting off a multiple of 8."""
    loop: str
    nest: Optional[str] = None

    def rewrite_nest(self, nest, names):
        body, unrolled = rewrite_loops(
            nest.body, lambda loop: loop.var.name == self.loop and any(
                loop.var in sympy.sympify(e.key).free_symbols for e in _draws(loop.body)),
            lambda loop, scope: self._unroll(loop, names, scope, ancestors(nest.body, loop)))
        if not unrolled:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop over {self.loop} that "
                                "draws dropout's factors by it")
        return body

    def _unroll(self, loop, names, scope, around):
        steps = {sympy.diff(e.key, loop.var) for e in _draws(loop.body)}
        if steps not in ({1}, {KEYS_PER_RUN}):
            raise ScheduleError(f"{self}: the loop over {self.loop} steps its draws' keys by "
                                f"{', '.join(sorted(map(str, steps)))}, not 1 or "
                                f"{KEYS_PER_RUN}: its keys are not Philox's groups")
        f = KEYS_PER_RUN // int(steps.pop())
        if not divides(f, loop.start):
            raise ScheduleError(f"{self}: the loop starts at {loop.start}, not a multiple of "
                                f"{f}: its keys would not be Philox's groups")
        rest = []
        if f > 1:
            check_independent(self, loop)
            tile = claim_loop(names, loop_role(self.loop, "tile"),
                              scope | loop_vars((loop,)), self)
            loop, *rest = in_groups(self, loop, loop.body, f, tile, names)
            if not any(isinstance(s, Loop) for s in loop.body):
                # the groups' runs side by side in vector lanes (their iterations
                # independent, as the loop's were): MarkSimd takes only unit-stride stores,
                # a group's are 8 apart
                loop = replace(loop, simd=True)
        one = {lp.var: lp.start for lp in around if sympy.expand(lp.stop - lp.start) == 1}
        loop = map_stmt_exprs(loop, lambda e: _keys_at(e, one))
        straddle = [e.key for e in _draws(loop.body) if not e.draw()[1].is_Integer]
        if straddle:
            raise ScheduleError(f"{self}: key {straddle[0]} is not 8 times a group plus a "
                                "piece: the draws of a group's keys would not share a run")
        return [loop] + rest


def _draws(stmts):
    """The Dropout nodes of the statements' expressions."""
    return [e for s in walk(stmts) for x in stmt_exprs(s) for e in S.subexpressions(x)
            if isinstance(e, S.Dropout)]


def _keys_at(e, values):
    """e with its draws' keys at `values` (sympy Symbol -> expression)."""
    if isinstance(e, S.Dropout):
        return replace(e, key=sympy.sympify(e.key).xreplace(values))
    return S.map_children(e, lambda c: _keys_at(c, values))
