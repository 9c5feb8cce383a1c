"""moagen.torch.attention with an explicit attn_mask (#54, item 1): boolean and float masks
of SDPA's shapes (full, shared over heads, over the batch, a key-padding row), a
left-padded batch built from per-batch lengths, rows the mask hides wholly, n_q != n,
grouped-query, against F.scaled_dot_product_attention(attn_mask=...)'s outputs and
gradients in float64; the masked flash kernels, a mask shared by every batch and head
taken as one (n_q, n) array, and rows whose first key blocks are all masked. Before,
attention took no attn_mask (a TypeError), then took it by the row-by-row dnf kernels with
the mask copied to the full shape.

SDPA (torch 2.13, CPU, float64) gives a row whose keys are all masked zeros, with a boolean
mask and with a float mask of -inf alike, and no gradient to q, k or v from it; so do
these."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import moagen.torch as mt

# the module (moagen.torch_ops's package exports its function under the same name)
attention_module = importlib.import_module("moagen.torch_ops.attention")

F64 = torch.float64


def _randn(*shape, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return torch.randn(*shape, dtype=F64, generator=g).requires_grad_()


def _seen(*shape, seed=[100]):
    """A random boolean mask, about 6 keys in 10 seen."""
    seed[0] += 1
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed[0])) < 0.6


def _close(got, want, rtol=1e-12):
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= rtol * max(want.abs().max().item(), 1.0)


def _as_float(seen):
    """A boolean mask as SDPA's float one (-inf where a key is not seen), with a bias where it
    is: a float mask is added to the scores, not only 0 / -inf."""
    bias = torch.randn(seen.shape, dtype=F64, generator=torch.Generator().manual_seed(7))
    return bias.masked_fill(~seen, float("-inf"))


def assert_sdpa(q, k, v, mask, lang="c", rtol=1e-12):
    """Output and gradients of q, k, v as SDPA's (grouped by enable_gqa)."""
    got = mt.attention(q, k, v, mask, lang=lang)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    _close(got, want, rtol)
    grad_out = torch.randn_like(want)
    for ours, theirs in zip(torch.autograd.grad(got, (q, k, v), grad_out),
                            torch.autograd.grad(want, (q, k, v), grad_out)):
        _close(ours, theirs, rtol)
    return got


# (n_q, n), each 1, 7 or 257: one key, one query, more keys than queries and more queries
# than keys, past a block of keys
LENGTHS = [(n_q, n) for n_q in (1, 7, 257) for n in (1, 7, 257)]
# the mask's shape for (batch, heads, n_q, n) = (2, 4, n_q, n): full, shared by the heads,
# by the batch and the heads, one row of keys per batch (padding)
SHAPES = {"full": lambda n_q, n: (2, 4, n_q, n), "heads": lambda n_q, n: (2, 1, n_q, n),
          "2d": lambda n_q, n: (n_q, n), "keys": lambda n_q, n: (2, 1, 1, n)}


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n_q, n", LENGTHS)
def test_masked_attention_is_sdpa_with_its_gradients(n_q, n, shape, kind):
    """4 query heads over 2 KV heads, d 5; with one key about 4 rows in 10 are wholly masked
    (with more, the tests below mask rows wholly)."""
    q, k, v = _randn(2, 4, n_q, 5), _randn(2, 2, n, 5), _randn(2, 2, n, 5)
    seen = _seen(*SHAPES[shape](n_q, n))
    assert_sdpa(q, k, v, seen if kind == "bool" else _as_float(seen))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_wholly_masked_rows_are_zeros_without_gradient(kind):
    """A query row that sees no key, and a whole batch entry: SDPA's zeros, and their rows
    of dq zero, as SDPA's; the other rows as SDPA's."""
    q, k, v = _randn(2, 2, 5, 4), _randn(2, 2, 6, 4), _randn(2, 2, 6, 4)
    seen = _seen(2, 2, 5, 6) | torch.eye(5, 6, dtype=torch.bool)  # every row a key, but:
    seen[0, 1, 3] = False
    seen[1] = False
    out = assert_sdpa(q, k, v, seen if kind == "bool" else _as_float(seen))
    hidden = ~seen.any(-1)
    assert hidden.sum() == 11 and out[hidden].eq(0).all() and out[~hidden].ne(0).all()
    (dq,) = torch.autograd.grad(mt.attention(q, k, v, seen).sum(), q)
    assert dq[hidden].eq(0).all()


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape, kernel", [
    ((7, 70), "2d"), ((1, 1, 7, 70), "2d"), ((1, 70), "2d"), ((2, 1, 7, 70), "2d"),
    ((2, 4, 7, 70), "masked"), ((1, 4, 7, 70), "masked")])
