"""Where a tiled kernel's shared arrays lie in its block's shared memory.

Each array is live from its first access to its last, in the order the block runs its
statements (a tile from each copy to its last read before the next copy), and over the
whole of a loop it is live into (a Q tile staged before the loop over key blocks) or that
reads it before writing it (what an iteration leaves the next).
Arrays are placed in the order they become live, each at the lowest 16-byte offset where
it overlaps no array live at the same time: a key block's V tile, copied once its scores
are taken, lands on the K tile it follows without a step saying so. Sizes are symbolic in
the compile-time bounds (MAX_d), so an offset must fit at every bound. TiledKernel's
barriers then keep one array's last reads before the next one's first writes wherever
their bytes meet."""
import sympy

from moagen.moa import scalar as S
from moagen.onf.loops import Loop, Store, is_block_copy, is_thread_loop, walk


def shared_accesses(s, shared, around=()):
    """(the shared array an access is to, whether written, owner) of each access inside s to
    one of `shared`; owner: the thread loops `around` it and inside s (their keys) and its
    index (two accesses with one owner are one thread's element), None for a block's copy
    (a write of the whole tile)."""
    if isinstance(s, Loop):
        if is_block_copy(s):
            for b in walk(s.body):
                if isinstance(b, Store) and b.array in shared:
                    yield b.array, True, None
            return
        inner = around + ((loop_key(s),) if is_thread_loop(s) else ())
        for b in s.body:
            yield from shared_accesses(b, shared, inner)
        return
    for x in S.subexpressions(s.value):
        if isinstance(x, S.Load) and x.array in shared:
            yield x.array, False, (frozenset(around), x.array, sympy.expand(x.offset))
    if isinstance(s, Store) and s.array in shared:
        yield s.array, True, (frozenset(around), s.array, sympy.expand(s.index[0]))


def loop_key(loop):
    """A thread loop as an owner names it: its mapping, variable and range."""
    return (loop.gpu, loop.var, loop.start, loop.stop)


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


def allocate(shared, body, element_bytes, bound_values):
    """([(name, byte offset, element count)] of the arrays `shared`, in their order; the
    bytes in all; name -> the names whose bytes meet its at some bound, its own included).
    bound_values: one substitution of the MAX_ symbols per compiled bound."""
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
        size = 16 * sympy.ceiling(sympy.Mul(*b.shape) * element_bytes / sympy.Integer(16))
        live = [placed[n] for n in placed if together(n, b.name)]
        candidates = sorted({sympy.Integer(0)} | {o + n for o, n in live}, key=at)
        # past every live array's end fits at every bound: the last resort
        offset = next((c for c in candidates if not any(meet((c, size), o) for o in live)),
                      sympy.Max(*(o + n for o, n in live)))
        placed[b.name] = (sympy.expand(offset), size)
    layout = [(b.name, placed[b.name][0], sympy.Mul(*b.shape)) for b in shared]
    total = sympy.Max(*(o + n for o, n in placed.values())) if placed else sympy.Integer(0)
    meets = {a: frozenset(b for b in placed if meet(placed[a], placed[b])) for a in placed}
    return layout, total, meets
