"""A variant in three layers (algorithm, loop schedule, mapping per target), its defaults per
target, the names steps create (one rule; the caller never spells them), tails that inherit
their parent's mapping, and reduction lowering as a step of its own."""
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import sympy

from moagen.errors import ScheduleError
from moagen.kernels import KERNELS, get_kernel
from moagen.kernels.layers import Layers, cpu
from moagen.moa import scalar as S
from moagen.moa.expr import sym
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, walk
from moagen.onf.realize import _check_tails_mapped, realize
from moagen.pipeline import onf_of
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import GpuThreads, Parallel
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.unroll import UnrollJam
from moagen.steps.step import Step

I, J, K, N, M = sym("i"), sym("j"), sym("k"), sym("n"), sym("m")
KERNELS_DIR = Path(__file__).resolve().parent.parent / "moagen" / "kernels"


def _rows(body_var=K):
    """y[j, i] = sum_k x[j, i, k], as loops over j, i around a local sum."""
    body = (Let("s", S.Num(0.0)),
            Loop(body_var, sympy.Integer(0), M, (Update("s", "+", S.Access("x", (J, I, body_var))),)),
            Store("y", (J, I), S.Local("s")))
    nest = Nest("y", (Loop(J, sympy.Integer(0), N, (Loop(I, sympy.Integer(0), N, body),)),), "y")
    return ONF("rows", "test", (Buffer("x", (N, N, M)),), (Buffer("y", (N, N)),), (), (N, M), (),
               (nest,))


def _parallel_loops(nest):
    return [s.var.name for s in walk(nest.body) if isinstance(s, Loop) and s.parallel]


def test_a_tail_inherits_its_parents_parallel_loops_under_its_own_names():
    jam = UnrollJam("y", "i", 4)
    onf = Parallel(("j", jam.tiles), nest="y", interleave=True)(jam(_rows()))
    nests = {n.label: n for n in onf.nests}
    assert set(nests) == {"y", jam.edge}
    assert _parallel_loops(nests["y"]) == ["j"] and nests["y"].body[0].parallel == 2
    edge = nests[jam.edge].body[0]
    assert (edge.var.name, edge.parallel, edge.interleave) == ("j", 2, True)
    assert edge.body[0].var.name == "i"  # the tail's own name for i_tile
    x = np.random.default_rng(0).standard_normal((7, 7, 3))
    np.testing.assert_allclose(run_onf(onf, {"x": x}, {})["y"], x.sum(2), rtol=1e-14)


def test_a_tail_left_sequential_is_refused():
    """A parent mapped by loops its tail does not start with (a mark set by hand here; a
    register tile's column tiles in the kernels) leaves the tail on one thread."""
    jam = UnrollJam("y", "i", 2)
    onf = jam(_rows())
    parent = onf.nests[0]
    marked = Nest(parent.target, (replace(parent.body[0], parallel=1),), parent.origin)
    with pytest.raises(ScheduleError, match="y.edge \\(a tail of y\\) has no parallel loops"):
        _check_tails_mapped(onf.with_nests([marked, onf.nests[1]]))


def test_a_step_claims_exactly_the_name_it_promises():
    onf = _rows()
    taken = onf.with_nests([Nest("y", (Loop(sym("i_tile"), sympy.Integer(0), N,
                                            onf.nests[0].body),), "y")])
    with pytest.raises(ScheduleError, match="loop name i_tile is taken"):
        UnrollJam("y", "i", 2)(taken)


def test_a_step_that_needs_loops_refuses_unlowered_reductions():
    sums = Nest("y", (Loop(I, sympy.Integer(0), N, (Store("y", (I,), S.Reduction(
        "+", K, M, S.Access("x", (I, K)), "s")),)),), "y")
    onf = ONF("sums", "test", (Buffer("x", (N, M)),), (Buffer("y", (N,)),), (), (N, M), (),
              (sums,))
    with pytest.raises(ScheduleError, match="lower them first"):
        UnrollJam("y", "i", 2)(onf)
    lowered = LowerReductions()(onf)
    assert lowered.schedule == ("lower_reductions()",)
    assert UnrollJam("y", "i", 2)(lowered).schedule[-1] == "unroll_jam(y, i, 2)"


def test_layers_refuse_a_step_of_another_layer():
    with pytest.raises(ScheduleError, match="schedule layer holds parallel"):
        Layers(schedule=(Parallel(("i",)),), mapping=cpu())
    with pytest.raises(ScheduleError, match="mapping layer holds hoist"):
        Layers(mapping=cpu(Hoist()))
    with pytest.raises(ScheduleError, match="for the CPU at least"):
        Layers(mapping={"cuda": ()})


def test_cuda_mapping_is_derived_from_the_cpu_one_where_a_variant_gives_none():
    layers = Layers(mapping=cpu(Parallel(("b", "h"), nest="O", interleave=True)))
    assert layers.mapping_for("cuda") == (GpuThreads(("b", "h"), nest="O"),)
    with pytest.raises(ScheduleError, match="no mapping for target 'tpu'"):
        layers.mapping_for("tpu")


def test_every_step_shares_one_base_and_names_its_layer():
    for kernel in KERNELS.values():
        for target in ("cpu", "cuda"):
            for variant in kernel.variants_on(target).values():
                steps = variant.steps(target=target)
                assert all(isinstance(s, Step) and s.layer in ("algorithm", "schedule",
                                                                "mapping") for s in steps)


