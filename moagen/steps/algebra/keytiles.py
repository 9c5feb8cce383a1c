"""FlashAttention's two contractions as register tiles, inside a block of keys.

After the online softmax (with blocks of keys), a block does two products for each query
row: the scores, a dot product per key, and the weighted sum of value rows. As loops they
are vector code along the wrong axis: each score is a reduction over the head's columns
(a horizontal add per key), and each key's term is added into the whole output row (the
row loaded and stored once per key or two). FlashAttention computes both as small matrix
products; these two steps give the block that form, one contraction each:

KeyTiles(nest, j, f), the scores S = Q K^T:

    for j in [s, e): let q = 0; for c: q += A(c) * K[.., j, c]; P[.., j] = g(q)
 -> for j_tile in [s / f, e // f):                         (f keys at a time)
        let q_v = 0                                        (v < f)
        vector-tile for c: q_v += A(c) * K_panel[.., j_tile, c, v]
        P[.., f j_tile + v] = g(q_v)
    for j in [f (e // f), e): the loop as it was           (the block's last keys)

with K_panel[.., t, c, v] = K[.., f t + v, c], copied once by a nest before (K transposed
in panels of f keys) for each array the sums read; K read at a packed sequence's keys,
cu_k(b) + j (cu_k offsets), from panels whose tiles start at each sequence's first key,
sequence b's tile t at cu_k(b) // f + b + t (tiles from 0 would not line up with it; the
sequences' keys after their last whole tile are read in place, as the keys after a block's
last tile are); g's reads (an added mask's M[.., i, j])
are one load a key, in place, and where g adds one (P[.., j] = h(q) + M[.., i, j]) it is
added after the tile's stores (P[.., j] = h(q) for every row and lane, then P[.., j] +=
M[.., i, j]): the stores then read the accumulators alone, which the compiler keeps a
vector a row (with the read in them gcc kept them scalar, spilled: 2.5 times the time);
where g keeps h(q) by a bool mask (P[.., j] = h(q) where M[i, j] > 0, else -inf), the
select is applied after so (3.5 times the time in the stores, float32).
The f sums of a step are then one vector register, a column of A is broadcast into it:
with rows jammed (UnrollJam, after this step) the tile is rows x f accumulators, a GEMM
micro-kernel.

ColumnTiles(nest, j, c, f), the output O += P V:

    for j in [s, e): lets L(j); for c in [0, C): X[.., c] += h(L, j, c)
 -> for c_tile in [0, C // f):
        let x_v = X[.., f c_tile + v]                      (v < f)
        vector-tile for j in [s, e): x_v += h(L(j), j, f c_tile + v)
        X[.., f c_tile + v] = x_v
    for j in [s, e): lets L(j); for c in [f (C // f), C): X[.., c] += h(L, j, c)

so an output tile stays in registers for the whole block of keys, each value row's f
columns loaded once for all the jammed rows. A loop just before that scales the same
elements (the online softmax's rescale of the output rows once per block,
X[.., c] = X[.., c] * r) is folded into the tile's loads, let x_v = X[.., f c_tile + v] * r,
and keeps only the columns after the last tile: one pass over the rows less per block, the
same products. With `pack`, a read by key and column (V[.., j, c]) comes from a panel with
the columns cut into tiles placed before the keys, V_panel[.., c_tile, j, v] (copied once
by a nest before, as K's): a tile's loads over a block's keys are then one stream of f
values a key, where V's rows are a whole row apart.

Both are legal where UnrollSum and UnrollJam are: KeyTiles' loop has independent iterations
(every array it stores is indexed by j at one position), ColumnTiles' loop shares only its
additions into elements it does not index and never reads (so its order over j may move
inside each element's own sum: here it does not even move, each x_v adds the keys in the
loop's order, bit for bit the loop's arithmetic). The lets are pure (they read no array the
loop writes), so recomputing them per column tile only repeats loads.
"""
from dataclasses import dataclass, field, replace
from typing import Tuple

import sympy
from sympy.core.function import AppliedUndef

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import divides, idiv
from moagen.onf.loops import (Buffer, Let, Loop, Nest, ONF, Store, Update, loop_vars,
                              map_stmt_exprs, rewrite_loops, stmt_exprs, walk)
from moagen.onf.names import claim_loop, kernel_names, loop_role, nest_role
from moagen.steps.loop.reductions import require_lowered
from moagen.steps.loop.unroll import check_independent, check_sum_only, in_groups, summed_arrays
from moagen.steps.step import Step, flag, option


