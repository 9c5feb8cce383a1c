"""Where a thread block keeps what its threads share: an input's tile staged in shared
memory (Stage), a block's scratch in shared memory (SharedScratch), an output's tile in the
threads' registers (RegisterTile)."""
from dataclasses import dataclass, replace
from typing import Optional

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv, simplified
from moagen.onf.loops import (BlockCopy, Buffer, Let, Loop, ONF, Store, Update, ancestors,
                              arrays_read, bound_symbol, grid_bounds, is_grid, is_thread_loop,
                              loop_key, map_stmt_exprs, max_extent, rewrite_loops, walk)
from moagen.onf.names import kernel_names
from moagen.steps.gpu.vector import VECTOR_TILE
from moagen.steps.step import Step, flag, option, shown

# elements a shared tile's rows are padded by: against bank conflicts where threads walk
# its columns, keeping 16-byte alignment for vector loads along its rows
PAD = 4


def _accesses(stmts, array, around=()):
    """(Access or Store, the loops around it within stmts) for every read and write of array."""
    for s in stmts:
        if isinstance(s, Loop):
            yield from _accesses(s.body, array, around + (s,))
            continue
        for x in (S.subexpressions(s.value) if hasattr(s, "value") else ()):
            if isinstance(x, S.Access) and x.array == array:
                yield x, around
        if isinstance(s, Store) and s.array == array:
            yield s, around


def _replace_accesses(stmts, array, fn, serves=lambda around: True, around=()):
    """stmts with every read of array replaced by fn(access) and every store's index by
    fn's on a stand-in read; only those whose loops around (within stmts, after `around`)
    `serves` accepts."""
    def expr(e):
        if isinstance(e, S.Access) and e.array == array:
            return fn(e)
        return S.map_children(e, expr)

    def stmt(s, around):
        if isinstance(s, Loop):
            return replace(s, body=tuple(stmt(b, around + (s,)) for b in s.body))
        if not serves(around):
            return s
        s = map_stmt_exprs(s, expr)
        if isinstance(s, Store) and s.array == array:
            moved = fn(S.Access(s.array, s.index))
            return replace(s, array=moved.array, index=moved.index)
        return s

    return tuple(stmt(s, around) for s in stmts)


@dataclass(frozen=True)
class _Region:
    """A tile: per index position of the array, the loop whose range it spans, or None
    where every access has the same index there (a loop outside: the block's b, h)."""
    loops: tuple
    fixed: tuple  # the index expressions at the positions no loop spans

    def extents(self):
        return [max_extent(lp) or (lp.stop - lp.start) for lp in self.loops if lp is not None]


def bounded(e, bounds):
    """e with each size the kernel is compiled at bounds of as its bound, MAX_<size>: a
    compile-time row length for a tile whose rows hold up to that many."""
    return sympy.sympify(e).xreplace({x: bound_symbol(x.name)
                       for x in sympy.sympify(e).free_symbols if x.name in dict(bounds)})


def _region(who, array, accesses, inside) -> _Region:
    """The tile every access spans: each index position a loop variable of a loop among
    `inside` (the same range in every access) or the same expression of none."""
    positions = len(accesses[0][0].index)
    loops, fixed = [None] * positions, [None] * positions
    for access, around in accesses:
        scope = {lp.var: lp for lp in around if lp in inside or lp.var in
                 {x.var for x in inside}}
        for p, e in enumerate(access.index):
            e = sympy.sympify(e)
            lp = scope.get(e) if e.is_Symbol else None
            if lp is None and e.free_symbols & set(scope):
                raise ScheduleError(f"{who}: {array}'s index {e} is not a loop variable of the "
                                    "tile's loops")
            if lp is None:
                if fixed[p] is not None and fixed[p] != e:
                    raise ScheduleError(f"{who}: {array} is read at {fixed[p]} and {e}: no one "
                                        "tile")
                fixed[p] = e
            else:
                if loops[p] is not None and (loops[p].start, loops[p].stop) != (lp.start, lp.stop):
                    raise ScheduleError(f"{who}: {array} is read over two ranges of {e}")
                loops[p] = lp
    return _Region(tuple(loops), tuple(fixed))


def _fastest(region: _Region, accesses) -> int:
    """The tile position that varies fastest: the one a thread's register tile walks
    (a thread loop of tile > 1 in the accesses), else the last."""
    tiled = [p for p, lp in enumerate(region.loops) if is_thread_loop(lp) and lp.gpu.tile > 1]
    spanned = [p for p, lp in enumerate(region.loops) if lp is not None]
    return tiled[-1] if tiled else spanned[-1]