def test_online_attention_maps_differently_per_target():
    cpu_onf = onf_of("attention_fwd", "online", target="cpu")
    gpu_onf = onf_of("attention_fwd", "online", target="cuda")
    assert any(s.startswith("parallel(b, h, i_tile, interleaved") for s in cpu_onf.schedule)
    assert any(s.startswith("gpu_threads(b, h, i_tile, 128 a block") for s in gpu_onf.schedule)
    first = lambda onf: next(s for s in walk(onf.nests[0].body) if isinstance(s, Loop))
    assert (first(cpu_onf).interleave, first(cpu_onf).threads) == (True, 0)
    assert (first(gpu_onf).interleave, first(gpu_onf).threads) == (False, 128)


def test_defaults_per_target():
    owner = get_kernel("attention_fwdbwd").variant("owner")
    assert owner.defaults_for("cpu")["parts"] == 1  # the key rows' pass adds into dQ's parts
    assert owner.defaults_for("cuda")["parts"] == 0  # a thread per query row in dQ's pass
    assert owner.params({"parts": 2}, "cuda")["parts"] == 2
    cpu_nests = [n.label for n in onf_of("attention_fwdbwd", "owner").nests]
    gpu_nests = [n.label for n in onf_of("attention_fwdbwd", "owner", target="cuda").nests]
    assert "dQ.merge" in cpu_nests and "dQ" not in cpu_nests
    assert "dQ" in gpu_nests and "dQ.merge" not in gpu_nests


def test_upto_gives_the_onf_after_that_many_steps():
    kernel = get_kernel("attention_fwd")
    steps = kernel.variant("online").steps()
    after_one = kernel.onf("online", upto=1)
    assert after_one.schedule == (str(steps[0]),)
    assert not after_one.flat  # as the step left it: gamma comes with the final form
    everything = kernel.onf("online", upto=len(steps) + 1)  # the closing lower_reductions too
    assert everything.schedule == kernel.onf("online").schedule


def test_no_kernel_module_spells_a_name_a_step_invents():
    spelled = re.compile(r'"i_blk"|"j_in"|_tile"|\.edge"|\.zero"|\.merge"|\.partial"|"p"|'
                         r'j_blk2|"s"\)|"m_tile"')
    found = [f"{path.name}:{n}: {line.strip()}" for path in sorted(KERNELS_DIR.glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if spelled.search(line)]
    assert found == []


def test_realize_records_the_closing_reduction_lowering():
    onf = realize(get_kernel("attention_fwd").dnf("dnf"), "dnf",
                  get_kernel("attention_fwd").variant("dnf").steps())
    assert onf.schedule[-1] == "lower_reductions()" and onf.flat


def test_the_cuda_launch_takes_the_threads_a_block_its_mapping_gives():
    from moagen.targets.cuda.printer import emit_cuda
    kernel = get_kernel("attention_fwd")
    steps = kernel.variant("dnf").layers().algorithm + (GpuThreads(("b", "h", "i"), nest="rows",
                                                                   block=64),)
    onf = realize(kernel.dnf("dnf"), "dnf", steps)
    source = emit_cuda([("float64", onf)], ["test"])
    assert "count = batch*heads*n, threads = 64;" in source
    assert "threads = 128" in emit_cuda([("float64", onf_of("attention_fwd", "dnf", target="cuda"))],
                                        ["test"])



# (on CUDA the MLP's products and the projections' are GEMM blocks: tests/test_gpu_gemm.py)
@pytest.mark.parametrize("kernel, nest, tiles", [("qkv_proj_bwd", "dX", ("b", "m_tile",
                                                                         "i_tile"))])
def test_a_gpu_runs_a_thread_per_register_tile(kernel, nest, tiles):
    """The CPU runs a thread per column (or block of rows) of tiles, OpenACC's GPU a thread
    per tile (each tile a thread's own outputs)."""
    loops = lambda target: [s for s in walk(next(n.body for n in onf_of(kernel, "tiled",
                                                                           target=target).nests
                                                     if n.label == nest))
                            if isinstance(s, Loop)]
    on_gpu = loops("openacc")
    assert on_gpu[0].parallel == len(tiles)
    assert [lp.var.name for lp in on_gpu[:len(tiles)]] == list(tiles)
    assert loops("cpu")[0].parallel < len(tiles)


def test_the_mlp_a_thread_per_tile_keeps_its_value():
    """Run in order by the interpreter at sizes no tile divides: every tile's outputs are
    written (the edge nests take the columns past the last tile). OpenACC's mapping, a
    vector lane a tile (CUDA's row products are GEMM blocks, which the interpreter does
    not model: the CUDA emulation verifies them)."""
    rng = np.random.default_rng(4)
    X, Wg, Wu, Wd = (rng.standard_normal(s) for s in ((2, 7, 5), (5, 11), (5, 11), (11, 5)))
    got = run_onf(onf_of("mlp_fwd", "tiled", target="openacc"),
                  {"X": X, "Wg": Wg, "Wu": Wu, "Wd": Wd}, {})
    U = X @ Wg
    np.testing.assert_allclose(got["U"], U, rtol=1e-13)
    np.testing.assert_allclose(got["F"], (U / (1 + np.exp(-U)) * (X @ Wu)) @ Wd, rtol=1e-12)