def test_masks_take_the_flash_kernels(monkeypatch, shape, kernel, kind):
    """A mask shared by every batch and head runs the flash kernels on one (n_q, n) array:
    a boolean one the `_bool2d` kernels on its bytes (a bool tensor, no float mask made), a
    float one the `_masked2d` ones; one a batch shared by its heads the same a call a batch
    (batch 2: two forwards, then two backwards); one per head the `_masked` ones on the full
    shape, a float mask of q's dtype."""
    calls = []
    call = attention_module.call

    def counted(name, variant, lang, q, k, v, mask, *args, **kwargs):
        # the mask passed as it is, or grouped: a (tensor, shape) pair
        calls.append((name, variant, (mask[0] if isinstance(mask, tuple) else mask).dtype))
        return call(name, variant, lang, q, k, v, mask, *args, **kwargs)
    monkeypatch.setattr(attention_module, "call", counted)
    q, k, v = _randn(2, 4, 7, 5), _randn(2, 2, 70, 5), _randn(2, 2, 70, 5)
    seen = _seen(*shape) | (torch.arange(70) == 0)  # key 0 seen by every row
    assert_sdpa(q, k, v, seen if kind == "bool" else _as_float(seen))
    calls_each = 2 if shape[:2] == (2, 1) else 1
    if kernel == "2d":
        kernel = "bool2d" if kind == "bool" else "masked2d"
    dtype = torch.bool if kernel == "bool2d" else F64
    assert calls == [(f"attention_cross_fwd_{kernel}", "flash", dtype)] * calls_each + \
        [(f"attention_cross_bwd_{kernel}", "flash", dtype)] * calls_each


@pytest.mark.parametrize("dtype, rtol", [(F64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("shape", [(257, 300), (2, 4, 257, 300)])
def test_rows_whose_first_key_blocks_are_masked(shape, dtype, rtol):
    """Query i sees the keys j >= i only (a block of keys holds none of the last rows' keys
    until their first: the flash forward's max stays -inf over those blocks), row 100 none
    (SDPA's zeros); shared by every batch and head, and per batch and head."""
    q, k, v = (_randn(2, 4, 257, 5), _randn(2, 2, 300, 5), _randn(2, 2, 300, 5))
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    seen = (torch.arange(300) >= torch.arange(257)[:, None]).expand(shape).clone()
    seen[..., 100, :] = False
    out = assert_sdpa(q, k, v, seen, rtol=rtol)
    assert out[:, :, 100].eq(0).all() and out.isfinite().all()


def test_a_left_padded_batch_from_lengths_is_sdpa():
    """A batch of 2 sequences of 9 and 5 tokens, the shorter left-padded with 4: the key
    padding from the lengths, and with it a causal mask (a decoder's, as a Hugging Face model
    builds it), whose padding query rows see no key. 7 and 9 queries, grouped heads."""
    n, lengths = 9, torch.tensor([9, 5])
    keys = torch.arange(n) >= (n - lengths)[:, None]  # (batch, n): True at a real token
    padding = keys[:, None, None, :]
    k, v = _randn(2, 2, n, 4), _randn(2, 2, n, 4)
    for n_q in (7, n):
        assert_sdpa(_randn(2, 4, n_q, 4), k, v, padding)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    out = assert_sdpa(_randn(2, 4, n, 4), k, v, padding & causal)
    assert out[1, :, :4].eq(0).all() and out[1, :, 4:].ne(0).all()


def test_masked_attention_passes_gradcheck_in_fortran_too():
    q, k, v = _randn(1, 2, 3, 4), _randn(1, 1, 5, 4), _randn(1, 1, 5, 4)
    seen = _seen(1, 2, 3, 5) | torch.eye(3, 5, dtype=torch.bool)
    for mask in (seen, _as_float(seen)):
        assert_sdpa(q, k, v, mask, lang="fortran")
        assert torch.autograd.gradcheck(
            lambda q, k, v: mt.attention(q, k, v, mask, scale=0.3), (q, k, v))


def test_torch_compile_traces_a_mask():
    """fullgraph (aot_eager: forward and backward through the fake implementations) gives
    eager's output and gradients, the same bits, with a wholly masked row."""
    q, k = _randn(1, 2, 3, 4), _randn(1, 1, 5, 4)
    seen = _seen(3, 5) | torch.eye(3, 5, dtype=torch.bool)
    seen[1] = False
    compiled = torch.compile(lambda q, k: mt.attention(q, k, k, seen), fullgraph=True,
                             backend="aot_eager")
    eager, traced = mt.attention(q, k, k, seen), compiled(q, k)
    assert torch.equal(traced, eager)
    for a, b in zip(torch.autograd.grad(traced.sum(), (q, k)),
                    torch.autograd.grad(eager.sum(), (q, k))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask, causal, error", [
    (torch.ones(3, 5, dtype=torch.bool), True, "attn_mask and causal together"),
    (torch.ones(2, 5, dtype=torch.bool), False, r"does not broadcast to .* \(1, 2, 3, 5\)"),
    (torch.ones(1, 3, 3, 5, dtype=torch.bool), False, "does not broadcast"),
    (torch.ones(3, 5, dtype=torch.int64), False, "must be boolean .* or float"),
    (torch.zeros(3, 5, dtype=F64, requires_grad=True), False, "requires grad"),
])
def test_attention_refuses_a_mask_it_cannot_take(mask, causal, error):
    q = _randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=error):
        mt.attention(q, _randn(1, 2, 5, 4), _randn(1, 2, 5, 4), mask, causal=causal)


def test_the_operator_refuses_a_boolean_mask_not_shared():
    """The `_bool2d` kernels take a boolean mask (n_q, n); one of the full shape reaches the
    operator only as a float mask, and a boolean one of that shape is refused by name (the
    custom op's check: the eager path's caller checked its arguments)."""
    q, k = _randn(1, 2, 3, 4), _randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"a boolean mask must have 2 dimensions \(n_q, n\)"):
        attention_module.attention_op.custom_op(
            q, k, k, torch.ones(1, 2, 3, 5, dtype=torch.bool), False, 0, -1, 0.5, "c")
