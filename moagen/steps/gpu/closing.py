"""What realize ends an ONF with once its statements are final, for its tiled CUDA nests,
in this order: the block form checked (check_block_form), each nest's shared memory laid
out (lay_out_shared), then its barriers (insert_barriers) and its warp reductions
(insert_lane_reductions) put in as statements: the printer (moagen.targets.cuda.tiled)
prints them as they are. Each pass's reasons are in its section's opening comment."""
from dataclasses import replace

import sympy

from moagen.cuda_archs import WARP, tightest_shared_limit
from moagen.errors import ScheduleError
from moagen.moa.expr import idiv, simplified
from moagen.onf.loops import (ONF, Barrier, Hazard, LaneReduce, Let, Loop, Mma, SharedArray,
                              SharedLayout, Update, bound_symbol, enclose, grid_chain,
                              is_block_copy, is_grid, is_thread_loop, loop_key, walk)
from moagen.onf.shared import shared_accesses
from moagen.onf.signature import DTYPE_BYTES


def close_tiled(onf: ONF, element_bytes=None) -> ONF:
    """element_bytes: the element sizes the ONF is printed at (None: every CUDA one)."""
    check_block_form(onf)
    return insert_lane_reductions(insert_barriers(lay_out_shared(onf, element_bytes)))


# ---- The block form --------------------------------------------------------------
# What a CUDA tiled kernel's printer takes (moagen.targets.cuda.tiled), checked once the
# mapping steps have run: every statement inside a nest's grid runs on the block's threads
# (inside a thread loop, or a block's copy), and every loop there is uniform across the
# block's threads (its bounds read no thread's row or column), so that each thread reaches
# every barrier and warp shuffle the printer puts in it. One exception: a loop whose
# bounds read only thread loops along y, in a nest whose x threads fill a warp and that
# touches no shared memory, is uniform across each warp (a warp's own slice of the keys in
# decode): it holds warp shuffles and no barrier. BlockTiles and ThreadTiles check what they
# can as they run; these properties hold only of the finished mapping.

def check_block_form(onf: ONF):
    """ScheduleError naming the nest and the statement where a tiled nest breaks the
    above."""
    for nest in onf.nests:
        if any(map(is_grid, walk(nest.body))):
            _check(nest.label, nest.body, threads=(), in_grid=False,
                   warp_rows=_warp_rows(nest, onf))


def _warp_rows(nest, onf):
    """The thread loops along y (their variables) whose warps a loop's bounds may read:
    those of one row a thread (their extent their threads: no thread past the range), where
    the nest's x threads are whole warps and it has no shared array; else none."""
    loops = [lp for lp in walk(nest.body) if is_thread_loop(lp)]
    widths = {lp.gpu.threads for lp in loops if lp.gpu.axis == "x"}
    if widths != {WARP} or any(is_block_copy(lp) for lp in walk(nest.body)) or any(
            True for s in nest.body for _ in shared_accesses(s, {b.name for b in onf.shared})):
        return frozenset()
    return frozenset(lp.var for lp in loops if lp.gpu.axis == "y" and lp.gpu.tile == 1
                     and simplified(lp.stop - lp.start) == lp.gpu.threads)


def _check(label, stmts, threads, in_grid, warp_rows=frozenset()):
    for s in stmts:
        if not isinstance(s, Loop):
            if in_grid and not threads:
                raise ScheduleError(f"nest {label}: {s} is inside the grid and outside every "
                                    "thread loop: map its loops with ThreadTiles")
            continue
        bound_by = (s.start.free_symbols | s.stop.free_symbols) & set(threads)
        if is_block_copy(s):
            if bound_by:
                raise ScheduleError(f"nest {label}: a block's copy over {s.var} has bounds "
                                    f"that read the thread loops' {sorted(map(str, bound_by))}")
            continue  # its threads are the whole block's
        if bound_by and not is_thread_loop(s) and not bound_by <= warp_rows:
            raise ScheduleError(f"nest {label}: the loop over {s.var} has bounds that read the "
                                f"thread loops' {sorted(map(str, bound_by))}: its threads would "
                                "not all reach a barrier inside")
        inner = threads + ((s.var,) if is_thread_loop(s) else ())
        _check(label, s.body, inner, in_grid or is_grid(s), warp_rows)