def _symbols(index):
    return set().union(*(sympy.sympify(i).free_symbols for i in index))


def _vector_tile(s):
    """s with every loop in it marked as a register tile's (vectorized across its statements,
    never along the loop)."""
    if not isinstance(s, Loop):
        return s
    return replace(s, vector_tile=True, body=tuple(_vector_tile(b) for b in s.body))


@dataclass
class _Work:
    """What one application of a step carries: the ONF, its names, the panels made so far
    (array -> (panel buffer, the nest body that fills it, the array's cut axis and the
    tile's place))."""
    onf: ONF
    names: object
    packs: dict = field(default_factory=dict)


class _InnerLoops(Step):
    """A step that rewrites every loop over `loop` (at any depth of one nest, and of the
    nests `also` names: a nest's edges, which run after it, reading its panels) its
    `_selects` accepts into the statements `_tile` returns."""

    def __call__(self, onf: ONF) -> ONF:
        if self.lanes < 2:
            raise ScheduleError(f"{self}: a tile holds at least two lanes")
        work = _Work(onf, kernel_names(onf))
        first = self.nest_called(onf)
        bodies = {}
        for nest in (first, *(self.nest_called(onf, label) for label in self.also)):
            require_lowered(nest, self)
            body, count = rewrite_loops(
                nest.body, lambda loop: loop.var.name == self.loop and self._selects(loop),
                lambda loop, scope: self._tile(loop, scope, work))
            if not count:
                raise ScheduleError(f"{self}: nest {nest.label} has no {self._wanted}")
            bodies[nest.label] = self._after(body)
        if [n.label for n in onf.nests if n.label in bodies][0] != first.label:
            raise ScheduleError(f"{self}: the nests it also tiles must run after "
                                f"{first.label}, which fills their panels")
        nests = []
        for n in onf.nests:
            if n is first:  # the panels' copies before it
                nests += [Nest(panel.name, copy, n.origin, self.packing(array))
                          for array, (panel, copy, _) in work.packs.items()]
            nests.append(replace(n, body=bodies[n.label]) if n.label in bodies else n)
        temps = onf.temps + tuple(panel for panel, _, _ in work.packs.values())
        return replace(onf.with_nests(nests, str(self)), temps=temps)

    def _after(self, body):
        """The nest's body once every loop is tiled (the step's own last rewrite)."""
        return body

    def packing(self, array: str) -> str:
        """The nest it creates that copies `array` into panels."""
        return nest_role(self.nest, f"pack_{array}")

    def _panel(self, access, k, at, tile, work, first=sympy.Integer(0)):
        """The read of `access` from its panel (made on first use): the array with its axis k
        (a loop variable v, or lanes*tile + v) cut into tiles of `lanes`, the tile's axis at
        position `at` of the other axes (the key axis for KeyTiles, before the keys for
        ColumnTiles), the lane last. first: where axis k is read at first + v, a packed
        sequence's first row cu(b) (sequence_first): the panel's tiles then start at each
        sequence's first row, sequence b's tile t at cu(b) // lanes + b + t (sequence_pack)."""
        f = self.lanes
        sequence = sequence_first(first, work.onf)
        layout = (k, at, sequence[0].__name__ if sequence else None)
        if access.array not in work.packs:
            made = sequence_pack(self, access.array, k, at, work, sequence) if sequence \
                else plain_pack(self, access.array, k, at, work)
            work.packs[access.array] = made + (layout,)
        elif work.packs[access.array][2] != layout:
            raise ScheduleError(f"{self}: {access.array} is read with its axes in two orders: "
                                "one panel cannot serve both")
        rest = access.index[:k] + access.index[k + 1:]
        start = idiv(first, f) + first.args[0] + tile if sequence else tile
        index = rest[:at] + (start,) + rest[at:] + (sympy.expand(access.index[k] - first - f * tile),)
        return S.Access(work.packs[access.array][0].name, index)


def sequence_first(first, onf):
    """(cu, its count, the rows it cuts) where first is cu(v), an entry of the kernel's
    offsets cu at a variable (a packed sequence's first row); else None."""
    if not (isinstance(first, AppliedUndef) and len(first.args) == 1
            and isinstance(first.args[0], sympy.Symbol)):
        return None
    offsets = next((b for b in onf.inputs if b.name == first.func.__name__
                    and b.offsets_into is not None), None)
    return (first.func, offsets.shape[0] - 1, offsets.offsets_into) if offsets else None


