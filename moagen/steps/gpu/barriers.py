"""The barriers of a tiled CUDA nest as IR statements (Barrier), from one pass over its
shared accesses once its shared memory is laid out (Triton's membar pass is the model).

A barrier goes before a statement that touches shared bytes an access since the last
barrier touched through another thread's element, one of the two a write (a block's copy
writes every thread's elements); two arrays whose bytes meet at some element size are one
(a key block's V tile on its K tile). A thread loop is no loop on the GPU (each statement
inside runs for all of a thread's slots before the next), so its statements are taken in
order; a sequential loop's body starts with what the previous iteration left too (a
barrier at its top orders the last iteration's reads before the next one's copy), and
the loop may run no iteration, so what was pending before it is still pending after it.
A barrier goes before a loop only where the body would otherwise need more barriers than
with one there (one a block, not one an iteration): the loop over key blocks' barrier at
its top, there for the last iteration's reads, orders Q's copy before any read of Q too."""
from dataclasses import replace

from moagen.onf.loops import (ONF, Barrier, Hazard, Loop, enclose, grid_chain, is_block_copy,
                              is_thread_loop, loop_key, walk)
from moagen.onf.shared import shared_accesses


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
