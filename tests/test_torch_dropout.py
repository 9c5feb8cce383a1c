"""moagen.torch.attention(..., dropout_p=p) (#54 item 3): exactly the numpy attention under
moagen.philox's mask for the seed the call draws, forward and backward; the mask's keep
rate and independence across rows and heads as the operator applies it; reproducible under
torch.manual_seed; gradcheck; dropout_p = 0 unchanged; bad dropout_p refused."""
import numpy as np
import pytest
import torch

from moagen import reference
from moagen import torch as mt
from moagen.torch_ops.dropout import draw_seed

P = 0.3


def _inputs(batch=2, heads=4, kv_heads=2, n=9, d=5, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(batch, h, n, d, generator=g, dtype=dtype, requires_grad=grad)
            for h in (heads, kv_heads, kv_heads)]


def _grouped(t, kv_heads):
    return t.detach().numpy().reshape(t.shape[0], kv_heads, -1, *t.shape[2:])


def _seeded(seed, fn):
    """fn() after torch.manual_seed(seed), and the seed the call draws there."""
    torch.manual_seed(seed)
    drawn = draw_seed()
    torch.manual_seed(seed)
    return fn(), drawn


# Fortran once: each kernel's schedule fitted to these sizes is derived and built per
# process (seconds each)
@pytest.mark.parametrize("lang, causal", [("c", False), ("c", True), ("fortran", True)])
def test_forward_and_backward_equal_numpys_under_the_same_mask(lang, causal):
    q, k, v = _inputs(grad=True)
    out, seed = _seeded(5, lambda: mt.attention(q, k, v, causal=causal, dropout_p=P, lang=lang))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    Q, K, V = _grouped(q, 2), k.detach().numpy(), v.detach().numpy()
    scalars = dict(scale=1 / np.sqrt(5), dropout_p=P, seed=seed, causal=causal)
    O, lse = reference.attention_dropout_fwd_numpy(Q, K, V, **scalars)
    np.testing.assert_allclose(out.detach().numpy(), O.reshape(out.shape), rtol=0, atol=1e-12)
    grads = reference.attention_dropout_bwd_numpy(Q, K, V, O, _grouped(grad_out, 2), lse,
                                                  **scalars)
    for t, want in zip((q, k, v), grads):
        np.testing.assert_allclose(t.grad.numpy(), want.reshape(t.shape), rtol=0, atol=1e-12)


def test_float32_follows_the_mask_at_float32s_p():
    q, k, v = _inputs(dtype=torch.float32)
    out, seed = _seeded(6, lambda: mt.attention(q, k, v, dropout_p=P))
    O, _ = reference.attention_dropout_fwd_numpy(
        *(_grouped(t, 2).astype(np.float64) if t is q else t.numpy().astype(np.float64)
          for t in (q, k, v)), scale=1 / np.sqrt(5), dropout_p=float(np.float32(P)), seed=seed)
    np.testing.assert_allclose(out.numpy(), O.reshape(out.shape), rtol=0, atol=2e-6)


def _applied_mask(batch, heads, n, seed):
    """The keep mask the operator applies, read off its output: q = 0 makes every
    probability 1 / n, and v = the identity makes O those probabilities, dropped."""
    q = torch.zeros(batch, heads, n, n, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(batch, heads, n, n)
    out, _ = _seeded(seed, lambda: mt.attention(q, torch.randn_like(q), v, dropout_p=P))
    kept = out != 0
    assert torch.allclose(out[kept], torch.tensor(1 / n / (1 - P), dtype=torch.float64),
                          rtol=1e-14, atol=0)
    return kept.numpy()


def _agreement_is_chance(a, b):
    chance = P * P + (1 - P) * (1 - P)
    return abs(np.mean(a == b) - chance) < 5 * np.sqrt(chance * (1 - chance) / a.size)


def test_the_applied_mask_keeps_one_minus_p_independently_across_rows_and_heads():
    kept = _applied_mask(2, 4, 64, seed=3)  # 32768 draws
    assert abs(kept.mean() - (1 - P)) < 5 * np.sqrt(P * (1 - P) / kept.size)
    rows = kept.reshape(-1, 64)
    assert len({row.tobytes() for row in rows}) == len(rows)
    assert _agreement_is_chance(kept[:, 1:], kept[:, :-1])  # neighbouring heads
    assert _agreement_is_chance(kept[:, :, 1:], kept[:, :, :-1])  # neighbouring rows
    assert _agreement_is_chance(kept[1], kept[0])  # batch entries


def test_manual_seed_reproduces_a_call_and_each_call_draws_anew():
    q, k, v = _inputs()
    first, _ = _seeded(9, lambda: mt.attention(q, k, v, dropout_p=P))
    again, _ = _seeded(9, lambda: mt.attention(q, k, v, dropout_p=P))
    assert torch.equal(first, again)
    assert not torch.equal(mt.attention(q, k, v, dropout_p=P), mt.attention(q, k, v, dropout_p=P))


def test_gradcheck_with_a_fixed_seed():
    q, k, v = _inputs(batch=1, heads=2, kv_heads=1, n=4, d=3, grad=True)

    def dropped(q, k, v):
        torch.manual_seed(4)  # the same mask at every evaluation
        return mt.attention(q, k, v, causal=True, dropout_p=P)
    assert torch.autograd.gradcheck(dropped, (q, k, v))


def test_dropout_p_zero_is_attention_without_dropout():
    q, k, v = _inputs()
    assert torch.equal(mt.attention(q, k, v, dropout_p=0.0), mt.attention(q, k, v))


def test_lower_right_with_as_many_queries_as_keys_is_top_left():
    q, k, v = _inputs()
    top_left, _ = _seeded(2, lambda: mt.attention(q, k, v, causal=True, dropout_p=P))
    lower_right, _ = _seeded(2, lambda: mt.attention(q, k, v, causal="lower_right",
                                                     dropout_p=P))
    assert torch.equal(top_left, lower_right)


def test_bad_dropout_p_and_unsupported_cases_are_refused():
    q, k, v = _inputs()
    for p in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
            mt.attention(q, k, v, dropout_p=p)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        mt.attention(q, k, v, dropout_p="0.1")
    with pytest.raises(NotImplementedError, match="different lengths"):
        mt.attention(q, k[:, :, :5], v[:, :, :5], dropout_p=P)
    with pytest.raises(NotImplementedError, match="dropout_p with an attn_mask"):
        mt.attention(q, k, v, torch.ones(9, 9, dtype=torch.bool), dropout_p=P)


def test_under_torch_compile_each_call_draws_anew_and_manual_seed_reproduces():
    q, k, v = _inputs(batch=1, heads=2, kv_heads=1, n=8, d=4)
    compiled = torch.compile(lambda q, k, v: mt.attention(q, k, v, dropout_p=P), fullgraph=True)
    first, _ = _seeded(1, lambda: compiled(q, k, v))
    again, _ = _seeded(1, lambda: compiled(q, k, v))
    assert torch.equal(first, again) and not torch.equal(first, compiled(q, k, v))
