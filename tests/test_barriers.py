"""Where the barrier pass (moagen.steps.gpu.closing) puts a tiled nest's barriers, on
bodies written by hand: none before a loop whose top barrier orders what was pending
before it, one after a loop that may run no iteration for what was pending before it,
and one before a loop where the body would need one more an iteration without it (the
reasons each barrier gives: tests/test_gpu_tiles.py)."""
import sympy

from moagen.moa import scalar as S
from moagen.onf.loops import Barrier, BlockCopy, Buffer, Loop, Store
from moagen.steps.gpu.closing import place, with_barriers

e, k, kb, n = sympy.symbols("e k kb n", integer=True)
ZERO = sympy.Integer(0)


def _copy(tile):
    return Loop(e, ZERO, sympy.Integer(8), (Store(tile, (e,), S.Num(1.0)),), gpu=BlockCopy("xy"))


def _read(tile):
    return Store("out", (k,), S.Load(tile, k))


def _barriers(stmts):
    """stmts with their barriers, as text: B for a barrier, loops in brackets."""
    out = []
    for s in stmts:
        if isinstance(s, Barrier):
            out.append("B")
        elif isinstance(s, Loop) and s.gpu is None:
            out.append(f"[{' '.join(_barriers(s.body))}]")
        else:
            out.append(f"copy {s.body[0].array}" if isinstance(s, Loop) else f"read {s.value.array}")
    return out


def _placed(body):
    """The body's barriers, Q and K tiles of 8 elements in shared memory."""
    layout = place([Buffer("Q", (8,)), Buffer("K", (8,))], body, 8, [{}])
    return " ".join(_barriers(with_barriers(body, (layout,))))


def test_a_loop_s_top_barrier_orders_what_was_pending_before_it():
    """Q's copy is ordered before the loop's read of Q by the barrier at the loop's top
    (there for the last block's reads of K): no barrier before the loop. The loop may run
    no block, so Q's read after it still waits for a barrier."""
    body = (_copy("Q"), Loop(kb, ZERO, n, (_copy("K"), _read("K"), _read("Q"))), _read("Q"))
    assert _placed(body) == "copy Q [B copy K B read K read Q] B read Q"


def test_a_barrier_before_a_loop_that_would_need_one_each_iteration():
    """A loop that only reads tiles copied before it: one barrier before it, not one at its
    top each block; a loop that reads Q first and copies K after needs one at its top
    anyway (the last block's reads of K), which orders Q's copy too."""
    reads = (_copy("Q"), _copy("K"), Loop(kb, ZERO, n, (_read("Q"), _read("K"))))
    assert _placed(reads) == "copy Q copy K B [read Q read K]"
    copies = (_copy("Q"), Loop(kb, ZERO, n, (_read("Q"), _copy("K"), _read("K"))))
    assert _placed(copies) == "copy Q [B read Q copy K B read K]"