def _tile_layout(region, fastest, bounds):
    """(the spanned positions in the tile's order, fastest last; the tile's shape, as long
    as the bound of a size where it has one: a thread's register tile may then read past
    the size, within the tile, into slots whose values it never uses)."""
    spanned = [p for p, lp in enumerate(region.loops) if lp is not None and p != fastest]
    order = spanned + [fastest]
    extent = {p: e for p, e in zip([p for p, lp in enumerate(region.loops) if lp is not None],
                                   region.extents())}
    return order, tuple(bounded(extent[p], bounds) for p in order[:-1]) + \
        (bounded(extent[fastest], bounds) + PAD,)


@dataclass(frozen=True)
class Stage(Step):
    """The reads of input `array` (or of a scratch array the nest only reads, a row's delta)
    inside each loop over `at` from a tile of it in shared
    memory, copied at the start of the loop's body by all the block's threads (the flat
    element e of the tile to thread e mod the block's size: consecutive threads on
    consecutive addresses of the source's last axis), elements past a shorter last tile
    zero. The tile spans, at each index position, the range of the loop whose variable it
    is (the same in every read), laid out with the axis a thread's register tile walks
    last and padded by PAD. The copy does not depend on the loop's variable (the whole
    tile, whichever iteration): the threads of the block, all at one iteration, copy it
    once. The printer puts the barriers after the copy and before the next one. Several
    loops over `at` one after another (a causal kernel's unmasked then diagonal key
    blocks) share one tile, each copying it, where their tiles have one shape.

    late: its copy just before the first statement of the loop's body that reads it rather
    than at the start, so that it can take the memory of tiles read before it (a key
    block's V tile that of its K tile, once the scores are taken: one tile's shared memory
    less; moagen.steps.gpu.closing places them).

    by: only the reads inside a thread loop over `by` (the phase whose register tiles walk
    that axis: K by keys in the scores, by columns in dQ += dS K), laid out for them; the
    array's other reads another Stage's (a second tile of the same rows, each phase's reads
    along its own fastest axis: vector loads in both).

    vector: each thread copies groups of VECTOR_TILE consecutive elements of a source row,
    each by one 16-byte load (moagen_load4), in the kernel's vector instance; its scalar
    instance copies element by element. Preconditions (what keeps a group aligned and
    wholly inside or outside the guards): a 2-D copy of a row-major array, its inner loop
    over the array's last index, of a constant extent a multiple of VECTOR_TILE from a
    start a multiple of it, bounded by the row's length (or the tile's end). The launch
    runs the vector instance only where that length is a multiple of VECTOR_TILE and the
    array 16-byte aligned (moagen.targets.cuda.tiled), so a group at an edge tile is all
    in the row or all past it (zero)."""
    array: str
    at: str = shown("at {at}")
    late: bool = flag("late")
    by: str = option("by {by}", "")
    # >0: along an axis of no constant extent (d), the copy runs on to whole steps of
    # `steps` (the tile's bound one too), zero past the range: a tensor-core sum reads
    # whole steps of k (WarpMma)
    steps: int = option("zero to steps of {steps}", 0)
    vector: bool = flag("vector loads")
    nest: Optional[str] = None
    layer = "mapping"

    @property
    def tile(self) -> str:
        """The shared array it creates, named after the nest, the array and the axis it is
        laid out for: rows_K_tile, dQ_K_tile_by_c."""
        nest = f"{self.nest.replace('.', '_')}_" if self.nest else ""
        return f"{nest}{self.array}_tile" + (f"_by_{self.by}" if self.by else "")

    def __call__(self, onf: ONF) -> ONF:
        nest = self.nest_called(onf)
        # an input, or an array an earlier nest wrote (delta, lse: a kernel launched before)
        readable = ({b.name for b in onf.inputs} - set(onf.inout)) | \
            {b.name for b in onf.temps + onf.outputs}
        if self.array not in readable or any(
                isinstance(a, Store) for a, _ in _accesses(nest.body, self.array)):
            raise ScheduleError(f"{self}: {self.array} is not an input of {onf.name} or an "
                                "array an earlier nest wrote, read only in this one")
        names = kernel_names(onf)
        shared = list(onf.shared)

        def serves(around):
            return not self.by or any(lp.var.name == self.by and is_thread_loop(lp)
                                      for lp in around)

        tiles = []  # (the tile's order, its shape) in each loop over `at`

        def stage(loop):
            # the thread loops around it too: a block's key rows, where a query block's loop
            # stages their K tile (a sequential loop around it, a GQA group's query heads,
            # is at one iteration for the whole copy: its index fixed)
            outer = tuple(lp for lp in ancestors(nest.body, loop)
                          if is_thread_loop(lp))
            accesses = [(a, around) for a, around in
                        _accesses(loop.body, self.array, outer + (loop,)) if serves(around)]
            if not accesses:
                raise ScheduleError(f"{self}: nothing inside the loop over {self.at} reads "
                                    f"{self.array}" + (f" in a thread loop over {self.by}"
                                                       if self.by else ""))
            inside = [lp for _, around in accesses for lp in around]
            region = _region(self, self.array, accesses, inside)
            fastest = _fastest(region, accesses)
            order, shape = _tile_layout(region, fastest, grid_bounds(nest.body))
            name = self.tile
            if not tiles:  # the first loop over `at` makes the tile, the others reuse it
                if name in names.reserved:
                    raise ScheduleError(f"{self}: the name {name} is taken")
                shared.append(Buffer(names.claim(name), shape))
            elif tiles[0] != (order, shape):
                raise ScheduleError(f"{self}: the loops over {self.at} read tiles of "
                                    f"{self.array} of two shapes")
            tiles.append((order, shape))
            if self.steps and any(v % self.steps for _, values in grid_bounds(nest.body)
                                  for v in values):
                raise ScheduleError(f"{self}: a size's compiled bounds are not whole steps of "
                                    f"{self.steps}: the copy would run past the tile")
            if self.vector:
                self._check_vector(onf, region)
            copy = _copy(name, self.array, region, order, names, self.steps, self.vector)
            moved = lambda a: S.Access(name, tuple(
                sympy.sympify(a.index[p]) - region.loops[p].start for p in order))
            body = _replace_accesses(loop.body, self.array, moved, serves, (loop,))
            first = next(k for k, s in enumerate(loop.body)
                         if any(serves((loop,) + around) for _, around in
                                _accesses((s,), self.array))) if self.late else 0
            return replace(loop, body=body[:first] + (copy,) + body[first:])

        body, count = rewrite_loops(nest.body, lambda lp: lp.var.name == self.at,
                                    lambda lp, scope: (stage(lp),))
        if not count:
            raise ScheduleError(f"{self}: nest {nest.label} has no loop over {self.at}")
        nests = [replace(n, body=body) if n is nest else n for n in onf.nests]
        return replace(onf.with_nests(nests, str(self)), shared=tuple(shared))

    def _check_vector(self, onf, region):
        """The vector option's preconditions (the class's docstring)."""
        row = next(b for b in onf.inputs + onf.temps + onf.outputs
                   if b.name == self.array).shape[-1]
        last, extent = region.loops[-1], region.extents()[-1]
        bounds = () if last is None else \
            last.stop.args if isinstance(last.stop, sympy.Min) else (last.stop,)
        if onf.layout != "row" or last is None or len(region.extents()) != 2 or \
                not sympy.sympify(extent).is_Integer or extent % VECTOR_TILE or \
                any(t.as_coeff_Mul()[0] % VECTOR_TILE for t in sympy.Add.make_args(last.start)) \
                or any(simplified(b - row) != 0 and simplified(b - last.start - extent) != 0
                       for b in bounds):
            raise ScheduleError(f"{self}: vector loads copy a 2-D tile of a row-major array "
                                f"along its last index, from a multiple of {VECTOR_TILE} in "
                                f"whole groups of {VECTOR_TILE}, up to the row's length; "
                                f"{self.array}'s tile is not one")


