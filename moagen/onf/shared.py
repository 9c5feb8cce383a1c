"""Who touches a tiled nest's shared arrays: what the shared layout (when each array is
live) and the barriers (which accesses another thread's) are derived from."""
import sympy

from moagen.moa import scalar as S
from moagen.onf.loops import (Loop, Store, is_block_copy, is_thread_loop, loop_key, stmt_exprs,
                              walk)


def shared_accesses(s, shared, around=()):
    """(the shared array an access is to, whether written, owner) of each access inside s to
    one of `shared`; owner: the thread loops `around` it and inside s (their keys) and its
    index (two accesses with one owner are one thread's element), None for a block's copy
    (a write of the whole tile, or a read of all of it)."""
    if isinstance(s, Loop):
        if is_block_copy(s):
            for b in walk(s.body):
                # a copy out of a shared tile (WarpMma's output) reads all of it too
                for x in (x for e in stmt_exprs(b) for x in S.subexpressions(e)):
                    if isinstance(x, S.Load) and x.array in shared:
                        yield x.array, False, None
                if isinstance(b, Store) and b.array in shared:
                    yield b.array, True, None
            return
        inner = around + ((loop_key(s),) if is_thread_loop(s) else ())
        for b in s.body:
            yield from shared_accesses(b, shared, inner)
        return
    for x in (x for e in stmt_exprs(s) for x in S.subexpressions(e)):
        if isinstance(x, S.Load) and x.array in shared:
            yield x.array, False, (frozenset(around), x.array, sympy.expand(x.offset))
    if isinstance(s, Store) and s.array in shared:
        yield s.array, True, (frozenset(around), s.array, sympy.expand(s.index[0]))
