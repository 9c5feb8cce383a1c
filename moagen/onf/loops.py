"""The loop-nest IR of the Operational Normal Form.

An ONF is a list of nests, one per DNF definition, each a tree of statements:
`Loop` (with an optional parallel mark), `Let` (a new local scalar), `Update` (a local
accumulated in place), `Store` (an array element written or accumulated). Expressions are
moagen.moa.scalar nodes. The steps (moagen.steps) map one ONF to the next; moagen.onf.dump
prints one.
"""
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Tuple, Union

import sympy
from sympy.core.function import AppliedUndef

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import simplified


class Stmt:
    pass


@dataclass(frozen=True)
class Grid:
    """A loop of a tiled CUDA kernel (moagen.steps.gpu) whose iterations are thread blocks
    (blockIdx; BlockTiles). `bounds`: the compile-time bounds of sizes the kernel is
    specialized for (d <= 64, 128, ...)."""
    bounds: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()

    def __str__(self):
        return "grid"


@dataclass(frozen=True)
class Threads:
    """A loop over a block's threads along `axis`, "x" or "y" (ThreadTiles): `threads` of
    them, each taking `tile` consecutive iterations, and as many more such tiles,
    `threads * tile` apart, as the loop's extent needs."""
    axis: str
    threads: int
    tile: int = 1
    # >0: `threads` warps along the axis, each taking `tile` iterations as tensor-core
    # fragments of `fragment` that its 32 lanes hold together (WarpMma): on axis x a warp's
    # lanes are 32 consecutive threads, so the block has 32 x `threads` of them along x
    fragment: int = 0
    # a loop of loads only, each thread's tile of them as 16-byte vector loads (VectorLoads);
    # how it loads, not which iterations it owns: out of the comparison, so that its loop
    # has the same key (loop_key) as the loops that read what it loaded
    vector: bool = field(default=False, compare=False)

    def __str__(self):
        if self.fragment:
            return f"warp.{self.axis}({self.threads} x {self.tile} in {self.fragment})"
        return f"thread.{self.axis}({self.threads} x {self.tile}{', vector' if self.vector else ''})"

    @property
    def block_threads(self) -> int:
        """The block's threads along the axis."""
        return self.threads * 32 if self.fragment and self.axis == "x" else self.threads


@dataclass(frozen=True)
class Operand:
    """A product's operand as a warp loads its fragments (WarpMma): the shared tile it is
    read from, laid out "row" (the fragment's rows apart by `ldm` elements, its columns
    consecutive) or "col" major; ldm an int, or an expression of compile-time bounds
    (MAX_d + 4: a tile padded past a head's bound)."""
    array: str
    major: str
    ldm: Union[int, sympy.Expr]


@dataclass(frozen=True)
class Mma:
    """The loop of a sum whose body, acc += a * b (or several such terms, acc += a' * b'
    ...), each warp runs as tensor-core products of fragments (WarpMma): `shape` (m, n, k) a
    product, `k` steps of the sum at a time, each term's operands' fragments loaded from
    its shared tiles (`terms`: (a, b) a term, a m x k, b k x n), acc's fragments stored
    (once the sum is done) into the shared tile `c` (m x n, row major).
    precision: "f64" (DMMA), "3xtf32" (float32 by three TF32 products: each operand split
    into a TF32 high and low part, a_lo b_hi + a_hi b_lo + a_hi b_hi), "tf32" (one product
    of the operands rounded to TF32)."""
    shape: Tuple[int, int, int]
    terms: Tuple[Tuple[Operand, Operand], ...]
    c: Operand
    precision: str

    def __str__(self):
        m, n, k = self.shape
        return f"mma.{self.precision}({m}x{n}x{k})"


@dataclass(frozen=True)
class BlockCopy:
    """A loop of a block's copy into shared memory (Stage), over the block's threads along
    `axis`: "x" (consecutive threads on consecutive elements), "y", or "xy" (all of them,
    flat: a 1-D tile). vector: the x loop of a copy whose groups of 4 consecutive elements
    are each read by one thread's 16-byte load (Stage's vector option states when)."""
    axis: str
    vector: bool = False

    def __str__(self):
        return f"block-copy.{self.axis}{'(vector)' if self.vector else ''}"


@dataclass(frozen=True)
class Unrolled:
    """A loop each of a block's threads runs itself (a register tile's products: the sum
    over d of a score), unrolled `factor` times in the printed kernel (UnrollInner)."""
    factor: int

    def __str__(self):
        return f"unroll({self.factor})"