def _copy(tile, array, region, order, names, steps=0, vector=False) -> Loop:
    """The block's copy of the tile: loops over its elements in the source's order, the
    last over the block's x threads (consecutive threads on consecutive addresses), the one
    before over its y threads; a 1-D tile's one loop over all of them (copy.xy). steps:
    an extent of no constant value rounded up to whole steps of it (zero past the range).
    vector: the x loop's mark says it copies by groups of 4 (Stage's vector option)."""
    spanned = [p for p, lp in enumerate(region.loops) if lp is not None]
    extents = dict(zip(spanned, region.extents()))
    if steps:
        extents = {p: e if sympy.sympify(e).is_Integer else steps * idiv(e + steps - 1, steps)
                   for p, e in extents.items()}
    coords = {p: sympy.Symbol(names.claim(names.new("e")), integer=True) for p in spanned}
    source = tuple(region.fixed[p] if lp is None else lp.start + coords[p]
                   for p, lp in enumerate(region.loops))
    inside = [sympy.StrictLessThan(region.loops[p].start + coords[p], region.loops[p].stop)
              for p in spanned if simplified(region.loops[p].stop - region.loops[p].start
                                             - extents[p]) != 0]
    value = S.Access(array, source)
    if inside:
        value = S.Select(sympy.And(*inside), value, S.Num(0.0))
    body = (Store(tile, tuple(coords[p] for p in order), value),)
    # a 1-D tile (a block's lse) over all the block's threads, flat: no two copy one element
    axes = {spanned[-1]: "x", spanned[-2]: "y"} if len(spanned) > 1 else {spanned[-1]: "xy"}
    for p in reversed(spanned):
        mark = BlockCopy(axes[p], vector and axes[p] == "x") if p in axes else None
        body = (Loop(coords[p], sympy.Integer(0), sympy.sympify(extents[p]), body, gpu=mark),)
    return body[0]