def _axes(names, count):
    return [sympy.Symbol(names.claim(names.new(f"a{p}")), integer=True) for p in range(count)]


def _nested(loops, body):
    """body inside the loops (var, start, stop), the first outermost."""
    for var, start, stop in reversed(loops):
        body = (Loop(var, sympy.sympify(start), sympy.sympify(stop), body),)
    return body


def _shape_cut(array, k, onf):
    """(array's shape, its axes but axis k, the one a panel cuts into tiles)."""
    shape = next(b.shape for b in onf.inputs + onf.outputs + onf.temps if b.name == array)
    return shape, shape[:k] + shape[k + 1:]


def plain_pack(step, array, k, at, work):
    """(the panel buffer, the nest body copying `array` into it), parallel over the loops
    down to the tiles."""
    shape, rest = _shape_cut(array, k, work.onf)
    f, names = step.lanes, work.names
    panel = Buffer(names.claim(names.new(f"{array}_panel")),
                   rest[:at] + (idiv(shape[k], f),) + rest[at:] + (sympy.Integer(f),))
    axes = _axes(names, len(shape))
    lane = sympy.Symbol(names.claim(names.new("lane")), integer=True)
    others = axes[:at] + axes[at + 1:]  # the panel's axes but the tile's, in its order
    source = others[:k] + [f * axes[at] + lane] + others[k:]
    copy = _nested([(a, 0, n) for a, n in zip(axes, panel.shape)] + [(lane, 0, f)],
                   (Store(panel.name, tuple(axes) + (lane,), S.Access(array, tuple(source))),))
    return panel, (replace(copy[0], parallel=at + 1),)


def sequence_pack(step, array, k, at, work, sequence):
    """plain_pack's for an axis the offsets cu cut into sequences (sequence: sequence_first's
    (cu, count, into)): each sequence s's whole
    tiles of `lanes` rows from its first row cu(s), tile t at cu(s) // lanes + s + t (the
    tiles of one sequence after those of the ones before it: cu(s + 1) // lanes + s + 1 is
    past cu(s) // lanes + s + (cu(s + 1) - cu(s)) // lanes); its rows after them are read in
    place. Parallel over the sequences."""
    _, rest = _shape_cut(array, k, work.onf)
    f, names = step.lanes, work.names
    cu, count, into = sequence
    panel = Buffer(names.claim(names.new(f"{array}_panel")),
                   rest[:at] + (idiv(into, f) + count,) + rest[at:] + (sympy.Integer(f),))
    seq, tile = (sympy.Symbol(names.claim(names.new(role)), integer=True)
                 for role in ("seq", "seq_tile"))
    axes = _axes(names, len(rest))
    lane = sympy.Symbol(names.claim(names.new("lane")), integer=True)
    source = axes[:k] + [cu(seq) + f * tile + lane] + axes[k:]
    target = axes[:at] + [idiv(cu(seq), f) + seq + tile] + axes[at:]
    copy = _nested([(seq, 0, count), (tile, 0, idiv(cu(seq + 1) - cu(seq), f))]
                   + [(a, 0, n) for a, n in zip(axes, rest)] + [(lane, 0, f)],
                   (Store(panel.name, tuple(target) + (lane,), S.Access(array, tuple(source))),))
    return panel, (replace(copy[0], parallel=1),)


@dataclass(frozen=True)
class KeyTiles(_InnerLoops):
    nest: str
    loop: str = "j"
    lanes: int = 8
    also: Tuple[str, ...] = option("also=({also})", ())
    _wanted = "loop over the keys computing sums per key"

    @property
    def tiles(self) -> str:
        """The loops over tiles of `lanes` keys it creates (j_tile)."""
        return loop_role(self.loop, "tile")

    @staticmethod
    def _selects(loop):
        """A loop adding into no array, with an inner loop summing into its own locals."""
        own = {s.name for s in loop.body if isinstance(s, Let)}
        return not summed_arrays(loop) and any(
            isinstance(s, Loop) and any(isinstance(u, Update) and u.name in own
                                        for u in walk(s.body)) for s in loop.body)

    def _tile(self, loop, scope, work):
        f = self.lanes
        if not divides(f, loop.start):
            raise ScheduleError(f"{self}: the loop starts at {loop.start}, not a multiple of "
                                f"{f}: its tiles would not line up with the panels")
        check_independent(self, loop)
        tile = claim_loop(work.names, self.tiles, scope | loop_vars((loop,)), self)
        body = loop.body
        # the sums' operands: a read after them (an added mask's M[.., i, j]) is one load a
        # key, in place
        sums = [s for s in body if isinstance(s, Loop)]
        operands = dict.fromkeys(e for s in walk(sums) for x in stmt_exprs(s)
                                 for e in S.subexpressions(x)
                                 if isinstance(e, S.Access) and loop.var in _symbols(e.index))
        for access in operands:
            at = [k for k, i in enumerate(access.index) if loop.var in _symbols((i,))]
            first = sympy.expand(access.index[at[0]] - loop.var) if len(at) == 1 else None
            if first is None or not (first == 0 or sequence_first(first, work.onf)):
                raise ScheduleError(f"{self}: {access.array} is read at {access.index}: a panel "
                                    f"needs {loop.var} alone at one position, or plus a "
                                    "sequence's first row (an entry of offsets)")
            panel = self._panel(access, at[0], at[0], tile, work, first)
            body = tuple(map_stmt_exprs(s, lambda e: S.replace_node(e, access, panel))
                         for s in body)
        body = _reads_applied_last(self, body)
        return in_groups(self, loop, body, f, tile, work.names,
                         finish=lambda stmts: tuple(map(_vector_tile, stmts)))