# ---- Shared memory ---------------------------------------------------------------
# Where a tiled nest's shared arrays lie in its block's shared memory: a SharedLayout
# per element size, recorded on the nest (as realize closes an ONF) for the CUDA printer to
# declare.
#
# Each array is live from its first access to its last, in the order the block runs its
# statements (a tile from each copy to its last read before the next copy), and over the
# whole of a loop it is live into (a Q tile staged before the loop over key blocks) or that
# reads it before writing it (what an iteration leaves the next).
# Arrays are placed in the order they become live, each at the lowest 16-byte offset where
# it overlaps no array live at the same time: a key block's V tile, copied once its scores
# are taken, lands on the K tile it follows without a step saying so. Sizes are symbolic in
# the compile-time bounds (MAX_d), so an offset must fit at every bound. The barriers then
# keep one array's last reads before the next one's first writes wherever their bytes
# meet. Every instance (each bound, each element size the ONF is printed at) must fit the
# built architecture that allows a block the least (moagen.cuda_archs), so that no launch is
# refused on a GPU the build targets: a kernel module tiles an instance that would not
# smaller (docs/PERFORMANCE.md, "CUDA: FlashAttention-2's form for attention, judged
# without a GPU").

# the element sizes a CUDA kernel is printed for: its dtypes'
ELEMENT_BYTES = tuple(sorted(DTYPE_BYTES.values()))


def lay_out_shared(onf: ONF, element_bytes=None) -> ONF:
    """onf with each tiled nest's SharedLayout at each of `element_bytes` (None: every
    CUDA element size): its shared arrays (those of onf.shared it touches) placed where they
    meet no array live at the same time, at every bound its grid is compiled for.
    Precondition, raised as ScheduleError naming the nest, the bound, the bytes and the
    limit: each layout's total at each bound fits every built architecture's shared memory
    a block."""
    names = {b.name for b in onf.shared}
    nests = []
    for nest in onf.nests:
        grid, body = grid_chain(nest)
        if grid:
            touched = {a for s in body for a, _, _ in shared_accesses(s, names)}
            shared = [b for b in onf.shared if b.name in touched]
            bounds = [{bound_symbol(name): v}
                      for name, values in grid[-1].gpu.bounds for v in values] or [{}]
            # tensor-core fragments start 32-byte aligned in their tiles (WarpMma): so do
            # the tiles
            granule = 32 if any(isinstance(lp.gpu, Mma) for lp in walk(body)
                                if isinstance(lp, Loop)) else 16
            layouts = tuple(place(shared, body, size, bounds, granule)
                            for size in element_bytes or ELEMENT_BYTES)
            for layout in layouts:
                check_fits(f"{onf.name} {onf.variant}, nest {nest.label}", layout, bounds)
            nest = replace(nest, shared_layouts=layouts)
        nests.append(nest)
    return replace(onf, nests=tuple(nests))


def check_fits(where, layout: SharedLayout, bound_values):
    """ScheduleError where the layout's total at one of its bounds is over the shared
    memory the tightest built architecture allows a block."""
    arch, limit = tightest_shared_limit()
    for bound in bound_values:
        total = int(sympy.sympify(layout.total).xreplace(bound))
        if total > limit:
            at = ", ".join(f"{s} = {v}" for s, v in bound.items()) or "its one instance"
            raise ScheduleError(
                f"{where}: {layout.element_bytes}-byte elements at {at} take {total} "
                f"bytes of shared memory a block, over the {limit} {arch} allows: tile that "
                "instance smaller (fewer rows a block, smaller key blocks)")


def live_ranges(body, names):
    """name -> its live ranges, (first, last) pairs of the statements numbered in the order
    they run (a block's copy one statement), over which each array of `names` holds
    something still to be read. A block's copy writes the whole tile, so a copy after the
    tile's reads starts a range of its own (a causal kernel's unmasked and diagonal key
    blocks each copy K and V: a range each); other writes may write a part, so they extend
    the range they are in."""
    uses, loops, count = {}, [], [0]

    def visit(stmts):
        for s in stmts:
            if isinstance(s, Loop) and not is_block_copy(s):
                start = count[0]
                visit(s.body)
                loops.append((start, count[0] - 1))
                continue
            copy = isinstance(s, Loop)
            for name, written, _ in shared_accesses(s, names):
                uses.setdefault(name, []).append((count[0], written, written and copy))
            count[0] += 1

    visit(body)
    ranges = {}
    for name, u in uses.items():
        spans = []
        for position, _, whole in u:
            if spans and not (whole and spans[-1][1] < position):
                spans[-1][1] = position
            else:
                spans.append([position, position])
        ranges[name] = [tuple(span) for span in spans]
    changed = True
    while changed:  # merging over one loop may reach into another
        changed = False
        for name, u in uses.items():
            for start, end in loops:
                inside = [written for p, written, _ in u if start <= p <= end]
                meeting = [(f, lst) for f, lst in ranges[name] if f <= end and start <= lst]
                # read in the loop before it is written there (what an iteration leaves
                # the next), or live into the loop or out of it: live over all of it
                if not (inside and (not inside[0] or any(f < start or lst > end
                                                         for f, lst in meeting))):
                    continue
                merged = (min(start, *(f for f, _ in meeting)),
                          max(end, *(lst for _, lst in meeting)))
                if meeting != [merged]:
                    ranges[name] = sorted([x for x in ranges[name] if x not in meeting]
                                          + [merged])
                    changed = True
    return {name: tuple(spans) for name, spans in ranges.items()}