@dataclass(frozen=True)
class SharedScratch(Step):
    """A scratch array of the nest (a block of keys' scores) in the block's shared memory:
    the positions indexed by grid loops dropped (a block's own), the others from the start
    of the range they span, the position `fastest` (an index variable) laid out last and
    padded. Every access must be inside the grid, each position of its index a loop
    variable (or a loop variable less the start of the block of keys it is in) of the same
    range in every access. It may take the memory of tiles read before its first write
    (moagen.steps.gpu.closing)."""
    array: str
    fastest: str = shown("{fastest} fastest")
    nest: Optional[str] = None
    layer = "mapping"

    def __call__(self, onf: ONF) -> ONF:
        nest = _scratch_nest(self, onf)
        accesses = list(_accesses(nest.body, self.array))
        grid = {lp.var for _, around in accesses for lp in around if is_grid(lp)} \
            | _walked_by_block(accesses)
        positions = len(accesses[0][0].index)
        spans = [None] * positions
        for access, around in accesses:
            if not any(map(is_grid, around)):
                raise ScheduleError(f"{self}: {self.array} is used outside the grid")
            scope = {lp.var: lp for lp in around}
            for p, e in enumerate(access.index):
                e = sympy.sympify(e)
                if _of_block(e, scope, grid):
                    continue
                span = _span(e, scope, grid_bounds(nest.body))
                if span is None or (spans[p] is not None and spans[p] != span):
                    raise ScheduleError(f"{self}: {self.array}'s index {e} spans no one range")
                spans[p] = span
        kept = [p for p in range(positions) if spans[p] is not None]
        names = [spans[p][0].name for p in kept]
        if self.fastest not in names:
            raise ScheduleError(f"{self}: no index of {self.array} is over {self.fastest}")
        last = kept[names.index(self.fastest)]
        order = [p for p in kept if p != last] + [last]
        shape = tuple(spans[p][2] for p in order[:-1]) + (spans[last][2] + PAD,)

        def local(a):
            return S.Access(self.array, tuple(
                _local_index(sympy.sympify(a.index[p]), spans[p]) for p in order))

        body = _replace_accesses(nest.body, self.array, local)
        temps = tuple(b for b in onf.temps if b.name != self.array)
        nests = [replace(n, body=body) if n is nest else n for n in onf.nests]
        return replace(onf.with_nests(nests, str(self)), temps=temps,
                       shared=onf.shared + (Buffer(self.array, shape),))


def _of_block(e, scope, grid) -> bool:
    """Whether index e is the same for the whole thread block: of the loops around (scope),
    it depends on grid loops only (a grid loop's variable, or a folded one's part: g_r /
    group)."""
    loops = e.free_symbols & set(scope)
    return bool(loops) and loops <= grid


def _walked_by_block(accesses):
    """The variables of the sequential loops around every access, the same loops for all
    (a GQA group's query heads in the key rows' pass): the whole block walks them together,
    so an index by one is one iteration's, the same for every thread, as a grid loop's is."""
    common = None
    for _, loops in accesses:
        ids = {id(lp): lp.var for lp in loops if lp.gpu is None}
        common = ids if common is None else {k: v for k, v in common.items() if k in ids}
    return set((common or {}).values())


