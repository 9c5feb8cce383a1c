"""moagen.torch.attention with padded keys (#54, item 1's key-padding form): per-batch valid
key lengths, given as key_lengths or as SDPA's boolean attn_mask of shape (batch, 1, 1, n),
against F.scaled_dot_product_attention under that mask, outputs and gradients in float64;
a batch whose every key is padded out gets SDPA's zeros and no gradient. Before,
key_lengths did not exist and such a mask took the masked dnf kernels over a full copy of
the mask."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import moagen.torch as mt

attention_module = importlib.import_module("moagen.torch_ops.attention")
F64 = torch.float64


def _randn(*shape, seed=[100]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return torch.randn(*shape, dtype=F64, generator=g).requires_grad_()


def _padding_mask(lengths, n):
    return (torch.arange(n) < torch.tensor(lengths).unsqueeze(-1)).view(len(lengths), 1, 1, n)


def _close(got, want, rtol=1e-12):
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= rtol * max(want.abs().max().item(), 1.0)


# no key, one, a block's 64 and one past, all; queries fewer, as many and more than keys
@pytest.mark.parametrize("n_q, n", [(7, 70), (70, 70), (130, 70)])
@pytest.mark.parametrize("given", ["key_lengths", "attn_mask"])
def test_padded_keys_are_sdpas_with_their_gradients(n_q, n, given):
    """Grouped: 4 query heads over 2 KV heads, d 5; SDPA gives the batch with no key zeros
    (and no gradient), as here."""
    lengths = [0, 1, 65, n, 64]
    q, k, v = _randn(5, 4, n_q, 5), _randn(5, 2, n, 5), _randn(5, 2, n, 5)
    mask = _padding_mask(lengths, n)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = mt.attention(q, k, v, key_lengths=lengths) if given == "key_lengths" else \
        mt.attention(q, k, v, mask)
    _close(got, want)
    assert not want[0].any() and not got[0].any()
    grad_out = torch.randn_like(want)
    for ours, theirs in zip(torch.autograd.grad(got, (q, k, v), grad_out),
                            torch.autograd.grad(want, (q, k, v), grad_out)):
        _close(ours, theirs)
        assert not ours[0].any()


def test_a_batch_of_no_keys_at_all_has_sdpas_zero_gradients():
    q, k, v = _randn(2, 2, 3, 4), _randn(2, 2, 5, 4), _randn(2, 2, 5, 4)
    out = mt.attention(q, k, v, key_lengths=[0, 0])
    assert not out.any()
    assert not any(g.any() for g in torch.autograd.grad(out.sum(), (q, k, v)))


def test_a_padding_mask_takes_the_padded_kernels_in_c_and_fortran(monkeypatch):
    """A boolean (batch, 1, 1, n) mask, True up to each length: attention_cross's `_padded`
    flash kernels, forward and backward, a call a batch with keys (the key_lengths tensor
    form too); a mask of any other form keeps the masked kernels."""
    calls = []
    call = attention_module.call
    monkeypatch.setattr(attention_module, "call", lambda name, variant, *args, **kwargs: (
        calls.append((name, variant, kwargs.get("last"))) or call(name, variant, *args,
                                                                  **kwargs)))
    q, k, v = _randn(3, 2, 6, 4), _randn(3, 2, 9, 4), _randn(3, 2, 9, 4)
    mask = _padding_mask([4, 0, 9], 9)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for lang in ("c", "fortran"):
        _close(mt.attention(q, k, v, mask, lang=lang), want)
    _close(mt.attention(q, k, v, key_lengths=torch.tensor([4, 0, 9])), want)
    torch.autograd.grad(mt.attention(q, k, v, mask).sum(), (q, k, v))
    # the batch of no key: key 0's attention, made zeros
    forward = [("attention_cross_fwd_padded", "flash", 3), ("attention_cross_fwd_padded",
                                                             "flash", 0),
               ("attention_cross_fwd", "flash", None)]
    assert calls[:12] == forward * 4
    assert sorted(calls[12:]) == [("attention_cross_bwd", "flash", None),
                                  ("attention_cross_bwd_padded", "flash", 0),
                                  ("attention_cross_bwd_padded", "flash", 3)]
    calls.clear()
    not_a_prefix = mask.clone()
    not_a_prefix[0, 0, 0, 1] = False
    mt.attention(q, k, v, not_a_prefix)  # each batch's row shared by its heads: a call each
    assert calls == [("attention_cross_fwd_bool2d", "flash", None)] * 3


@pytest.mark.parametrize("lengths, message", [
    ([1, 2], "one int per batch"), ([1, 2, 10], "from 0 to k's length 9"),
    ([-1, 2, 3], "from 0 to k's length 9"), (torch.tensor([1.0, 2.0, 3.0]), "integer tensor"),
    ([1, True, 3], "one int per batch")])
def test_bad_key_lengths_are_refused(lengths, message):
    q, k, v = _randn(3, 2, 6, 4), _randn(3, 2, 9, 4), _randn(3, 2, 9, 4)
    with pytest.raises(ValueError, match=message):
        mt.attention(q, k, v, key_lengths=lengths)


def test_key_lengths_take_no_causal_mask_or_attn_mask():
    q, k, v = _randn(1, 2, 6, 4), _randn(1, 2, 9, 4), _randn(1, 2, 9, 4)
    for extra in (dict(causal=True), dict(attn_mask=_padding_mask([3], 9))):
        with pytest.raises(ValueError, match="key_lengths with causal or attn_mask"):
            mt.attention(q, k, v, key_lengths=[3], **extra)