def place(shared, body, element_bytes, bound_values, granule=16) -> SharedLayout:
    """The arrays `shared` (Buffers, in their order) of the statements `body` placed at
    elements of `element_bytes`, each at a multiple of `granule` bytes. bound_values: one
    substitution of the MAX_ symbols per compiled bound."""
    names = {b.name for b in shared}
    ranges = live_ranges(body, names)
    placed = {}  # name -> (offset, bytes)

    def at(e):
        return tuple(sympy.sympify(e).xreplace(v) for v in bound_values)

    def meet(a, b):
        (oa, na), (ob, nb) = a, b
        return any(x < y + m and y < x + n for x, n, y, m in zip(at(oa), at(na), at(ob), at(nb)))

    def together(a, b):
        return any(f <= last and first <= lst for f, lst in ranges[a] for first, last in ranges[b])

    for b in sorted(shared, key=lambda b: ranges[b.name][0]):
        size = granule * sympy.ceiling(sympy.Mul(*b.shape) * element_bytes / sympy.Integer(granule))
        if size.has(sympy.ceiling):  # of a size's bound (MAX_d): an integer division
            size = granule * idiv(sympy.Mul(*b.shape) * element_bytes + granule - 1, granule)
        live = [placed[n] for n in placed if together(n, b.name)]
        candidates = sorted({sympy.Integer(0)} | {o + n for o, n in live}, key=at)
        # past every live array's end fits at every bound: the last resort
        offset = next((c for c in candidates if not any(meet((c, size), o) for o in live)),
                      sympy.Max(*(o + n for o, n in live)))
        placed[b.name] = (sympy.expand(offset), size)
    arrays = tuple(SharedArray(b.name, placed[b.name][0], sympy.Mul(*b.shape)) for b in shared)
    total = sympy.Max(*(o + n for o, n in placed.values())) if placed else sympy.Integer(0)
    meets = tuple((a.name, tuple(b.name for b in arrays if meet(placed[a.name], placed[b.name])))
                  for a in arrays)
    return SharedLayout(element_bytes, arrays, total, meets)


# ---- Barriers --------------------------------------------------------------------
# The barriers of a tiled CUDA nest as IR statements (Barrier), from one pass over its
# shared accesses once its shared memory is laid out (Triton's membar pass is the model).
#
# A barrier goes before a statement that touches shared bytes an access since the last
# barrier touched through another thread's element, one of the two a write (a block's copy
# writes every thread's elements); two arrays whose bytes meet at some element size are one
# (a key block's V tile on its K tile). A thread loop is no loop on the GPU (each statement
# inside runs for all of a thread's slots before the next), so its statements are taken in
# order; a sequential loop's body starts with what the previous iteration left too (a
# barrier at its top orders the last iteration's reads before the next one's copy), and
# the loop may run no iteration, so what was pending before it is still pending after it.
# A barrier goes before a loop only where the body would otherwise need more barriers than
# with one there (one a block, not one an iteration): the loop over key blocks' barrier at
# its top, there for the last iteration's reads, orders Q's copy before any read of Q too.

def insert_barriers(onf: ONF) -> ONF:
    """onf with the barriers of each tiled nest (those with shared layouts) in its body."""
    nests = []
    for nest in onf.nests:
        grid, body = grid_chain(nest)
        if grid:
            nest = replace(nest, body=enclose(grid, with_barriers(body, nest.shared_layouts)))
        nests.append(nest)
    return replace(onf, nests=tuple(nests))


