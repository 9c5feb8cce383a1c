"""The cost model: F, M, scratch and atomics read off the ONF; checked against a brute-force
walk of every loop iteration, against the series' formulas, and against cachegrind and the
SASS of the CUDA kernels."""
import json
import re
import shutil
from collections import Counter

import pytest
import sympy

from moagen.cli import main
from moagen.pipeline import onf_of
from moagen.cost import measure, model, sass
from moagen.cost.flops import stmt_ops
from moagen.cost.traffic import accesses, footprint, region
from moagen.cost.view import CAUSAL_ROWS_UNCUT, counting_view
from moagen.kernels import KERNELS, CompositeKernel, get_kernel
from moagen.moa import scalar as S
from moagen.moa.expr import idiv, sym
from moagen.onf.count import executions
from moagen.onf.interpret import index_fn
from moagen.onf.loops import ONF, Buffer, Loop, Nest, Store

B, H, N, D = (sym(s) for s in ("batch", "heads", "n", "d"))
# the packed batch's loops are bounded by its offsets' values: not modelled (tested below)
VARLEN = [k for k in KERNELS if k.startswith("attention_varlen")]
VARIANTS = [(k.name, v) for k in KERNELS.values() for v in k.variants_on("cpu")
            if k.name not in VARLEN]
ATTENTION_KERNELS = [k for k in KERNELS if k.startswith("attention")]
ATTENTION = dict(batch=1, heads=2, n=16, d=3)
# small, and multiples of the tiles (64 keys online, 16 slices split): the counting view's
# assumptions hold, so the model must be exact
TINY = {"attention_decode": dict(batch=1, q_heads=4, kv_heads=2, cap=20, d=3, n=16),
        **{k: dict(batch=1, kv_heads=1, group=2, n=16, d=3)
           for k in ("attention_gqa_fwd", "attention_gqa_fwd_causal", "attention_gqa_bwd",
                     "attention_gqa_bwd_causal")},
        # fewer queries than keys, causal bottom-right (offset n - n_q), masked (each batch
        # and head its mask, or one shared, float or bool), or padded
        **{k + c: dict(batch=1, kv_heads=1, group=2, n_q=5, n=16, d=3,
                       **({"offset": 11} if c == "_causal" else {}),
                       **({"last": 9} if c == "_padded" else {}))
           for k in ("attention_cross_fwd", "attention_cross_bwd")
           for c in ("", "_causal", "_masked", "_masked2d", "_bool2d", "_padded")},
        **{f"attention_dropout_{k}": dict(batch=1, kv_heads=1, group=2, n=16, d=3, seed=5)
           for k in ("fwd", "bwd", "fwd_causal", "bwd_causal")},
        "kv_append": dict(batch=2, kv_heads=2, cap=5, d=3, n=3),
        "rmsnorm_fwd": dict(batch=2, n=5, d=3),
        # rows a multiple of the 16 partial sums; register tiles of 6 rows x 8 columns, the
        # MLP's in blocks of 96 rows; the block's attention in key blocks of 64
        "rmsnorm_bwd": dict(batch=2, n=32, d=3), "rmsnorm_apply": dict(batch=2, n=5, d=3),
        # (a weight's gradient has the weight's rows: 24 is a multiple of both)
        "mlp_fwd": dict(batch=1, n=96, dm=24, dff=24), "mlp_bwd": dict(batch=1, n=96, dm=24, dff=24),
        **{k: dict(batch=1, n=6, dm=24, heads=1, dh=24)
           for k in ("qkv_proj", "qkv_proj_bwd", "out_proj", "out_proj_bwd")},
        "residual_add": dict(batch=2, n=3, dm=4),
        **{k: dict(batch=1, n=192, dm=24, heads=1, dh=24, dff=24) for k in ("block_fwd", "block_bwd", "block_fwd_causal", "block_bwd_causal")}}
