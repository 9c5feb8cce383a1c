"""Where a tiled nest's shared arrays lie in its block's shared memory: a SharedLayout
per element size, recorded on the nest (as realize closes an ONF) for the CUDA printer to
declare.

Each array is live from its first access to its last, in the order the block runs its
statements (a tile from each copy to its last read before the next copy), and over the
whole of a loop it is live into (a Q tile staged before the loop over key blocks) or that
reads it before writing it (what an iteration leaves the next).
Arrays are placed in the order they become live, each at the lowest 16-byte offset where
it overlaps no array live at the same time: a key block's V tile, copied once its scores
are taken, lands on the K tile it follows without a step saying so. Sizes are symbolic in
the compile-time bounds (MAX_d), so an offset must fit at every bound. The barriers then
keep one array's last reads before the next one's first writes wherever their bytes
meet."""
from dataclasses import replace

import sympy

from moagen.onf.loops import (ONF, Loop, SharedArray, SharedLayout, bound_symbol, grid_chain,
                              is_block_copy)
from moagen.onf.shared import shared_accesses

# the element sizes a CUDA kernel is printed for: float32, float64
ELEMENT_BYTES = (4, 8)


def lay_out_shared(onf: ONF) -> ONF:
    """onf with each tiled nest's SharedLayout at every element size: its shared arrays
    (those of onf.shared it touches) placed where they meet no array live at the same
    time, at every bound its grid is compiled for."""
    names = {b.name for b in onf.shared}
    nests = []
    for nest in onf.nests:
        grid, body = grid_chain(nest)
        if grid:
            touched = {a for s in body for a, _, _ in shared_accesses(s, names)}
            shared = [b for b in onf.shared if b.name in touched]
            bounds = [{bound_symbol(name): v}
                      for name, values in grid[-1].gpu.bounds for v in values] or [{}]
            nest = replace(nest, shared_layouts=tuple(place(shared, body, size, bounds)
                                                      for size in ELEMENT_BYTES))
        nests.append(nest)
    return replace(onf, nests=tuple(nests))


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


def place(shared, body, element_bytes, bound_values) -> SharedLayout:
    """The arrays `shared` (Buffers, in their order) of the statements `body` placed at
    elements of `element_bytes`. bound_values: one substitution of the MAX_ symbols per
    compiled bound."""
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
    arrays = tuple(SharedArray(b.name, placed[b.name][0], sympy.Mul(*b.shape)) for b in shared)
    total = sympy.Max(*(o + n for o, n in placed.values())) if placed else sympy.Integer(0)
    meets = tuple((a.name, tuple(b.name for b in arrays if meet(placed[a.name], placed[b.name])))
                  for a in arrays)
    return SharedLayout(element_bytes, arrays, total, meets)
