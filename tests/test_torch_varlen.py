"""moagen.torch.attention_varlen (#54, item 1's packed sequences, in FlashAttention's varlen
conventions) against F.scaled_dot_product_attention over the packed batch under its
block-diagonal mask (causal: bottom-right within each sequence), outputs and gradients in
float64 to 1e-12 and float32 to 2e-5; sequences of no query, no key, one key, more queries
than keys, and past a 64-key block. Before, packed sequences had no entry point."""
import pytest
import torch
import torch.nn.functional as F

import moagen.torch as mt
from moagen.torch_ops import native, varlen

# (queries, keys) a sequence: one of each, none of either, more queries than keys (causal:
# the first rows see no key), a block's 64 keys and past it
LENGTHS = [(1, 1), (0, 3), (4, 0), (9, 5), (7, 70), (65, 65), (3, 130)]


def _offsets(lengths):
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def _packed_mask(q_lengths, k_lengths, causal):
    """(total_q, total_k): query i of sequence s sees key j of s (causal: j <= i + n - n_q)."""
    rows = []
    for s, (n_q, n) in enumerate(zip(q_lengths, k_lengths)):
        seen = torch.ones(n_q, n, dtype=torch.bool)
        if causal:
            seen = torch.arange(n) <= torch.arange(n_q).unsqueeze(-1) + n - n_q
        before, after = sum(k_lengths[:s]), sum(k_lengths[s + 1:])
        rows.append(F.pad(seen, (before, after)))
    return torch.cat(rows)


def _sdpa_packed(q, k, v, q_lengths, k_lengths, causal):
    """SDPA on the batch as one sequence of total_q queries, its block-diagonal mask (a row
    that sees no key: SDPA's zeros)."""
    mask = _packed_mask(q_lengths, k_lengths, causal)
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=g).requires_grad_()


def _close(got, want, rtol):
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= rtol * max(want.abs().max().item(), 1.0)


# float32 causal alone: its kernels, as float64's, are verified in every form (test_verify)
@pytest.mark.parametrize("causal, dtype, rtol", [(False, torch.float64, 1e-12),
                                                 (True, torch.float64, 1e-12),
                                                 (True, torch.float32, 2e-5)])
def test_packed_sequences_are_sdpas_under_the_block_diagonal_mask(causal, dtype, rtol):
    """Grouped: 4 query heads over 2 KV heads, d 5."""
    q_lengths, k_lengths = zip(*LENGTHS)
    q = _randn(sum(q_lengths), 4, 5, dtype=dtype, seed=1)
    k, v = (_randn(sum(k_lengths), 2, 5, dtype=dtype, seed=s) for s in (2, 3))
    got = mt.attention_varlen(q, k, v, torch.tensor(_offsets(q_lengths), dtype=torch.int32),
                              _offsets(k_lengths), causal=causal)
    want = _sdpa_packed(q, k, v, q_lengths, k_lengths, causal)
    _close(got, want, rtol)
    grad_out = torch.randn_like(want)
    for ours, theirs in zip(torch.autograd.grad(got, (q, k, v), grad_out),
                            torch.autograd.grad(want, (q, k, v), grad_out)):
        _close(ours, theirs, rtol)


@pytest.mark.parametrize("causal, dtype, rtol", [(False, torch.float64, 1e-12),
                                                 (True, torch.float64, 1e-12),
                                                 (True, torch.float32, 2e-5)])
@pytest.mark.parametrize("one_call", [True, None])
def test_one_call_is_one_kernel_call_for_the_batch(monkeypatch, causal, dtype, rtol, one_call):
    """one_call=True, or by default, under no_grad: attention_varlen_fwd's flash once, the
    offsets passed to it, the same values as SDPA's over the block-diagonal mask (rows that
    see no key its zeros)."""
    calls = []

    def counted(name, variant, *args, **kwargs):
        calls.append((name, variant))
        return native.call(name, variant, *args, **kwargs)

    monkeypatch.setattr(varlen, "call", counted)
    q_lengths, k_lengths = zip(*LENGTHS)
    q = _randn(sum(q_lengths), 4, 5, dtype=dtype, seed=1)
    k, v = (_randn(sum(k_lengths), 2, 5, dtype=dtype, seed=s) for s in (2, 3))
    with torch.no_grad():
        got = mt.attention_varlen(q, k, v, _offsets(q_lengths), _offsets(k_lengths),
                                  causal=causal, one_call=one_call)
        want = _sdpa_packed(q, k, v, q_lengths, k_lengths, causal)
    assert calls == [("attention_varlen_fwd" + ("_causal" if causal else ""), "flash")]
    _close(got, want, rtol)


def test_a_gradient_or_one_call_false_takes_a_call_per_sequence(monkeypatch):
    """By default a gradient to take (the one call's dnf backward against the per-sequence
    flash ones unmeasured) runs each sequence by moagen.torch.attention, its gradients
    SDPA's; one_call=False does so always."""
    names = []
    monkeypatch.setattr(varlen, "call", lambda name, *a, **k: names.append(name))
    q, k = _randn(5, 2, 3, dtype=torch.float64, seed=7), _randn(4, 2, 3, dtype=torch.float64,
                                                                  seed=8)
    q.requires_grad_(True)
    mt.attention_varlen(q, k, k, [0, 2, 5], [0, 1, 4]).sum().backward()
    assert q.grad is not None and names == []
    with torch.no_grad():
        mt.attention_varlen(q, k, k, [0, 2, 5], [0, 1, 4], one_call=False)
    assert names == []