@dataclass(frozen=True)
class ColumnTiles(_InnerLoops):
    nest: str
    loop: str = "j"
    cols: str = "c"
    lanes: int = 8
    pack: bool = flag("pack")  # the tiles' operands read by key and column from panels
    also: Tuple[str, ...] = option("also=({also})", ())
    _wanted = "loop over the keys adding into elements it does not index"

    @property
    def tiles(self) -> str:
        """The loops over tiles of `lanes` columns it creates (c_tile)."""
        return loop_role(self.cols, "tile")

    @staticmethod
    def _selects(loop):
        return bool(summed_arrays(loop))

    def _after(self, body):
        return _scaled_loads(body, self.tiles, self.lanes)

    def _tile(self, loop, scope, work):
        check_sum_only(self, loop, summed_arrays(loop))
        lets = [s for s in loop.body if isinstance(s, Let)]
        inner = [s for s in loop.body if not isinstance(s, Let)]
        col = inner[0] if len(inner) == 1 else None
        if (col is None or not isinstance(col, Loop) or col.var.name != self.cols
                or col.start != 0 or loop.var in _symbols((col.stop,))
                or not all(isinstance(s, Store) and s.accumulate == "+" for s in col.body)):
            raise ScheduleError(f"{self}: the loop over {self.loop} must hold locals and one "
                                f"loop over {self.cols} from 0 of additions into arrays")
        f = self.lanes
        tile = claim_loop(work.names, self.tiles, scope | loop_vars((loop,)), self)
        inlined = {}
        for let in lets:  # each let in the ones after it, then in the additions
            inlined[let.name] = S.subs_locals(let.value, inlined)
        accs, sums, stores = [], [], []
        for store in col.body:
            value = S.subs_locals(store.value, inlined)
            if self.pack:
                value = self._packed(value, loop.var, col.var, tile, work)
            for v in range(f):
                at = {col.var: f * tile + v}
                index = tuple(sympy.sympify(i).xreplace(at) for i in store.index)
                acc = work.names.claim(work.names.new(f"{store.array.lower()}_{v}"))
                work.names.locals.add(acc)
                accs.append(Let(acc, S.Access(store.array, index)))
                sums.append(Update(acc, "+", S.subs(value, at)))
                stores.append(Store(store.array, index, S.Local(acc)))
        keys = replace(loop, body=tuple(sums), vector_tile=True)
        tiles = Loop(tile, sympy.Integer(0), idiv(col.stop, f), tuple(accs + [keys] + stores))
        edge = replace(loop, body=tuple(lets) + (replace(col, start=f * idiv(col.stop, f)),))
        return [tiles, edge]

    def _packed(self, value, key, col, tile, work):
        """value with each read indexed by the key and the column each alone (V[.., j, c])
        read from a panel with the column axis cut into tiles placed before the keys
        (V_panel[.., c_tile, j, lane]): a tile's loads over the keys then one stream, `lanes`
        values a key, where the rows of V are a whole row apart."""
        for access in dict.fromkeys(e for e in S.subexpressions(value)
                                    if isinstance(e, S.Access)):
            if key not in access.index or col not in access.index or any(
                    {key, col} & _symbols((i,)) for i in access.index if i not in (key, col)):
                continue
            k, p = access.index.index(col), access.index.index(key)
            panel = self._panel(access, k, p if p < k else p - 1, tile, work)
            value = S.replace_node(value, access, panel)
        return value