def _arrays(nest):
    """The arrays the nest reads or writes."""
    return arrays_read(nest.body) | {s.array for s in walk(nest.body) if isinstance(s, Store)}


def _span(e, scope, bounds=()):
    """(the loop variable, the least value of e, the most elements) of an index e that is a
    loop's variable plus what does not change inside that loop (j - 64*j_blk in [64*j_blk,
    ...)); None otherwise. bounds: the sizes' compiled bounds (BlockTiles'), a loop over
    [0, d) then spanning MAX_d."""
    for var in e.free_symbols & set(scope):
        lp = scope[var]
        most = max_extent(lp)
        if most is None and bounds and lp.start == 0 and \
                {x.name for x in lp.stop.free_symbols} <= set(dict(bounds)):
            most = bounded(lp.stop, bounds)
        if most is None or sympy.diff(e, var) != 1:
            continue
        return var, sympy.expand(e.xreplace({var: lp.start})), most
    return None


def _local_index(e, span):
    """e counted from the start of the range it spans."""
    return sympy.expand(e - span[1])


@dataclass(frozen=True)
class RegisterTile(Step):
    """An output's (or a scratch array's) elements in the registers of the thread that owns
    them, from its first write to its last: every access inside the thread loops whose
    variables index it (the same loops in every access), the other positions indexed by
    grid loops (or parts of a folded one). Each element a thread's iteration touches (one,
    or one per jammed copy: a GQA group's query heads, each its own output row) is a
    register of its own: its first write becomes a local per iteration of those thread
    loops (a thread's tile), the accesses until the last write that local, the last write
    a store of it. Where the last write lies inside loops the first does not (dQ += dS K
    over every block of keys; a slice's rescaled row over its keys), the store of the
    local follows the outermost of them, over the first write's thread loops: one store,
    not one per key."""
    array: str
    nest: Optional[str] = None
    layer = "mapping"

    def __call__(self, onf: ONF) -> ONF:
        if self.array not in {b.name for b in onf.outputs + onf.temps}:
            raise ScheduleError(f"{self}: {self.array} is no output or scratch of {onf.name}")
        nest = self.nest_called(onf)
        accesses = list(_accesses(nest.body, self.array))
        for access, around in accesses:
            scope = {lp.var: lp for lp in around}
            grid = {lp.var for lp in around if is_grid(lp)}
            for e in map(sympy.sympify, access.index):
                lp = scope.get(e)
                if (lp is None or lp.gpu is None) and not _of_block(e, scope, grid):
                    raise ScheduleError(f"{self}: {self.array}[{', '.join(map(str, access.index))}]"
                                        f": {e} is no grid or thread loop's variable")
        elements = {}  # an element's index -> its accesses
        for access, around in accesses:
            elements.setdefault(_element(access.index), []).append(access)
        names = kernel_names(onf)
        local, firsts, lasts, tails = {}, set(), {}, {}
        for element, touched in elements.items():
            stores = [a for a in touched if isinstance(a, Store)]
            if len(stores) < 2 or stores[0].accumulate is not None:
                raise ScheduleError(f"{self}: {self.array} is not written first by a plain "
                                    "store and then again")
            local[element] = names.claim(names.new(f"{self.array}_reg"))
            first, last = stores[0], stores[-1]
            firsts.add(id(first))
            store = Store(self.array, first.index, S.Local(local[element]))
            tail = self._tail(nest.body, first, last)
            if tail is None:
                lasts[id(last)] = store
            else:
                tails.setdefault(id(tail[0]), (tail[1], []))[1].append(store)

        def stmt(s):
            if isinstance(s, Loop):
                return replace(s, body=block(s.body))
            return _to_local(s, self.array, lambda index: local[_element(index)],
                             lambda st: id(st) in firsts)

        def block(stmts):
            out = []
            for s in stmts:
                out.append(stmt(s))
                if id(s) in lasts:  # the local keeps what is stored: read after
                    out.append(lasts[id(s)])
                if id(s) in tails:
                    chain, stores = tails[id(s)]
                    body = tuple(stores)
                    for lp in reversed(chain):
                        body = (replace(lp, body=body),)
                    out += body
            return tuple(out)

        body = block(nest.body)
        nests = [replace(n, body=body) if n is nest else n for n in onf.nests]
        return onf.with_nests(nests, str(self))

    def _tail(self, body, first, last):
        """(the statement the store of the local follows, that store's loops), or None where
        the last write lies in the first's loops and the store follows it."""
        a, b = ancestors(body, first), ancestors(body, last)
        m = 0
        while m < min(len(a), len(b)) and a[m] is b[m]:
            m += 1
        if m >= len(b):
            if last.accumulate is not None:
                raise ScheduleError(f"{self}: {self.array}'s last addition is inside the loops "
                                    "of its first write")
            return None
        chain = a[m:]
        if not all(map(is_thread_loop, chain)):
            raise ScheduleError(f"{self}: the loops of {self.array}'s first write inside "
                                "those of its last are not all thread loops")
        return b[m], chain


