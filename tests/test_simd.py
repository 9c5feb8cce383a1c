"""SIMD marks: which innermost loops the compiler is told to vectorize, with which
reductions, and which it is not (lanes that would interfere)."""
import sympy

from moagen.emit import emit
from moagen.pipeline import onf_of
from moagen.moa import scalar as S
from moagen.moa.expr import sym
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, walk
from moagen.steps.loop.simd import MarkSimd, simd_clauses

I, N = sym("i"), sym("n")


def _loops(kernel, variant=None, params=None):
    return [s for n in onf_of(kernel, variant, params=params).nests for s in walk(n.body)
            if isinstance(s, Loop)]


def test_dot_products_are_simd_reductions_in_both_languages():
    qk = [lp for lp in _loops("attention_fwd", "dnf") if lp.simd and "qk" in simd_clauses(lp)]
    assert qk and simd_clauses(qk[0]) == " reduction(+:qk)"
    assert "#pragma omp simd reduction(+:qk)" in emit("attention_fwd", "dnf", "c")
    assert "!$omp simd reduction(+:qk)" in emit("attention_fwd", "dnf", "fortran")
    assert "omp simd" not in emit("attention_fwd", "dnf", "cuda")


def test_unrolled_rows_share_one_vectorized_loop():
    """Four query rows of online attention: four sums in one loop, and four rows of O
    updated in one loop, a whole row apart."""
    four = {"rows": 4, "keys": 4}
    clauses = [simd_clauses(lp) for lp in _loops("attention_fwd", "online", four) if lp.simd]
    assert " reduction(+:qk_0, qk_1, qk_2, qk_3)" in clauses
    pv = [lp for lp in _loops("attention_fwd", "online", four) if lp.simd
          and sum(isinstance(s, Store) and s.array == "O" for s in lp.body) == 4]
    assert pv


def test_atomic_updates_and_register_tiles_are_left_alone():
    atomic = [lp for lp in _loops("attention_fwdbwd", "atomic")
              if any(isinstance(s, Store) and s.atomic for s in lp.body)]
    assert atomic and not any(lp.simd for lp in atomic)
    tiles = [lp for lp in _loops("mlp_fwd", "tiled") if lp.vector_tile]
    assert tiles and not any(lp.simd for lp in tiles)
    assert not any(lp.simd for lp in _loops("mlp_fwd", "tiled") if lp.parallel)


def _one_loop(*body):
    loop = Loop(I, sympy.Integer(1), N, tuple(body))
    onf = ONF("t", "v", (Buffer("x", (N,)),), (Buffer("y", (N,)),), (), (N,), (),
              (Nest("y", (Let("s", S.Num(0.0)), loop), "test"),), flat=True)
    return MarkSimd()(onf).nests[0].body[1]


def test_lanes_that_would_interfere_are_not_vectorized():
    x, y = S.Load("x", I), S.Load("y", I)
    assert _one_loop(Store("y", (I,), S.Bin("*", x, x))).simd  # elementwise
    assert _one_loop(Update("s", "+", x)).simd  # a sum
    assert simd_clauses(_one_loop(Update("s", "max", x))) == " reduction(max:s)"
    assert not _one_loop(Update("s", "=", x)).simd  # a running value: order matters
    assert not _one_loop(Store("y", (sympy.Integer(0),), x, accumulate="+")).simd  # same element
    assert _one_loop(Store("y", (I,), x, accumulate="+")).simd  # each lane its own element
    assert not _one_loop(Store("y", (I,), S.Load("y", I - 1))).simd  # the previous lane's
    assert _one_loop(Store("y", (I,), S.Bin("+", y, x))).simd  # its own element only
    apart = S.Load("y", I + N - 1)  # one loop extent (n - 1) further: another row
    assert _one_loop(Store("y", (I,), x), Store("y", (I + N - 1,), S.Bin("+", apart, x))).simd
    assert not _one_loop(Store("y", (I,), x), Store("y", (I + 1,), x)).simd  # lanes overlap


BLK = sym("i_blk")


def _rows_marked(start, gap, dims=(N,), sizes=(N,)):
    """Whether a loop over a block's rows i in [start, min(n, 64 i_blk + 64)) storing two
    rows of a scratch `gap` apart is marked; dims: the input's shape (its symbols at least 1
    in every call), sizes: the kernel's."""
    loop = Loop(I, start, sympy.Min(N, 64 * BLK + 64), (
        Store("y", (I - 64 * BLK,), S.Load("x", I)),
        Store("y", (I - 64 * BLK + gap,), S.Load("x", I))))
    onf = ONF("t", "v", (Buffer("x", dims),), (Buffer("y", (N,)),), (), sizes, (),
              (Nest("y", (loop,), "test"),), flat=True)
    return MarkSimd()(onf).nests[0].body[0].simd


def test_rows_of_a_block_scratch_apart_by_the_blocks_length_are_vectorized():
    """Two rows of a block's scratch, 64 apart, stored over the block's rows from 64 i_blk
    or later (a causal block's rows past its keys: Max(64 i_blk, k)) to at most 64 i_blk +
    64: at most 64 iterations, so the rows' ranges never meet. From k alone no such bound
    holds, and the loop is left to the compiler."""
    k = sym("k")
    assert _rows_marked(64 * BLK, 64)
    assert _rows_marked(16 * sympy.Max(4 * BLK, k), 64)
    assert not _rows_marked(16 * k, 64)


def test_rows_a_multiple_of_a_size_apart_are_vectorized():
    """A block's scratch with a row per query head of a group: its rows 64 group apart,
    group an input's dimension (at least 1 in every call), so at least the 64 iterations the
    loop runs. A symbol that is no input's dimension (a count given at call time, possibly
    0) proves nothing."""
    group, given = sym("group"), sym("given")
    marked = lambda gap: _rows_marked(64 * BLK, gap, (group, N), (group, N, given))
    assert marked(64 * group)
    assert not marked(64 * given)
    assert not marked(32 * group)