# where a loop runs in a CUDA thread block
GpuMark = Union[Grid, Threads, BlockCopy, Unrolled, Mma]


@dataclass(frozen=True)
class SharedArray:
    """Where one shared array lies in a block's dynamic shared memory: its first byte and
    how many elements it holds (in the MAX_ symbols of the compiled bounds)."""
    name: str
    offset: sympy.Expr
    count: sympy.Expr


@dataclass(frozen=True)
class SharedLayout:
    """A tiled nest's shared arrays in its block's dynamic shared memory at elements of
    `element_bytes` (moagen.steps.gpu.closing places them; the CUDA printer declares
    them so): each array's place, in the order of ONF.shared; the bytes in all; `meets`,
    per array, the arrays whose bytes meet its at some compiled bound (itself included), as
    one array to a barrier (a key block's V tile on its K tile)."""
    element_bytes: int
    arrays: Tuple[SharedArray, ...]
    total: sympy.Expr
    meets: Tuple[Tuple[str, Tuple[str, ...]], ...]


def bound_symbol(size: str) -> sympy.Symbol:
    """MAX_<size>: the compile-time bound a tiled CUDA kernel is specialized at for a size
    (GpuMark.bounds), in the index expressions of what is laid out to it."""
    return sympy.Symbol(f"MAX_{size}", integer=True, positive=True)


@dataclass(frozen=True)
class Loop(Stmt):
    var: sympy.Symbol
    start: sympy.Expr
    stop: sympy.Expr
    body: Tuple[Stmt, ...]
    parallel: int = 0  # >0: this loop and the (parallel - 1) loops nested in it run in parallel
    # a parallel loop's iterations go to the threads in turn, one at a time (OpenMP static
    # chunks of 1), where by default each thread takes one contiguous block of them
    interleave: bool = False
    # the body is already vector code (a register tile's columns): the compiler's loop
    # vectorizer must not vectorize this loop across its iterations instead
    vector_tile: bool = False
    simd: bool = False  # vectorized by the compiler with its reductions (moagen.steps.loop.simd)
    threads: int = 0  # a parallel loop on a GPU: threads a thread block (GpuThreads)
    # a parallel loop on a GPU: a thread block per iteration, not a thread (GpuBlocks) ...
    per_block: bool = False
    # ... whose threads share the iterations of this loop inside it
    across_threads: bool = False
    gpu: Optional[GpuMark] = None  # a loop of a tiled CUDA kernel (moagen.steps.gpu)


@dataclass(frozen=True)
class Let(Stmt):
    name: str
    value: S.ScalarExpr


@dataclass(frozen=True)
class Update(Stmt):
    name: str
    op: str  # "+" or "max" (accumulate), or "=" (assign)
    value: S.ScalarExpr


@dataclass(frozen=True)
class Store(Stmt):
    array: str
    index: Tuple[sympy.Expr, ...]  # a multi-index until the layout step, then (offset,)
    value: S.ScalarExpr
    accumulate: Optional[str] = None  # None: plain store; "+" / "max": accumulate
    atomic: bool = False  # an accumulation other parallel iterations may race with


@dataclass(frozen=True)
class Hazard:
    """Two accesses to a block's shared bytes by different threads, one a write, that a
    barrier orders: `array` `access`ed ("copied" by the block, "written" or "read"), then
    `then_array` as `then`."""
    array: str
    access: str
    then_array: str
    then: str


@dataclass(frozen=True)
class Barrier(Stmt):
    """__syncthreads() in a tiled CUDA nest: every thread of the block waits here for the
    others (moagen.steps.gpu.closing puts it); `hazards`: what it orders, the accesses
    that wait for it and those they wait for."""
    hazards: Tuple[Hazard, ...] = ()

    @property
    def why(self) -> str:
        """`rows_K_tile copied after rows_K_tile copied and read, rows_V_tile read`: each
        access that waits, after what."""
        waits = {}  # (then_array, then) -> {array: its accesses waited for}
        for h in self.hazards:
            waits.setdefault((h.then_array, h.then), {}).setdefault(h.array, []).append(h.access)
        return "; ".join(f"{array} {access} after " + ", ".join(
            f"{a} {' and '.join(accesses)}" for a, accesses in before.items())
            for (array, access), before in waits.items())


