"""moagen.torch answers every call a new user tries either right or with an error that says
what to do, never silently wrong (issue #54, item 5): a double backward, mixed devices (meta
among them), a KV cache asked for a gradient, empty inputs, torch.func (vmap, and the
transforms that differentiate). Every test here failed before its fix (a gradient with no
graph, uninitialized memory, an error on an empty batch, PyTorch's message about
setup_context)."""
import pytest
import torch
import torch.nn.functional as F

import moagen.torch as mt
from moagen.reference_block import _block_torch

F64 = torch.float64


def _randn(*shape, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return torch.randn(*shape, dtype=F64, generator=g).requires_grad_()


def _block():
    torch.manual_seed(0)
    return mt.Block(d_model=4, heads=2, d_head=3, d_ff=5, dtype=F64)


def _mlp(x, wg, wu, wd):
    return (F.silu(x @ wg) * (x @ wu)) @ wd


def _cases(rows):
    """(ours, PyTorch's, inputs) for each operator, on `rows` rows (batch and length)."""
    block = _block()
    pytorch_block = lambda x, *w: _block_torch(x, list(w), block.eps, block.scale)[0]
    return {
        "attention": (mt.attention, lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=True), (_randn(rows, 2, rows, 3), _randn(rows, 1, rows, 3),
                                        _randn(rows, 1, rows, 3))),
        "rms_norm": (mt.rms_norm, lambda x, w: F.rms_norm(x, (3,), w, 1e-5),
                     (_randn(rows, rows, 3), _randn(3))),
        "swiglu_mlp": (mt.swiglu_mlp, _mlp, (_randn(rows, 3), _randn(3, 5), _randn(3, 5),
                                              _randn(5, 3))),
        "Block": (lambda x, *w: block(x), pytorch_block,
                  (_randn(rows, rows, 4), *block.weights())),
    }


OPERATORS = ["attention", "rms_norm", "swiglu_mlp", "Block"]


@pytest.mark.parametrize("name", OPERATORS)
def test_a_double_backward_raises_where_the_gradients_graph_is_used(name):
    """create_graph=True gives PyTorch's first-order gradients; differentiating them again
    (a gradient penalty) raises, naming the operator and what to use instead. Before: the
    gradients came back with no graph (a penalty's gradient silently wrong)."""
    ours, pytorchs, inputs = _cases(2)[name]
    got = torch.autograd.grad(ours(*inputs).pow(2).sum(), inputs, create_graph=True)
    want = torch.autograd.grad(pytorchs(*inputs).pow(2).sum(), inputs)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)
    penalty = sum(g.pow(2).sum() for g in got)
    with pytest.raises(RuntimeError, match="has no double backward.*second derivatives"):
        penalty.backward()


@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("meta", ["first", "rest"])
def test_a_meta_tensor_among_real_ones_is_refused(name, meta):
    """Before: a CPU x with meta weights read memory that does not exist (values like
    6.9e-310), a meta x with CPU weights returned a meta tensor; all on meta still gives the
    shapes."""
    ours, _, inputs = _cases(2)[name]
    inputs = [t.detach() for t in inputs]
    if name == "Block":  # x, or the module's weights
        block, x = _block(), inputs[0]
        call = (lambda: block(x.to("meta"))) if meta == "first" else (
            lambda: block.to("meta")(x))
    else:
        moved = [t.to("meta") if (i == 0) == (meta == "first") else t
                 for i, t in enumerate(inputs)]
        call = lambda: ours(*moved)
    with pytest.raises(ValueError, match="must be on one device.*meta"):
        call()
    if name != "Block":
        out = ours(*(t.to("meta") for t in inputs))
        assert out.is_meta and out.shape == ours(*inputs).shape


def test_the_kv_cache_refuses_a_meta_query_and_tensors_that_require_grad():
    cache = mt.KVCache(1, 1, 4, 3, dtype=F64)
    k, v, q = _randn(1, 1, 1, 3), _randn(1, 1, 1, 3), _randn(1, 2, 1, 3)
    # before: appended without their graph, and attend's output had no gradient
    with pytest.raises(RuntimeError, match="k requires grad.*torch.no_grad"):
        cache.append(k, v)
    with torch.no_grad():
        cache.append(k, v)
    with pytest.raises(RuntimeError, match="q requires grad.*torch.no_grad"):
        cache.attend(q)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert torch.allclose(cache.attend(q), want, rtol=1e-12)
        with pytest.raises(ValueError, match="must be on one device.*q: meta"):
            cache.attend(q.to("meta"))


@pytest.mark.parametrize("name", OPERATORS)
def test_an_empty_batch_gives_empty_outputs_and_pytorchs_gradients(name):
    """No rows (batch and length 0): an empty output of PyTorch's shape, and PyTorch's
    gradients (the weights' zeros). Before: a ValueError (x is empty)."""
    ours, pytorchs, inputs = _cases(0)[name]
    got, want = ours(*inputs), pytorchs(*inputs)
    assert got.shape == want.shape
    dy = torch.ones_like(want)
    for g, w in zip(torch.autograd.grad(got, inputs, dy), torch.autograd.grad(want, inputs, dy)):
        assert g.shape == w.shape and torch.equal(g, w)


def test_attention_over_no_heads_is_empty():
    q = _randn(1, 0, 3, 2)
    out = mt.attention(q, q, q)
    assert out.shape == F.scaled_dot_product_attention(q, q, q).shape
    assert torch.autograd.grad(out.sum(), q)[0].shape == q.shape


@pytest.mark.parametrize("name", ["attention", "rms_norm", "swiglu_mlp"])
def test_vmap_maps_the_operator_over_a_leading_dimension(name):
    """torch.func.vmap of the operator is PyTorch's operator's, gradients included (taken
    outside the vmap). Before: PyTorch's error about setup_context."""
    ours, pytorchs, inputs = _cases(2)[name]
    mapped = _randn(3, *inputs[0].shape)
    got = torch.func.vmap(lambda x: ours(x, *inputs[1:]))(mapped)
    want = torch.func.vmap(lambda x: pytorchs(x, *inputs[1:]))(mapped)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    dy = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, [mapped, *inputs[1:]], dy),
                    torch.autograd.grad(want, [mapped, *inputs[1:]], dy)):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("transform", ["grad", "grad of vmap", "jvp"])
def test_torch_funcs_differentiating_transforms_are_refused_by_name(name, transform):
    """Before: PyTorch's error about setup_context (its custom ops' too)."""
    ours, _, inputs = _cases(2)[name]
    loss = lambda x: ours(x, *inputs[1:]).sum()
    x = inputs[0].detach()
    call = {"grad": lambda: torch.func.grad(loss)(x),
            "grad of vmap": lambda: torch.func.grad(lambda x: torch.func.vmap(loss)(x).sum())(
                x.unsqueeze(0)),
            "jvp": lambda: torch.func.jvp(loss, (x,), (x,))}[transform]
    with pytest.raises(NotImplementedError, match="does not support torch.func's "
                                                  "differentiating transforms.*autograd.grad"):
        call()


@pytest.mark.parametrize("name", OPERATORS)
def test_forward_mode_ad_is_refused_by_name(name):
    """A dual tensor (torch.autograd.forward_ad). Before: PyTorch's message asking for the
    autograd.Function's jvp."""
    ours, _, inputs = _cases(2)[name]
    x = inputs[0].detach()
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="no forward-mode derivative.*"
                                                      "autograd.grad, or use"):
            ours(dual, *inputs[1:])