COMPOSITES = [k for k, kernel in KERNELS.items() if isinstance(kernel, CompositeKernel)]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def tiny_sizes(kernel, variant):
    cost = model.predict(kernel, variant)
    # a size the call chooses at its least (decode grouped's w: 32 keys a warp)
    chosen = {name: 1 for name, _ in cost.chosen}
    sizes = dict(TINY.get(kernel, ATTENTION), **chosen)
    # online's key blocks (64 divides n), decode grouped's blocks of slices (128 w)
    tiles = [int(m[1]) * chosen.get(m[2], 1) for m in
             (re.fullmatch(r"(\d+)(?:\*(\w+))? divides n", a) for a in cost.assumptions)
             if m and m[2] in (None, *chosen)]
    if not (tiles and kernel in ATTENTION_KERNELS):
        return sizes
    # one head; decode: a cache of n rows
    n = max(tiles)
    fewer = {size: value for size, value in (("heads", 1), ("cap", n)) if size in sizes}
    return dict(sizes, n=n, d=2, **fewer)


# ---- the model against every iteration, walked ------------------------------------------

class Pass:
    """One pass over memory: an element is read from memory when its first access reads
    it, written back when it is written at all."""

    def __init__(self):
        self.first, self.written = {}, set()

    def touch(self, array, offset, reads, writes):
        self.first.setdefault((array, offset), "read" if reads else "written")
        if writes:
            self.written.add((array, offset))

    def moved(self):
        read = Counter(a for (a, _), kind in self.first.items() if kind == "read")
        return read, Counter(a for a, _ in self.written)


def brute_force(onf, sizes):
    """Operations by kind, and (read, written) elements per array with each nest a pass and
    with the whole call one pass, by executing every statement of the ONF at these sizes."""
    ops, ints, whole, passes = Counter(), dict(sizes), Pass(), []
    compiled = {}  # statement id -> (its operations, its accesses with offset functions)

    def walk(stmts, nest_pass):
        for s in stmts:
            if isinstance(s, Loop):
                for ints[s.var.name] in range(index_fn(s.start)(ints), index_fn(s.stop)(ints)):
                    walk(s.body, nest_pass)
                continue
            if id(s) not in compiled:
                compiled[id(s)] = (stmt_ops(s), [(a.array, index_fn(a.offset), a.reads, a.writes)
                                                 for a in accesses((s,))])
            kinds, touched = compiled[id(s)]
            ops.update(kinds)
            for array, offset, reads, writes in touched:
                for p in (nest_pass, whole):
                    p.touch(array, offset(ints), reads, writes)

    for nest in onf.nests:
        passes.append(Pass())
        walk(nest.body, passes[-1])
    read, written = Counter(), Counter()
    for p in passes:
        r, w = p.moved()
        read, written = read + r, written + w
    return ops, (read, written), whole.moved()


# KeyTiles writes a block's scores as register tiles of lanes plus the block's last keys,
# and the online softmax rewrites the row whole: the model takes the three regions of the
# scratch row as disjoint (twice its elements written), the iterations touch it once. A
# known over-count of M (docs/PERFORMANCE.md, "Known limits"), checked as that below, with
# the rest of the flash form's count exact at sizes its tiles divide. The owner's forward is
# in the flash form on a CPU (lanes > 0).
FLASH_FORM = {"flash", "owner"}
EXACT = [(k, v) for k, v in VARIANTS if k not in COMPOSITES and v not in FLASH_FORM]


@pytest.mark.parametrize("kernel,variant", EXACT)
def test_model_counts_what_every_iteration_does(kernel, variant):
    sizes = tiny_sizes(kernel, variant)
    cost = model.predict(kernel, variant)
    env = cost.sizes_from(sizes)
    ops, (read, written), (min_read, min_written) = brute_force(onf_of(kernel, variant), sizes)
    assert {op: model.value(n, env) for op, n in cost.ops.items()} == dict(ops)
    for array, moved in cost.traffic.items():
        assert model.value(moved.read, env) == read[array], array
        assert model.value(moved.written, env) == written[array], array
    for array, moved in cost.minimum.items():
        assert model.value(moved.read, env) == min_read[array], array
        assert model.value(moved.written, env) == min_written[array], array
    assert set(cost.traffic) == set(read) | set(written)


# tiles of 8 rows, which divide the sizes below (the CPU's 6 rows are the third case's)
EIGHT_ROWS = {"rows": 8, "lanes": 16}