def _reads_applied_last(transform, stmts):
    """stmts with each store P[x] = h + R, R a read of another array, split: P[x] = h where
    it was, P[x] += R after the last statement (KeyTiles' docstring says why); so too a
    store P[x] = (h where R > 0, else -inf), a bool mask's R: P[x] = h, then P[x] = (P[x]
    where R > 0, else -inf). Each statement it moves past must be a store of another
    element, not reading P nor writing R's array."""
    kept, applied, masks = [], [], set()
    for s in stmts:
        if applied and not _commutes(s, applied, masks):
            raise ScheduleError(f"{transform}: {', '.join(sorted(masks))} cannot be applied "
                                "after the tile's stores: a statement after its store reads "
                                "or writes what the application does")
        kept.append(s)
        split = _applied_read(s)
        if split is not None:
            kept[-1], after, read = split
            applied.append(after)
            masks.add(read)
    return tuple(kept + applied)


def _commutes(stmt, applied, reads):
    """Whether stmt may run before the applications (P[x] += R, or P[x]'s select by R): a
    store of no element they write, reading no array they write, writing no array they
    read."""
    read = {e.array for x in stmt_exprs(stmt) for e in S.subexpressions(x)
            if isinstance(e, S.Access)}
    return (isinstance(stmt, Store) and not read & {a.array for a in applied}
            and stmt.array not in reads
            and all((stmt.array, stmt.index) != (a.array, a.index) for a in applied))


def _applied_read(store):
    """(the store without R, the statement applying R after, R's array) where store is a
    plain store P[x] = h + R (or R + h) or P[x] = (h where R > 0, else -inf), R a read of
    another array; else None."""
    if not (isinstance(store, Store) and store.accumulate is None and not store.atomic):
        return None
    value = store.value
    if isinstance(value, S.Bin) and value.op == "+":
        read = next((e for e in (value.right, value.left)
                     if isinstance(e, S.Access) and e.array != store.array), None)
        if read is not None:
            h = value.left if value.right == read else value.right
            return (replace(store, value=h), replace(store, value=read, accumulate="+"),
                    read.array)
    mask = S.kept_by(value)
    if isinstance(mask, S.Access) and mask.array != store.array:
        own = S.Access(store.array, tuple(store.index))
        return (replace(store, value=value.then), replace(store, value=replace(value, then=own)),
                mask.array)
    return None


def _scaled_loads(stmts, tiles, f):
    """stmts with every loop scaling elements in place, X[.., c] = X[.., c] * r for c in
    [0, C), that a loop over `tiles` (f columns a tile, C // f tiles) right after it loads
    whole, folded into the tile's loads; the scaling loop then starts after the last tile."""
    out = [replace(s, body=_scaled_loads(s.body, tiles, f)) if isinstance(s, Loop) else s
           for s in stmts]
    for k in range(len(out) - 1):
        scale, tile = out[k], out[k + 1]
        if not (isinstance(scale, Loop) and isinstance(tile, Loop) and tile.var.name == tiles
                and scale.start == 0 and tile.start == 0 and tile.stop == idiv(scale.stop, f)):
            continue
        factors = {}
        for st in scale.body:
            factor = _scaling(st, scale.var)
            if factor is None:
                factors = {}
                break
            for v in range(f):
                at = {scale.var: f * tile.var + v}
                index = tuple(sympy.sympify(i).xreplace(at) for i in st.index)
                factors[S.Access(st.array, index)] = factor
        loads = [b for b in tile.body if isinstance(b, Let) and b.value in factors]
        if not factors or len(loads) != len(factors):
            continue  # not every scaled element loaded by the tile: left as it was
        body = tuple(replace(b, value=S.Bin("*", b.value, factors[b.value])) if b in loads
                     else b for b in tile.body)
        out[k] = replace(scale, start=f * tile.stop)
        out[k + 1] = replace(tile, body=body)
    return tuple(out)


def _scaling(store, var):
    """r where store is X[idx] = X[idx] * r with r reading neither X nor anything at var
    (the same factor for every element the loop scales), else None."""
    value = store.value
    if not (isinstance(store, Store) and store.accumulate is None and isinstance(value, S.Bin)
            and value.op == "*" and value.left == S.Access(store.array, store.index)):
        return None
    reads = [e for e in S.subexpressions(value.right) if isinstance(e, S.Access)]
    if any(e.array == store.array or var in _symbols(e.index) for e in reads):
        return None
    return value.right