def with_barriers(stmts, layouts):
    """stmts (a block's, inside its grid) with their barriers, by the shared arrays of
    `layouts` (SharedLayout, one per element size)."""
    return _Barriers(layouts).block(stmts, (), ())[0]


class _Barriers:
    def __init__(self, layouts):
        self.shared = {a.name for layout in layouts for a in layout.arrays}
        self.meets = {}  # array -> the arrays whose bytes meet its at some element size
        for layout in layouts:
            for name, meeting in layout.meets:
                self.meets.setdefault(name, set()).update(meeting)

    def block(self, stmts, pending, around):
        """(stmts with barriers, the accesses pending after them); pending: the accesses
        since the last barrier before them, (array, written, owner) as shared_accesses
        gives them; around: the keys of the thread loops around stmts."""
        out = []
        for s in stmts:
            if isinstance(s, Loop) and not (is_thread_loop(s) or is_block_copy(s)):
                placed, pending = self.loop(s, pending, around)
                out += placed
                continue
            accesses = tuple(shared_accesses(s, self.shared, around))
            hazards = self.hazards(accesses, pending)
            if hazards:
                out.append(Barrier(hazards))
                pending = ()
            if is_thread_loop(s):
                body, pending = self.block(s.body, pending, around + (loop_key(s),))
                s = replace(s, body=body)
            out.append(s)
            pending = _union(pending, accesses)
        return out, pending

    def loop(self, loop, pending, around):
        """(the loop with its barriers, and one before it where needed; the accesses pending
        after it)."""
        carried = tuple(shared_accesses(loop, self.shared, around))  # the last iteration's
        body, end = self.block(loop.body, _union(pending, carried), around)
        if pending:
            alone, end_alone = self.block(loop.body, carried, around)
            if _count(body) > _count(alone):  # a barrier more an iteration: one before it
                return [Barrier(self.hazards(carried, pending)),
                        replace(loop, body=tuple(alone))], end_alone
        return [replace(loop, body=tuple(body))], _union(pending, end)  # no iteration

    def hazards(self, accesses, pending):
        """What each access has to wait for among the pending ones: another thread's access
        to bytes its array meets, one of the two a write."""
        found = {}
        for array, write, owner in accesses:
            for a, w, o in pending:
                if a in self.meets[array] and (w or write) and (o is None or o != owner):
                    found.setdefault(Hazard(a, _access(w, o), array, _access(write, owner)))
        return tuple(found)


def _access(written, owner):
    return "copied" if owner is None else "written" if written else "read"


def _count(stmts):
    return sum(isinstance(s, Barrier) for s in walk(stmts))


def _union(pending, accesses):
    return tuple(dict.fromkeys(pending + accesses))


# ---- Warp reductions -------------------------------------------------------------
# The warp reductions of a tiled CUDA nest as IR statements (LaneReduce): after a thread
# loop along x, each local its body accumulates and that is defined outside it (a row's max
# over the keys its lanes took) is combined across the lanes that took its iterations, so
# that every lane holds the total; the printer prints each as its shuffles.

def insert_lane_reductions(onf: ONF) -> ONF:
    """onf with a LaneReduce after each thread loop along x of a tiled nest for each local
    it accumulates across its lanes."""
    nests = []
    for nest in onf.nests:
        grid, body = grid_chain(nest)
        if grid:
            nest = replace(nest, body=enclose(grid, _block(body, {}, ())[0]))
        nests.append(nest)
    return replace(onf, nests=tuple(nests))


def _block(stmts, defined, around):
    """(stmts with their lane reductions; (local, op, the thread loops of its definition)
    of each update inside). defined: each local's thread loops (keys) at its latest
    definition so far, in the order the statements run."""
    out, updates = [], []
    for s in stmts:
        if isinstance(s, Let):
            defined[s.name] = around
        elif isinstance(s, Update) and s.name in defined:  # a local of the nest's
            updates.append((s.name, s.op, defined[s.name]))
        if not isinstance(s, Loop) or is_block_copy(s):
            out.append(s)
            continue
        inner = around + ((loop_key(s),) if is_thread_loop(s) else ())
        body, inside = _block(s.body, defined, inner)
        out.append(replace(s, body=tuple(body)))
        updates += inside
        if is_thread_loop(s) and s.gpu.axis == "x":
            partial = {name: op for name, op, keys in inside if loop_key(s) not in keys}
            out += [LaneReduce(name, op, s.gpu.threads) for name, op in partial.items()]
    return out, updates
