"""moagen.torch.attention with queries and keys of different lengths (#54, item 2): n_q
queries against n keys both ways, not causal, causal top-left (SDPA's is_causal) and
bottom-right (PyTorch's causal_lower_right, a cache's), MHA and grouped-query, against
F.scaled_dot_product_attention's outputs and gradients in float64; and one query against a
cache without gradients taking the decode kernel. Before, every call with n_q != n was
refused (k's length must be q's)."""
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import moagen.torch as mt

# the module (moagen.torch_ops exports its function under the same name)
attention_module = importlib.import_module("moagen.torch_ops.attention")

F64 = torch.float64


def _randn(*shape, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return torch.randn(*shape, dtype=F64, generator=g).requires_grad_()


def _sdpa(q, k, v, causal):
    if causal == "lower_right":
        with warnings.catch_warnings():  # its NaN warning: a CUDA kernel's, not the CPU's
            warnings.simplefilter("ignore")
            mask = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _close(got, want, rtol=1e-12):
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= rtol * max(want.abs().max().item(), 1.0)


# 1 and 7 queries against 1, 7 and 257 keys and back; (7, 7) with the bottom-right mask is
# the square kernels' top-left; (257, 257) is the square kernels' own (test_torch_ops)
LENGTHS = [(1, 7), (7, 1), (1, 257), (257, 1), (7, 257), (257, 7), (7, 7)]


@pytest.mark.parametrize("causal", [False, True, "lower_right"])
@pytest.mark.parametrize("n_q, n", LENGTHS)
def test_attention_of_other_lengths_is_sdpa_with_its_gradients(n_q, n, causal):
    """Grouped: 4 query heads over 2 KV heads, d 5. Bottom-right with n_q > n: the rows
    that see no key are SDPA's zeros, and get no gradient."""
    q, k, v = _randn(2, 4, n_q, 5), _randn(2, 2, n, 5), _randn(2, 2, n, 5)
    got, want = mt.attention(q, k, v, causal=causal), _sdpa(q, k, v, causal)
    _close(got, want)
    grad_out = torch.randn_like(want)
    for ours, theirs in zip(torch.autograd.grad(got, (q, k, v), grad_out),
                            torch.autograd.grad(want, (q, k, v), grad_out)):
        _close(ours, theirs)


@pytest.mark.parametrize("causal", [False, True, "lower_right"])
def test_attention_of_other_lengths_passes_gradcheck_in_fortran_too(causal):
    q, k, v = _randn(1, 2, 3, 4), _randn(1, 1, 5, 4), _randn(1, 1, 5, 4)
    for lang in ("c", "fortran"):
        _close(mt.attention(q, k, v, causal=causal, lang=lang), _sdpa(q, k, v, causal))
    assert torch.autograd.gradcheck(
        lambda q, k, v: mt.attention(q, k, v, causal=causal, scale=0.3), (q, k, v))


@pytest.mark.parametrize("causal, kernel", [(False, "attention_cross"),
                                            ("lower_right", "attention_cross_causal")])
def test_other_lengths_take_the_flash_kernels(monkeypatch, causal, kernel):
    """n_q != n runs attention_cross's flash kernels, forward and backward (key blocks, both
    products register tiles), not the row-by-row dnf ones; the values are the tests'
    above."""
    calls = []
    call = attention_module.call
    monkeypatch.setattr(attention_module, "call", lambda name, variant, *args, **kwargs: (
        calls.append((name, variant)) or call(name, variant, *args, **kwargs)))
    q, k, v = _randn(1, 4, 7, 5), _randn(1, 2, 70, 5), _randn(1, 2, 70, 5)
    torch.autograd.grad(mt.attention(q, k, v, causal=causal).sum(), (q, k, v))
    forward, backward = (kernel.replace("cross", f"cross_{kind}") for kind in ("fwd", "bwd"))
    assert calls == [(forward, "flash"), (backward, "flash")]


def test_a_prefill_chunk_against_a_cache_is_the_full_sequences_last_rows():
    """Bottom-right is what a cache needs: 3 new queries against the 5 cached keys and
    their own 3 give the last 3 rows of causal attention over all 8."""
    q, k, v = (_randn(1, 2, 8, 4).detach() for _ in range(3))
    full = mt.attention(q, k, v, causal=True)
    _close(mt.attention(q[:, :, 5:], k, v, causal="lower_right"), full[:, :, 5:])


def test_one_query_without_gradients_takes_the_decode_kernel(monkeypatch):
    """n_q = 1, not causal or bottom-right (the query sees every key), no gradient taken:
    attention_decode; with a gradient taken, the cross kernels."""
    calls = []
    decode = attention_module.attention_decode_op
    monkeypatch.setattr(attention_module, "attention_decode_op",
                        lambda *args: calls.append(args) or decode(*args))
    q, k, v = _randn(2, 4, 1, 5), _randn(2, 2, 9, 5), _randn(2, 2, 9, 5)
    for causal in (False, "lower_right"):
        with torch.no_grad():
            _close(mt.attention(q, k, v, causal=causal), _sdpa(q, k, v, causal))
    assert len(calls) == 2
    (dq,) = torch.autograd.grad(mt.attention(q, k, v).sum(), q)
    (want,) = torch.autograd.grad(_sdpa(q, k, v, False).sum(), q)
    _close(dq, want)
    with torch.no_grad():  # top-left: the query sees key 0 alone, not a decode
        _close(mt.attention(q, k, v, causal=True), _sdpa(q, k, v, True))
    assert len(calls) == 2


@pytest.mark.parametrize("causal", ["upper_left", 1, None])
def test_attention_refuses_an_alignment_it_does_not_know(causal):
    q = _randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="causal must be False, True .* or 'lower_right'"):
        mt.attention(q, q, q, causal=causal)


@pytest.mark.parametrize("n_q", [3, 7])
def test_torch_compile_traces_the_other_lengths(n_q):
    """fullgraph (aot_eager: forward and backward through the fake implementations) gives
    eager's output and gradients, the same bits; 7 queries against 5 keys, bottom-right,
    take the rows that see a key."""
    q, k = _randn(1, 2, n_q, 4), _randn(1, 1, 5, 4)
    compiled = torch.compile(lambda q, k: mt.attention(q, k, k, causal="lower_right"),
                             fullgraph=True, backend="aot_eager")
    eager = mt.attention(q, k, k, causal="lower_right")
    traced = compiled(q, k)
    assert torch.equal(traced, eager)
    for a, b in zip(torch.autograd.grad(traced.sum(), (q, k)),
                    torch.autograd.grad(eager.sum(), (q, k))):
        assert torch.equal(a, b)