@dataclass(frozen=True)
class LaneReduce(Stmt):
    """A thread's local `name`, accumulated by `op` ("+" or "max") in a thread loop along x
    whose iterations `lanes` consecutive lanes of a warp took, combined across those lanes
    by butterfly shuffles (__shfl_xor_sync), so that each ends with the total
    (moagen.steps.gpu.closing puts it after the loop)."""
    name: str
    op: str
    lanes: int


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: Tuple[sympy.Expr, ...]
    element: str = ""  # an input's element type: "" the kernel's float, "int64" (moa.expr.Array)
    offsets_into: Optional[sympy.Expr] = None  # offsets: the extent they cut (moa.expr.offsets)


@dataclass(frozen=True)
class Nest:
    target: str  # the array the nest defines
    body: Tuple[Stmt, ...]
    origin: str  # the DNF line it came from, printed as a comment above the nest
    name: str = ""  # how schedules refer to it, when not by its target
    # a tail nest (the iterations past a nest's last full tile) names the nest it is the
    # tail of, and the parent's loops it runs under other names (i_tile -> i): a mapping of
    # the parent (its parallel loops) applies to its tails through these
    parent: str = ""
    renames: Tuple[Tuple[str, str], ...] = ()
    # a tiled CUDA nest's shared memory, one layout per element size (4, 8 bytes)
    shared_layouts: Tuple[SharedLayout, ...] = ()

    @property
    def label(self):
        return self.name or self.target


@dataclass(frozen=True)
class ONF:
    name: str
    variant: str
    inputs: Tuple[Buffer, ...]
    outputs: Tuple[Buffer, ...]
    temps: Tuple[Buffer, ...]
    sizes: Tuple[sympy.Symbol, ...]
    scalars: Tuple[str, ...]
    nests: Tuple[Nest, ...]
    layout: str = "row"
    schedule: Tuple[str, ...] = ()  # the transformations applied, for the dump
    inout: Tuple[str, ...] = ()  # inputs the kernel updates in place
    # a CUDA thread block's own arrays, in shared memory (moagen.steps.gpu.staging): a
    # block's tile of an input, its scratch; not arguments of the kernel
    shared: Tuple[Buffer, ...] = ()
    flat: bool = False  # True once the layout step turned every index into an offset
    # (name, choose) of each size a step added that a binding chooses where the caller
    # gives none (moagen.steps.algebra.given)
    chosen: Tuple[Tuple[str, Callable], ...] = ()

    def with_nests(self, nests, step=None):
        schedule = self.schedule + ((step,) if step else ())
        return replace(self, nests=tuple(nests), schedule=schedule)


# ---- generic walks -------------------------------------------------------------------

def is_grid(s: Stmt) -> bool:
    return isinstance(s, Loop) and isinstance(s.gpu, Grid)


def is_thread_loop(s: Stmt) -> bool:
    return isinstance(s, Loop) and isinstance(s.gpu, Threads)


def is_fragment_loop(s: Stmt) -> bool:
    return is_thread_loop(s) and s.gpu.fragment > 0


def is_block_copy(s: Stmt) -> bool:
    return isinstance(s, Loop) and isinstance(s.gpu, BlockCopy)


def grid_chain(nest: "Nest"):
    """The nest's grid loops, outermost first, and the statements inside them."""
    chain, body = [], nest.body
    while len(body) == 1 and is_grid(body[0]):
        chain.append(body[0])
        body = body[0].body
    return chain, body


def grid_bounds(stmts):
    """The size bounds a tiled nest's grid is compiled for (BlockTiles' Grid mark), () where
    there are none."""
    return next((lp.gpu.bounds for lp in walk(stmts) if is_grid(lp) and lp.gpu.bounds), ())


def loop_key(loop: Loop):
    """A thread loop as an owner of elements and registers names it: its mapping, variable
    and range (one thread runs every loop with the same key alike)."""
    return (loop.gpu, loop.var, loop.start, loop.stop)


def max_extent(loop: Loop):
    """The most iterations the loop can have, a whole number, or None: its extent where
    constant, else the least constant one of a min() stop allows."""
    extent = simplified(loop.stop - loop.start)
    if extent.is_Integer:
        return int(extent)
    stops = loop.stop.args if isinstance(loop.stop, sympy.Min) else ()
    constant = [int(e) for e in (simplified(a - loop.start) for a in stops) if e.is_Integer]
    return min(constant) if constant else None