@pytest.mark.parametrize("kernel, variant, params, sizes", [
    ("attention_fwd", "flash", EIGHT_ROWS, dict(batch=1, heads=1, n=64, d=16)),
    # two key blocks: the causal tiles' blocks below the diagonal, unmasked, and on it
    ("attention_fwd_causal", "flash", EIGHT_ROWS, dict(batch=1, heads=1, n=128, d=16)),
    # tiles of 6 rows across the blocks of 64 keys: periods of 192 rows
    ("attention_fwd_causal", "flash", {"rows": 6, "lanes": 8}, dict(batch=1, heads=1, n=192, d=8)),
    # the owner's causal forward: two blocks of 32 keys; its key rows' pass is counted
    # without the causal rows' cut (moagen.cost.view), an over-count
    *(("attention_fwdbwd" + c, "owner", EIGHT_ROWS, dict(batch=1, heads=1, n=64, d=16))
      for c in ("", "_causal")),
    # the padded backward: its key tiles past last walk no query row, counted as if they did
    # (at parts 0, its dQ pass stopped at last's key block, the model's sums take ~100 s)
    ("attention_cross_bwd_padded", "flash", EIGHT_ROWS,
     dict(batch=1, kv_heads=1, group=1, n_q=64, n=128, d=16, last=70))])
def test_model_counts_the_flash_form_but_its_score_row(kernel, variant, params, sizes):
    cost = model.predict(kernel, variant, params=params)
    env = cost.sizes_from(sizes)
    ops, (read, written), (min_read, min_written) = brute_force(
        onf_of(kernel, variant, params=params), sizes)
    uncut = CAUSAL_ROWS_UNCUT in cost.assumptions
    assert uncut == (kernel in ("attention_fwdbwd_causal", "attention_cross_bwd_padded"))
    same = (lambda model_n, walked: model_n >= walked) if uncut else \
        (lambda model_n, walked: model_n == walked)
    assert set(cost.ops) == set(ops)
    for op, n in cost.ops.items():
        assert same(model.value(n, env), ops[op]), op
    for array, moved in cost.traffic.items():
        assert same(model.value(moved.read, env), read[array]), array
        over = 2 if array == "probs" else 1  # the score row, counted twice (above)
        assert same(model.value(moved.written, env), over * written[array]), array
    for array, moved in cost.minimum.items():
        assert same(model.value(moved.read, env), min_read[array]), array
        assert same(model.value(moved.written, env), min_written[array]), array
    assert set(cost.traffic) == set(read) | set(written)