def _element(index):
    """An access's index as a key: the accesses to one element of a thread's alike."""
    return tuple(sympy.expand(sympy.sympify(e)) for e in index)


@dataclass(frozen=True)
class RegisterScratch(Step):
    """A scratch array of the nest (a block's scores) in registers, where each thread only
    reads back the elements it wrote (the scores a thread's register tile took, read by the
    same thread loops to make dS): every access inside the grid, each position of its index
    a grid loop's variable or one thread loop's (plus what does not change inside it: j -
    64*j_blk), the same thread loops (variable and range) in every access, each thread loop
    around an access indexing it, and a plain store first. Its first store becomes a local
    of those thread loops, the other stores assignments to it, its reads that local. A
    scratch array other threads read (dS, read by every thread of a row in dQ += dS K)
    stays in memory (SharedScratch)."""
    array: str
    nest: Optional[str] = None
    layer = "mapping"

    def __call__(self, onf: ONF) -> ONF:
        nest = _scratch_nest(self, onf)
        accesses = list(_accesses(nest.body, self.array))
        if not accesses or not isinstance(accesses[0][0], Store) or accesses[0][0].accumulate:
            raise ScheduleError(f"{self}: {self.array} is not written first by a plain store")
        walked = _walked_by_block(accesses)
        owners = None
        for access, around in accesses:
            grid = {lp.var for lp in around if is_grid(lp)}
            threads = {lp.var: lp for lp in around if is_thread_loop(lp)}
            if not grid:
                raise ScheduleError(f"{self}: {self.array} is used outside the grid")
            grid |= walked
            used = set()
            scope = {lp.var: lp for lp in around}
            for e in map(sympy.sympify, access.index):
                if _of_block(e, scope, grid):
                    continue
                span = _span(e, threads)
                if span is None:
                    raise ScheduleError(f"{self}: {self.array}'s index {e} is no grid or thread "
                                        "loop's variable: other threads read what one wrote")
                used.add(span[0])
            key = frozenset(map(loop_key, threads.values()))
            if used != set(threads) or (owners is not None and key != owners):
                raise ScheduleError(f"{self}: {self.array} is not indexed by the same thread "
                                    "loops in every access: other threads read what one wrote")
            owners = key
        names = kernel_names(onf)
        local = names.claim(names.new(f"{self.array}_reg"))
        first = accesses[0][0]

        def stmt(s):
            if isinstance(s, Loop):
                return replace(s, body=tuple(stmt(b) for b in s.body))
            return _to_local(s, self.array, lambda index: local, lambda st: st is first)

        body = tuple(stmt(s) for s in nest.body)
        temps = tuple(b for b in onf.temps if b.name != self.array)
        nests = [replace(n, body=body) if n is nest else n for n in onf.nests]
        return replace(onf.with_nests(nests, str(self)), temps=temps)


def _scratch_nest(step, onf):
    """The nest of a step placing a scratch array a block's own: the array one of the
    kernel's scratch arrays, used by that nest alone."""
    if step.array not in {b.name for b in onf.temps}:
        raise ScheduleError(f"{step}: {step.array} is not a scratch array of {onf.name}")
    nest = step.nest_called(onf)
    if any(step.array in _arrays(n) for n in onf.nests if n is not nest):
        raise ScheduleError(f"{step}: other nests use {step.array}: it outlives a block")
    return nest


def _to_local(s, array, local, is_first):
    """Statement s with array's elements as locals (local(index): an element's): its reads,
    a first store (is_first) the local's definition, its other stores updates of it."""
    def expr(e):
        if isinstance(e, S.Access) and e.array == array:
            return S.Local(local(e.index))
        return S.map_children(e, expr)

    value = expr(s.value)
    if isinstance(s, Store) and s.array == array:
        if is_first(s):
            return Let(local(s.index), value)
        return Update(local(s.index), s.accumulate or "=", value)
    return replace(s, value=value)