def most_iterations(loop: Loop, bounds):
    """The most iterations of the loop at compile time: max_extent where a whole number,
    else its extent in the MAX_ symbols of the sizes `bounds` names (a grid's
    GpuMark.bounds), or None where it depends on another size."""
    most = max_extent(loop)
    if most is not None:
        return sympy.Integer(most)
    bounded = {name for name, _ in bounds}
    extent = sympy.expand(loop.stop - loop.start).xreplace(
        {x: bound_symbol(x.name) for x in (loop.stop - loop.start).free_symbols
         if x.name in bounded})
    return None if extent.free_symbols - {bound_symbol(n) for n in bounded} else extent


def stmt_exprs(s: Stmt):
    if isinstance(s, (Let, Update, Store)):
        return (s.value,)
    return ()


def map_stmt_exprs(s: Stmt, fn) -> Stmt:
    """A copy of s (recursively) with fn applied to every expression it holds."""
    if isinstance(s, Loop):
        return replace(s, body=tuple(map_stmt_exprs(b, fn) for b in s.body))
    if isinstance(s, (Let, Update, Store)):
        return replace(s, value=fn(s.value))
    return s  # a barrier or a lane reduction holds no expression


def subs_stmts(stmts, at: dict):
    """stmts with index symbols substituted (sympy Symbol -> expression) in loop bounds,
    store indices and every expression."""
    def sub(s):
        if isinstance(s, Loop):
            return replace(s, start=s.start.xreplace(at), stop=s.stop.xreplace(at),
                           body=tuple(sub(b) for b in s.body))
        s = map_stmt_exprs(s, lambda e: S.subs(e, at))
        if isinstance(s, Store):
            return replace(s, index=tuple(sympy.sympify(i).xreplace(at) for i in s.index))
        return s

    return tuple(sub(s) for s in stmts)


def tails(onf: "ONF", label: str):
    """(tail nest, {parent loop name: the tail's}) for every tail of nest label, tails of
    tails included, the renames composed."""
    found = []
    for n in onf.nests:
        if n.parent == label:
            renames = dict(n.renames)
            found.append((n, renames))
            found += [(t, {k: inner.get(v, v) for k, v in renames.items()} | inner)
                      for t, inner in tails(onf, n.label)]
    return found


def loop_nest(stmts):
    """(the perfectly nested loops stmts start with, outermost first; the body inside them)."""
    chain = []
    while len(stmts) == 1 and isinstance(stmts[0], Loop):
        chain.append(stmts[0])
        stmts = stmts[0].body
    return chain, stmts


def perfect_chain(stmts, count):
    """The first `count` loops of a perfectly nested chain starting at stmts, or None."""
    chain = []
    while len(chain) < count and len(stmts) == 1 and isinstance(stmts[0], Loop):
        chain.append(stmts[0])
        stmts = stmts[0].body
    return chain if len(chain) == count else None


def parallel_chain(loop):
    """A parallel loop and the loops collapsed with it, outermost first."""
    chain = [loop]
    while len(chain) < loop.parallel:
        chain.append(chain[-1].body[0])
    return chain


def enclose(loops, body):
    """body (a tuple of statements) inside copies of the given loops, outermost first."""
    for lp in reversed(loops):
        body = (replace(lp, body=tuple(body)),)
    return tuple(body)


def scratch_row(who, hint, loops, keys, block, names, temps, offsets=None):
    """A new scratch array with a row per iteration of `loops` for one block of the loop
    `keys` (a block of keys' scores), added to temps; (its name, the row's index). A row
    holds min(keys' stop, block) values: a short sequence's rows take only its keys, and
    their stride is then a value the C compiler does not know. Knowing it (B), gcc 12 takes
    a register tile's reads of several rows for one group and reads each value it
    broadcasts by loading a vector from its row and broadcasting the first lane: a
    vector-unit instruction more per broadcast and loads across cache lines
    (docs/PERFORMANCE.md, "The flash forward's tiles"). The loops must run from 0 to bounds
    that do not depend on each other, and keys' stop on none of them, but where a bound is
    a sequence's extent read from the kernel's `offsets` (offsets_of): its rows are then
    the packed rows (packed_rows), and keys' stop bounded by the rows the offsets cut."""
    row, extents = packed_rows(loops, offsets or {})
    outer = {x.var for x in loops}
    bounded = sequence_extent(keys.stop, offsets or {})
    size = sympy.Min(bounded[1] if bounded else keys.stop, block)
    if any(lp.start != 0 for lp in loops) or any(e.free_symbols & outer for e in extents) or \
            size.free_symbols & outer:
        raise ScheduleError(f"{who}: the loops around the keys are not rectangular from 0: no "
                            "scratch row per iteration to keep a block's values in")
    name = names.claim(names.new(hint))
    temps.append(Buffer(name, extents + (size,)))
    return name, row