def test_bounds_dividing_a_tile_index_are_summed_by_periods():
    """Key blocks of a causal tile of 6 rows, [idiv(6 t + 1, 64), idiv(6 t + 7, 64) + 1):
    the counting view cuts t into periods of 32 tiles (192 rows), in which the bounds are
    linear, and the count is a closed form, equal to the iterations walked."""
    t, j = sym("t"), sym("j")
    blocks = Loop(j, idiv(6 * t + 1, 64), idiv(6 * t + 7, 64) + 1, (Store("x", (j,), S.Num(0.0)),))
    onf = ONF("blocks", "test", (), (Buffer("x", (N,)),), (), (N,), (),
              (Nest("x", (Loop(t, sympy.Integer(0), idiv(N + 5, 6), (blocks,)),), "x"),))
    view = counting_view(onf)
    assert "192 divides n" in view.assumptions
    count = executions(view.nests[0].body, lambda s: isinstance(s, Store))["x"]
    assert not count.atoms(sympy.Sum, idiv)
    for n in (192, 384, 960):
        walked = sum(max(0, (6 * i + 7) // 64 + 1 - (6 * i + 1) // 64) for i in range(n // 6))
        assert count.xreplace({N: n}) == walked


def test_regions_of_a_causal_prefix_a_query_group_and_a_tile():
    i, j, c, h, t = (sym(v) for v in ("i", "j", "c", "h", "j_blk"))
    zero = sympy.Integer(0)
    # K[j, c] for j <= i, over every i: the whole of K once, not n(n+1)/2 rows
    causal = ((i, zero, N), (j, zero, i + 1), (c, zero, D))
    assert region(c + D * j, causal)[1] == N * D
    # a KV head shared by a group of q_heads / kv_heads query heads
    q, kv = sym("q_heads"), sym("kv_heads")
    grouped = ((h, zero, q), (c, zero, D))
    assert sympy.simplify(region(c + D * idiv(h, q / kv), grouped)[1] - kv * D) == 0
    # rows of 64-row tiles, each tile's rows named j: all n rows, once
    tiled = ((t, zero, N / 64), (j, 64 * t, 64 * t + 64), (c, zero, D))
    assert sympy.simplify(region(c + D * j, tiled)[1] - N * D) == 0
    # two loops reaching one region under other names count it once
    stmts = [Loop(v, zero, N, (Loop(c, zero, D, (Store("O", (c + D * v,), S.Num(0.0)),)),))
             for v in (i, j)]
    assert footprint(accesses(stmts)) == N * D


# ---- the series' formulas -----------------------------------------------------------

def positive(e):
    return e.xreplace({s: sympy.Symbol(s.name, positive=True) for s in e.free_symbols})


@pytest.mark.parametrize("kernel", ["attention_fwd", "attention_fwd_causal"])
def test_only_the_naive_forward_moves_n_squared(kernel):
    whole = lambda e: e.replace(idiv, lambda a, b: a / b)  # flash's panels: n // 16 tiles
    degree = {v: sympy.Poly(whole(model.predict(kernel, v).M), N).degree()
              for v in KERNELS[kernel].variants_on("cpu")}
    assert degree == {"naive": 2, "dnf": 1, "online": 1, "flash": 1}
    assert sympy.Poly(model.predict(kernel, "naive").M_min, N).degree() == 2


def test_naive_over_dnf_traffic_grows_like_n_over_d():
    ratio = positive(model.predict("attention_fwd", "naive").M / model.predict("attention_fwd", "dnf").M)
    symbols = {s.name: s for s in ratio.free_symbols}
    n, d = symbols["n"], symbols["d"]
    per_n_over_d = sympy.limit(ratio * d / n, n, sympy.oo)
    assert per_n_over_d.is_positive and per_n_over_d.free_symbols <= {d}
    large_d = sympy.limit(per_n_over_d, d, sympy.oo)
    assert large_d.is_positive and large_d.is_finite  # neither grows nor vanishes with d


@pytest.mark.parametrize("variant, params, parts, panels", [
    ("atomic", None, 0, 0), ("owner", None, 1, 4), ("owner", {"lanes": 0}, 1, 0),
    ("owner", {"parts": 0, "lanes": 0}, 0, 0)])
def test_fused_forward_backward_moves_4nd_in_and_4nd_out(variant, params, parts, panels):
    """The owner with the CPU's defaults (dQ from the key rows' pass, which read K and V in
    another index form than the forward, into one part of dQ: nd more written; K, V, Q and
    dO copied into the register tiles' panels: 4nd more), without the tiles, and with dQ in
    its own pass (the GPU's)."""
    cost = model.predict("attention_fwdbwd", variant, params=params)
    read = sum(m.read for m in cost.minimum.values())
    written = sum(m.written for m in cost.minimum.values())
    assert sympy.expand(read - 4 * B * H * N * D) == 0
    rest = sympy.expand(written - (4 + parts + panels) * B * H * N * D)
    assert rest != 0 and D not in rest.free_symbols  # lse (and delta): a number per row
    assert sympy.Poly(cost.M, N).degree() == 1


def test_rmsnorm_moves_x_in_z_out_and_a_number_a_row_and_naive_reads_x_twice():
    """The series' 4nd is forward and backward (x, dz in; z, dx out); the forward's share
    is x in and z out, plus the weights (which the series leaves out) and the per-row
    statistic it keeps for the backward. naive makes the statistic a pass of its own."""
    dnf, naive = (model.predict("rmsnorm_fwd", v) for v in ("dnf", "naive"))
    n, d, batch = sym("n"), sym("d"), sym("batch")
    assert sympy.expand(dnf.M_min - 8 * (2 * batch * n * d + d + batch * n)) == 0
    assert sympy.expand(dnf.M - dnf.M_min) == 0
    assert sympy.expand(naive.M_min - dnf.M_min) == 0
    assert sympy.expand(naive.M - dnf.M - 8 * (batch * n * d + batch * n)) == 0


@pytest.mark.parametrize("variant, passes", [("naive", 2), ("dnf", 1)])
def test_rmsnorm_backward_reads_x_and_dz_once_when_dx_runs_inside_the_parts(variant, passes):
    """naive: dx reads x, dz and the statistic, dweight's partial sums read them again; dnf
    computes a row's dx inside the part that sums it. The only scratch is 16 partial rows
    of d."""
    cost = model.predict("rmsnorm_bwd", variant)
    n, d, batch = sym("n"), sym("d"), sym("batch")
    # x, dz, dx, the statistic; weight, dweight and the partial rows once
    assert sympy.expand(cost.M_min - 8 * (3 * batch * n * d + batch * n + 2 * d + 16 * d)) == 0
    for array in ("x", "dz"):
        assert sympy.expand(cost.traffic[array].read - passes * batch * n * d) == 0
    assert sympy.expand(cost.scratch_bytes - 8 * 16 * d) == 0
    assert not cost.atomics


def test_atomics_fused_is_twice_the_separate_backward_and_owner_has_none():
    fused = model.predict("attention_fwdbwd", "atomic").atomics
    separate = model.predict("attention_bwd", "atomic").atomics
    assert set(fused) == {"dK", "dV"} and set(separate) == {"dK"}
    assert sympy.simplify(sum(fused.values()) / sum(separate.values())) == 2
    assert model.predict("attention_fwdbwd", "owner").atomics == {}


@pytest.mark.parametrize("variant", KERNELS["attention_decode"].variants)
def test_decode_reads_the_valid_rows_of_each_kv_head_once(variant):
    traffic = model.predict("attention_decode", variant).traffic
    for cache in ("K", "V"):
        assert sympy.expand(traffic[cache].read - B * sym("kv_heads") * N * D) == 0


# the plain forward and the causal backward: the other two compose the same stages' twins
# the same way (and each takes a quarter of a minute)
@pytest.mark.parametrize("kernel", ["block_fwd", "block_bwd_causal"])
def test_a_composite_costs_what_its_stages_cost(kernel):
    """The block's operations are its stages' (each brute-force checked above), sizes
    renamed: composing adds and loses no work."""
    composite = get_kernel(kernel).composite
    total = Counter()
    for stage in composite.stages:
        rename = {sym(s): sym(b) for s, b in stage.sizes.items()}
        for op, count in model.predict(stage.kernel, stage.variant).ops.items():
            total[op] += count.xreplace(rename)
    ops = model.predict(kernel).ops
    assert set(ops) == set(total)
    assert all(sympy.expand(ops[op] - total[op]) == 0 for op in ops)


# the cost model's sums over key blocks bounded by a Min of the offset or the last key:
# minutes each, the causal one left with sums it cannot evaluate; the causal dropout
# backward's over key tiles of 8 (Philox's groups) bounded by the diagonal: 130 s
# (docs/PERFORMANCE.md, "Known limits")
SLOW_COST_MODEL = {("attention_cross_fwd_causal", "flash"), ("attention_cross_fwd_padded", "flash"),
                   ("attention_dropout_bwd_causal", "flash")}


@pytest.mark.parametrize("kernel,variant", [kv for kv in VARIANTS if kv not in SLOW_COST_MODEL])
def test_traffic_is_never_below_the_minimum(kernel, variant):
    cost = model.predict(kernel, variant)
    env = cost.sizes_from(dict(tiny_sizes(kernel, variant)))
    for array, least in cost.minimum.items():
        moved = cost.traffic[array]
        assert model.value(moved.read, env) >= model.value(least.read, env)
        assert model.value(moved.written, env) >= model.value(least.written, env)


# ---- the command ---------------------------------------------------------------------

@pytest.mark.parametrize("kernel", [k for k in KERNELS if k not in VARLEN and not any(
    (k, v) in SLOW_COST_MODEL for v in KERNELS[k].variants)])
def test_cost_prints_f_m_scratch_and_atomics_of_every_variant(capsys, kernel):
    code, out, _ = run(capsys, "cost", kernel)
    assert code == 0
    blocks = out.split("\n\n")
    for variant in KERNELS[kernel].variants_on("cpu"):
        block = next(b for b in blocks if f"{kernel}, variant {variant} " in b)
        labels = {line.split()[0] for line in block.splitlines()[1:] if line.startswith("  ") and line.split()}
        assert {"F", "M", "M_min", "scratch", "atomics"} <= labels


def test_cost_json_values_are_the_expressions_at_the_sizes(capsys):
    """Read as the JSON's notation says (the flash variant's panels are sized with idiv)."""
    code, out, _ = run(capsys, "cost", "attention_bwd", "--json", *(f"-D{k}={v}" for k, v in ATTENTION.items()))
    assert code == 0
    for record in json.loads(out)["costs"]:
        assert "idiv(a, b)" in record["notation"]
        sizes = {sympy.Symbol(k): v for k, v in record["sizes"].items()}
        for key in ("F", "M", "M_min", "scratch"):
            expr = sympy.sympify(record[key]["expr"], locals={"idiv": idiv})
            assert expr.xreplace(sizes) == record[key]["value"]


@pytest.mark.parametrize("argv,message", [
    (["cost", "rmsnorm_fwd", "-D", "batch=1", "-D", "n=2", "-D", "d=3", "-D", "m=4"], "no size m"),
    (["cost", "rmsnorm_fwd", "-D", "batch=1", "-D", "n=2"], "missing: -D d="),
    (["cost", "rmsnorm_fwd", "-D", "n"], "cannot read 'n'"),
    (["cost", "rmsnorm_fwd", "--sweep", "n=1,x"], "cannot read 'n=1,x'"),
    (["cost", "rmsnorm_fwd", "--variant", "online"], "no variant 'online'"),
    (["cost", "rmsnorm_fwd", "--measure"], "--measure needs sizes"),
    (["cost", "kv_append", "-D", "batch=1", "-D", "kv_heads=1", "-D", "cap=4", "-D", "d=3",
      "-D", "n=4"], "the cache is full"),
])
def test_cost_errors(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and not out
    assert err.startswith("moagen: error: ") and message in err


# ---- measured: cachegrind -----------------------------------------------------------

needs_valgrind = pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind not installed")
# 4 heads of n <= 128 rows, d = 16: a head's K and V (32 KiB) fit a 64 KiB last level, the
# arrays (>= 128 KiB together) do not
SMALL_LL = measure.CacheConfig(ll_bytes=64 * 1024)
SMALL = dict(batch=1, heads=4, d=16)


def measured_and_predicted(variant, sizes):
    cost = model.predict("attention_fwd", variant)
    env = cost.sizes_from(sizes)
    counts = measure.measure("attention_fwd", variant, sizes, cache=SMALL_LL)
    fits = model.value(cost.itemsize * cost.working_set, env) <= SMALL_LL.ll_bytes
    return counts.ll_bytes(SMALL_LL.line), model.value(cost.M, env), fits


@needs_valgrind
def test_cachegrind_traffic_of_row_wise_attention_is_within_2x_of_m():
    for variant in ("dnf", "online"):
        measured, predicted, fits = measured_and_predicted(variant, dict(SMALL, n=128))
        assert fits and predicted / 2 <= measured <= 2 * predicted, variant


@needs_valgrind
def test_cachegrind_traffic_of_naive_attention_grows_like_n_squared():
    (small, _, _), (large, predicted, fits) = (measured_and_predicted("naive", dict(SMALL, n=n))
                                               for n in (64, 128))
    assert large / small > 3  # n doubled: 4x for the n^2 part, 2x for the rest
    assert fits and predicted / 2 <= large <= 2 * predicted


@needs_valgrind
def test_cachegrind_traffic_exceeds_m_where_the_working_set_does_not_fit():
    # one head of 512 rows: its K and V (128 KiB) no longer fit, and every row reads them
    measured, predicted, fits = measured_and_predicted("dnf", dict(SMALL, heads=1, n=512))
    assert not fits and measured > 4 * predicted


def test_parse_reads_the_summary_line():
    text = ("desc: I1 cache: 32768 B, 64 B, 8-way associative\ncmd: ./driver call\n"
            "events: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw\nfl=x.c\nfn=main\n1 2 0 0 0 0 0 0 0 0\n"
            "summary: 100 1 1 40 4 3 20 2 1\n")
    counts = measure.parse(text)
    assert (counts.Ir, counts.Dr, counts.Dw, counts.DLmr, counts.DLmw) == (100, 40, 20, 3, 1)
    assert counts.ll_bytes(64) == 4 * 64


# ---- measured: SASS -----------------------------------------------------------------


@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump not installed")
def test_sass_atomics_sit_where_the_onf_puts_them():
    # the separate backward (the fused kernels' passes, at a third of their build time) at
    # one arch: each arch's build is test_codegen's
    atomic = sass.inspect("attention_bwd", "atomic", archs=("sm_90",))
    assert {r.arch for r in atomic} == {"sm_90"}
    for r in atomic:
        if r.onf_atomics:  # the rows pass: atomic updates of dK in its SASS
            assert set(r.onf_atomics) == {"dK"} and r.sass_atomics >= 1
        else:
            assert r.sass_atomics == 0
    assert any(r.onf_atomics for r in atomic)
    scatter_free = sass.inspect("attention_bwd", "dnf", archs=("sm_90",))
    assert scatter_free and sum(r.sass_atomics for r in scatter_free) == 0


@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump not installed")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_flash_forwards_products_unroll_as_a_hand_written_kernels(dtype):
    """attention_fwd flash at d <= 64 (#66): the innermost loop with the most FMA does a
    thread's 4 x 4 tile four times a back-edge (UnrollInner), FMA at least 70% of its
    instructions, its operands from shared memory by 128-bit loads."""
    (rows,) = [r for r in sass.inspect("attention_fwd", "flash", dtype, archs=("sm_90",))
               if r.name.endswith("<64>")]
    hottest = max(rows.loops, key=lambda loop: loop.fma)
    assert hottest.fma >= 64 and hottest.fma >= 0.7 * hottest.instructions
    assert hottest.counts["LDS"] == hottest.lds_128
    assert rows.spill_stores == rows.spill_loads == 0


@pytest.mark.parametrize("params", [{"parts": 1, "rows": 4, "keys": 2, "lanes": 0},
                                    {"parts": 2, "rows": 2, "keys": 2, "lanes": 0}])
def test_model_counts_a_tuned_schedule_as_it_runs(params):
    """The owner with parts (dQ from the key rows' pass, blocks of 64 key rows): the model
    of that schedule, not of the defaults, against every iteration walked. n = 128: the
    parts' blocks of 64 key rows are full (the view's assumptions). Without the register
    tiles, whose count is checked above."""
    sizes = dict(batch=1, heads=1, n=128, d=2)
    cost = model.predict("attention_fwdbwd", "owner", params=params)
    env = cost.sizes_from(sizes)
    ops, (read, written), _ = brute_force(onf_of("attention_fwdbwd", "owner", params=params),
                                          sizes)
    assert {op: model.value(n, env) for op, n in cost.ops.items()} == dict(ops)
    for array, moved in cost.traffic.items():
        assert model.value(moved.read, env) == read[array], array
        assert model.value(moved.written, env) == written[array], array
    own_pass = model.predict("attention_fwdbwd", "owner", params={"parts": 0, "lanes": 0})
    assert model.value(own_pass.flops, env) > model.value(cost.flops, env)


@pytest.mark.parametrize("kernel", VARLEN)
def test_a_kernel_bounded_by_its_offsets_is_not_modelled(capsys, kernel):
    """Its counts depend on the offsets' values, not on its sizes: refused, not guessed."""
    with pytest.raises(model.NotModelled, match="bounded by the values of cu_k, cu_q"):
        model.predict(kernel, "dnf")
    code, _, err = run(capsys, "cost", kernel)
    assert code != 0 and "not modelled" in err
