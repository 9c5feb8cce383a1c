"""The chain rule over composites (moagen.kernels.chain): the block's backward derived from
its forward, a derivation run against PyTorch autograd, and what it refuses."""
import numpy as np
import pytest
import torch

from moagen.errors import SpecError
from moagen.kernels import get_kernel, projections, rmsnorm
from moagen.kernels.block import BACKWARD, CAUSAL_BACKWARD, CAUSAL_FORWARD, FORWARD
from moagen.kernels.chain import backward, role, vjp
from moagen.kernels.compose import Composite, Stage, compose
from moagen.moa.expr import array
from moagen.onf.interpret import run_onf
from moagen.pipeline import onf_of

RULES = {**rmsnorm.CHAIN, **projections.CHAIN}


def test_the_block_backward_is_the_forward_stages_reversed():
    assert get_kernel("block_fwd_vjp").composite is BACKWARD
    backwards = [st for st in BACKWARD.stages if role(st) == "backward"]
    assert [st.label for st in backwards] == [st.label for st in reversed(FORWARD.stages)
                                              if st.kernel != "residual_add"]
    # x / r of both norms recomputed from the kept statistics, never kept
    assert [st.arrays["z"] for st in BACKWARD.stages if role(st) == "recompute"] == ["xn2", "xn1"]
    assert not {"xn1", "xn2"} & set(FORWARD.kept())
    # the residuals' cotangents: dy plus the norm's term, the attention branch's plus the norm's
    sums = {st.arrays["y"]: (st.arrays["x"], st.arrays["R"]) for st in BACKWARD.stages
            if role(st) == "sum"}
    assert sums == {"dresid": ("dy", "dresid_norm2"), "dx": ("dresid", "dx_norm1")}
    assert BACKWARD.outputs == tuple(f"d{a.name}" for a in FORWARD.inputs)
    # the causal block's backward: the same chain, through the causal attention's backward
    assert get_kernel("block_fwd_causal_vjp").composite is CAUSAL_BACKWARD
    assert [(st.label, st.kernel) for st in CAUSAL_BACKWARD.stages] == [
        (st.label, st.kernel.replace("attention_bwd", "attention_bwd_causal"))
        for st in BACKWARD.stages]
    assert CAUSAL_FORWARD.kept() == FORWARD.kept()


def _three_uses():
    """y = (rmsnorm(x) + x) + x: x's cotangent has three terms."""
    x, w = array("x", "batch", "n", "d"), array("w", "d")
    return Composite(
        name="three_uses", inputs=(x, w), scalars=("eps",), outputs=("y",),
        stages=(Stage("norm", "rmsnorm_fwd", "dnf",
                      {"x": "x", "weight": "w", "z": "z", "inv_rms": "r"}),
                Stage("add1", "residual_add", "dnf", {"x": "z", "R": "x", "y": "y1"},
                      {"dm": "d"}),
                Stage("add2", "residual_add", "dnf", {"x": "y1", "R": "x", "y": "y"},
                      {"dm": "d"})))


def test_a_derived_backward_matches_autograd():
    derived = vjp(_three_uses(), RULES, projections.SUM, name="three_uses_bwd")
    assert [a.name for a in derived.inputs] == ["x", "w", "r", "dy"]
    assert [st.label for st in derived.stages] == ["norm", "sum_x1", "sum_x2"]
    rng = np.random.default_rng(0)
    x, w, dy = rng.standard_normal((2, 3, 5)), rng.standard_normal(5), rng.standard_normal((2, 3, 5))
    eps = 1e-5
    r = 1 / np.sqrt((x * x).mean(-1) + eps)
    onf = compose(derived, lambda st: onf_of(st.kernel, st.variant))
    got = run_onf(onf, dict(x=x, w=w, r=r, dy=dy), {})
    tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
    z = tx * torch.rsqrt((tx * tx).mean(-1, keepdim=True) + eps) * tw
    ((z + tx + tx) * torch.tensor(dy)).sum().backward()
    np.testing.assert_allclose(got["dx"], tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got["dw"], tw.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_what_the_chain_rule_refuses():
    forward = _three_uses()
    with pytest.raises(SpecError, match="residual_add declares no backward"):
        vjp(forward, rmsnorm.CHAIN, projections.SUM, name="b")
    unused = array("unused", "d")
    with pytest.raises(SpecError, match="no cotangent reaches unused"):
        vjp(Composite(**{**forward.__dict__, "inputs": forward.inputs + (unused,)}), RULES,
            projections.SUM, name="b")
    # a stage reads the statistic, but the norm's backward takes no cotangent for it
    reads_r = Stage("use_r", "rmsnorm_apply", "dnf",
                    {"x": "x", "weight": "w", "inv_rms": "r", "z": "y"})
    rules = dict(RULES, rmsnorm_apply=backward(rmsnorm.APPLY, passes={"inv_rms": "z"}))
    with pytest.raises(SpecError, match="r is read after stage norm, whose backward takes no "
                                        "cotangent for its inv_rms"):
        vjp(Composite(**{**forward.__dict__, "stages": forward.stages[:1] + (reads_r,),
                         "outputs": ("z", "y")}), rules, projections.SUM, name="b")


def test_a_backward_kernel_must_follow_the_naming_rule():
    with pytest.raises(SpecError, match="neither the forward's nor dY"):
        backward(rmsnorm.FORWARD, rmsnorm.APPLY, "dnf")  # z is no input's gradient
    with pytest.raises(SpecError, match="do not map inputs to outputs"):
        backward(projections.OUT, projections.OUT_BWD, "tiled", passes={"Y": "R"})


def test_moagen_grad_of_a_composite_says_how_each_stage_is_differentiated(capsys):
    from moagen.cli import main
    assert main(["grad", "block_fwd"]) == 0
    out = capsys.readouterr().out
    assert "block_bwd (= block_fwd_vjp): derived from block_fwd by the chain rule" in out
    rows = {line.split()[0]: line.split(None, 2)[2] for line in out.splitlines()
            if line.startswith("  ") and len(line.split()) >= 3}
    assert rows["attn"] == "derived (attention_fwd_vjp)"
    assert rows["qkv"] == "derived (qkv_proj_vjp)" and rows["sum_x"] == "sums a cotangent's terms"
    assert rows["norm1_recompute"] == "recomputes forward arrays"