def offsets_of(onf) -> dict:
    """The kernel's offsets inputs (moa.expr.offsets): name -> the extent they cut."""
    return {b.name: b.offsets_into for b in onf.inputs if b.offsets_into is not None}


def sequence_extent(stop, offsets):
    """(cu(v), into) where stop is cu(v + 1) - cu(v), sequence v's extent read from offsets
    cu (of `offsets`, offsets_of's) that cut `into` rows; else None."""
    for first in sympy.sympify(stop).atoms(AppliedUndef):
        cu, args = first.func, first.args
        if cu.__name__ in offsets and len(args) == 1 and isinstance(args[0], sympy.Symbol) \
                and sympy.expand(stop - cu(args[0] + 1) + first) == 0:
            return first, offsets[cu.__name__]
    return None


def bounded_extents(e, offsets):
    """e with each sequence extent in it (sequence_extent) replaced by the rows its offsets
    cut, a bound on it (the most iterations a sequence's loop runs)."""
    if not offsets:
        return e
    return sympy.sympify(e).replace(
        lambda x: isinstance(x, sympy.Add) and sequence_extent(x, offsets) is not None,
        lambda x: sequence_extent(x, offsets)[1])


def packed_rows(loops, offsets):
    """(the index, the extents) of a row per iteration of `loops`: each loop's variable over
    its stop, but for a loop i over sequence v's rows (sequence_extent), v among the loops,
    neither: the row cu(v) + i of the rows the offsets cut, in i's place (where a packed
    array holds it: every sequence's rows, each once)."""
    found = {lp.var: sequence_extent(lp.stop, offsets) for lp in loops}
    packed = {var: extent for var, extent in found.items()
              if extent and extent[0].args[0] in found}
    sequences = {first.args[0] for first, _ in packed.values()}
    kept = [lp for lp in loops if lp.var not in sequences]
    return (tuple(packed[lp.var][0] + lp.var if lp.var in packed else lp.var for lp in kept),
            tuple(packed[lp.var][1] if lp.var in packed else lp.stop for lp in kept))


def rewrite_loops(stmts, selects, rewrite, scope=frozenset()):
    """(stmts with every loop at any depth that `selects(loop)` accepts replaced by the
    statements `rewrite(loop, scope)` returns, scope the names of the loops around it; how
    many were rewritten). A rewritten loop's body is not searched further."""
    out, count = [], 0
    for s in stmts:
        if isinstance(s, Loop) and selects(s):
            out += rewrite(s, scope)
            count += 1
        elif isinstance(s, Loop):
            body, inner = rewrite_loops(s.body, selects, rewrite, scope | {s.var.name})
            out.append(replace(s, body=body))
            count += inner
        else:
            out.append(s)
    return tuple(out), count


def ancestors(stmts, target, around=()):
    """The loops around statement `target` (by identity) within stmts, outermost first, or
    None."""
    for s in stmts:
        if s is target:
            return around
        if isinstance(s, Loop):
            found = ancestors(s.body, target, around + (s,))
            if found is not None:
                return found
    return None


def walk(stmts):
    """Every statement, depth first, loops before their bodies."""
    for s in stmts:
        yield s
        if isinstance(s, Loop):
            yield from walk(s.body)


def loop_vars(stmts) -> set:
    """The variables of every loop in stmts, nested ones included."""
    return {s.var.name for s in walk(stmts) if isinstance(s, Loop)}


def defined_names(stmts) -> frozenset:
    """Locals introduced (Let) or modified (Update), and loop variables, anywhere in stmts."""
    names = set()
    for s in walk(stmts):
        if isinstance(s, (Let, Update)):
            names.add(s.name)
        elif isinstance(s, Loop):
            names.add(s.var.name)
        elif isinstance(s, Store):
            names.add("@" + s.array)
    return frozenset(names)


def arrays_read(stmts) -> set:
    """The arrays the statements' expressions read (by index, or by offset after layout)."""
    return {e.array for s in walk(stmts) for x in stmt_exprs(s)
            for e in S.subexpressions(x) if isinstance(e, (S.Access, S.Load))}


def names_read(stmts) -> set:
    """The names the statements' expressions depend on (locals among them)."""
    return {name for s in walk(stmts) for x in stmt_exprs(s) for name in S.free_names(x)}


def local_names(onf: ONF) -> frozenset:
    return frozenset(s.name for n in onf.nests for s in walk(n.body) if isinstance(s, Let))