def test_rows_min_n_b_apart_are_vectorized():
    """The online softmax's scratch rows are min(n, 64) long (a value the C compiler does
    not know): over a block's at most min(n, 64) keys (at most 64, at most n - 64 i_blk <= n:
    a loop variable is never negative) two rows' ranges never meet. Rows min(n, 32) apart
    would meet, and from k alone no bound holds."""
    assert _rows_marked(64 * BLK, sympy.Min(N, 64))
    assert _rows_marked(64 * BLK, -3 * sympy.Min(N, 64))
    assert not _rows_marked(64 * BLK, sympy.Min(N, 32))
    assert not _rows_marked(16 * sym("k"), sympy.Min(N, 64))
    # n a count given at call time (decode's cache length), possibly 0: a loop then runs
    # no iteration, and over any other n the rows are as far apart
    assert _rows_marked(64 * BLK, 3 * sympy.Min(N, 64), dims=(sym("cap"),))


def test_rows_a_group_of_min_n_b_apart_are_vectorized():
    """A block's scratch with a row per query head of a group and a key of the jammed tile
    (the owner's t_block): rows group min(n, 64) apart, a whole multiple of the at most
    min(n, 64) rows the loop runs (of min(64, n, 64 i_blk + 64) on a causal block, whose
    rows start at Max(64 i_blk, k)), which sympy does not order. A multiple of min(n, 32),
    or by a count given at call time (possibly 0), proves nothing."""
    group, given = sym("group"), sym("given")
    marked = lambda start, gap: _rows_marked(start, gap, (group, N), (group, N, given))
    assert marked(64 * BLK, group * sympy.Min(N, 64))
    assert marked(64 * BLK, -3 * group * sympy.Min(N, 64))
    assert marked(8 * sympy.Max(8 * BLK, sym("k")), group * sympy.Min(N, 64))
    assert not marked(64 * BLK, group * sympy.Min(N, 32))
    assert not marked(64 * BLK, given * sympy.Min(N, 64))


def test_the_owners_draws_and_exponentials_are_vectorized():
    """The owner's pass over a block's rows that takes P and dS from the jammed keys' scores
    (the exponentials; with dropout its draws, a Philox run a lane) is vectorized, plain or
    causal, grouped or not."""
    for kernel in ("attention_gqa_bwd", "attention_dropout_bwd", "attention_dropout_bwd_causal"):
        draws = [s for s in _loops(kernel, "flash") if any(
            isinstance(e, S.Dropout) or isinstance(e, S.Un) and e.fn.startswith("exp")
            for b in s.body if isinstance(b, Let)
            for e in S.subexpressions(b.value))]
        assert draws and all(loop.simd for loop in draws), kernel


def test_the_flash_forwards_block_passes_stay_vectorized():
    """attention_fwd flash: its score rows min(n, B) long, and every loop over a block's
    keys but the register tiles' vectorized (the exponentials included: a scalar exp per
    key made the float32 kernel 1.3x slower)."""
    onf = onf_of("attention_fwd", "flash")
    probs = next(b for b in onf.temps if b.name == "probs")
    assert probs.shape[-1] == sympy.Min(N, 64)
    keys = [lp for n in onf.nests for lp in walk(n.body) if isinstance(lp, Loop)
            and lp.var.name == "j" and not lp.vector_tile
            and not any(isinstance(s, Loop) for s in lp.body)]
    exps = [lp for lp in keys if any(isinstance(s, Store) and s.array == "probs" and
                                     "exp" in str(s.value) for s in lp.body)]
    # 3 passes in each of the row tiles, the edge's tiles and the rows left alone
    assert len(keys) == 9 and exps and all(lp.simd for lp in keys)


def _marked(*body):
    loop = Loop(I, sympy.Integer(1), N, tuple(body))
    onf = ONF("t", "v", (Buffer("x", (N,)),), (Buffer("y", (N,)),), (), (N,), (),
              (Nest("y", (loop,), "test"),), flat=True)
    return MarkSimd()(onf).nests[0].body


def test_a_vectorized_loops_invariant_reads_are_loaded_before_it():
    """x[0], the same element in every iteration, is loaded once into a local before the
    loop (gcc, unable to prove a store misses it, reloads it in the loop's latch and then
    does not vectorize); x[i] stays in the loop."""
    first = S.Load("x", sympy.Integer(0))
    let, loop = _marked(Store("y", (I,), S.Bin("*", S.Load("x", I), first)))
    assert let == Let(let.name, first) and loop.simd
    assert loop.body == (Store("y", (I,), S.Bin("*", S.Load("x", I), S.Local(let.name))),)
    # a loop that is not vectorized is left as it is
    unmarked = Update("s", "=", first)
    assert _marked(unmarked) == (Loop(I, sympy.Integer(1), N, (unmarked,)),)


def test_rmsnorm_backward_reads_the_row_statistic_once_a_row():
    """The loop that writes dx and adds into dweight's parts reads inv_rms[row] from a local
    loaded before it."""
    source = emit("rmsnorm_bwd", "dnf", "c")
    loops = [part.split("}")[0] for part in source.split("#pragma omp simd\n")[1:]]
    dx = [body for body in loops if "dx[" in body and "dweight_part[" in body]
    assert len(dx) == 2  # float64, float32
    assert all("inv_rms_at" in body and "inv_rms[" not in body for body in dx)
    assert "const double inv_rms_at = inv_rms[b*n + i];" in source