@pytest.mark.parametrize("causal, dtype, rtol", [(False, torch.float64, 1e-12),
                                                 (True, torch.float64, 1e-12),
                                                 (True, torch.float32, 2e-5)])
def test_one_call_gradient_is_one_backward_kernel_call(monkeypatch, causal, dtype, rtol):
    """one_call=True with a gradient: attention_varlen_bwd once for the batch (before: a
    ValueError, the forward only), its dQ, dK, dV those of the per-sequence path and of
    SDPA over the block-diagonal mask; a sequence of no query, of no key, and causal's 9
    queries over 5 keys (rows that see no key: zero gradients, no NaN)."""
    calls = []

    def counted(name, *args, **kwargs):
        calls.append(name)
        return native.call(name, *args, **kwargs)

    monkeypatch.setattr(varlen, "call", counted)
    q_lengths, k_lengths = zip(*LENGTHS)
    q = _randn(sum(q_lengths), 4, 5, dtype=dtype, seed=1)
    k, v = (_randn(sum(k_lengths), 2, 5, dtype=dtype, seed=s) for s in (2, 3))
    offsets = _offsets(q_lengths), _offsets(k_lengths)
    got = mt.attention_varlen(q, k, v, *offsets, causal=causal, one_call=True)
    grad_out = torch.randn_like(got)
    ours = torch.autograd.grad(got, (q, k, v), grad_out)
    suffix = "_causal" if causal else ""
    assert calls == ["attention_varlen_fwd" + suffix, "attention_varlen_bwd" + suffix]
    per_sequence = mt.attention_varlen(q, k, v, *offsets, causal=causal)
    sdpa = _sdpa_packed(q, k, v, q_lengths, k_lengths, causal)
    for want in (per_sequence, sdpa):
        for got_grad, want_grad in zip(ours, torch.autograd.grad(want, (q, k, v), grad_out)):
            assert torch.isfinite(got_grad).all()
            _close(got_grad, want_grad, rtol)


def test_heads_must_be_grouped():
    q, k = torch.zeros(5, 3, 4), torch.zeros(4, 2, 4)
    with pytest.raises(ValueError, match="k's 2 heads must divide q's 3"):
        mt.attention_varlen(q, k, k, [0, 5], [0, 4])


def test_a_query_that_sees_no_key_gets_zeros():
    """The sequence of 4 queries and no key, and causal's first 4 rows of 9 queries over 5
    keys: zeros, as SDPA's and FlashAttention's."""
    q_lengths, k_lengths = zip(*LENGTHS)
    q = _randn(sum(q_lengths), 2, 3, dtype=torch.float64, seed=4)
    k, v = (_randn(sum(k_lengths), 2, 3, dtype=torch.float64, seed=s) for s in (5, 6))
    out = mt.attention_varlen(q, k, v, _offsets(q_lengths), _offsets(k_lengths), causal=True)
    no_key, more_queries = sum(q_lengths[:2]), sum(q_lengths[:3])
    assert not out[no_key:no_key + 4].any() and not out[more_queries:more_queries + 4].any()
    assert out[more_queries + 4].abs().sum() > 0


def test_an_empty_batch_gives_an_empty_output():
    q, k = torch.zeros(0, 2, 3), torch.zeros(0, 2, 3)
    assert mt.attention_varlen(q, k, k, [0], [0]).shape == (0, 2, 3)


@pytest.mark.parametrize("cu_q, cu_k, message", [
    ([0, 3, 5], [0, 2, 6], "cu_seqlens_k must start at 0, never decrease and end at the "
                           "packed row count 4"),
    ([1, 5], [0, 4], "cu_seqlens_q must start at 0"),
    ([0, 4, 2, 5], [0, 1, 2, 4], "never decrease"),
    ([0, 5], [0, 2, 4], "the number of cu_seqlens_k's offsets"),
    (torch.tensor([0.0, 5.0]), [0, 4], "cu_seqlens_q must be a 1-D integer tensor"),
    ([0, 2.5, 5], [0, 2, 4], "must hold ints"),
])
def test_bad_offsets_are_refused(cu_q, cu_k, message):
    q, k = torch.zeros(5, 2, 3), torch.zeros(4, 2, 3)
    with pytest.raises(ValueError, match=message):
        mt.attention_varlen(q, k, k, cu_q, cu_k)


def test_bad_shapes_are_refused():
    q, k = torch.zeros(5, 2, 3), torch.zeros(4, 2, 3)
    with pytest.raises(ValueError, match=r"q must have 3 dimensions"):
        mt.attention_varlen(q[None], k, k, [0, 5], [0, 4])
    with pytest.raises(ValueError, match="causal must be True"):
        mt.attention_varlen(q, k, k, [0, 5], [0, 4], causal="lower_right")
