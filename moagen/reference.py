"""Independent references for the attention family: numpy written from the math (not from
the specs), and PyTorch's own operators. Both take and return float64 arrays. The block
family's are in moagen.reference_block."""
import numpy as np


# causal: query i sees keys j <= i + offset (offset 0: SDPA's is_causal, top-left; n_k - n_q:
# a cache's, bottom-right); queries and keys may differ in number; mask: (batch, heads, n_q,
# n_k) added to the scaled scores, as SDPA's float attn_mask
def _scores_numpy(Q, K, scale, causal, offset=0, mask=None):
    scores = np.einsum("bhic,bhjc->bhij", Q, K) * scale
    if mask is not None:
        scores = scores + mask
    if causal:
        seen = np.tril(np.ones((Q.shape[-2], K.shape[-2]), dtype=bool), offset)
        scores = np.where(seen, scores, -np.inf)
    return scores


def attention_out_numpy(Q, K, V, scale, causal=False, offset=0, mask=None):
    scores = _scores_numpy(Q, K, scale, causal, offset, mask)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ V


def attention_lse_numpy(Q, K, scale, causal=False, offset=0, mask=None):
    """The per-row logsumexp of the (masked) scaled scores, as the forward pass keeps it."""
    scores = _scores_numpy(Q, K, scale, causal, offset, mask)
    top = scores.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0]


def attention_fwd_numpy(Q, K, V, scale, causal=False, offset=0, mask=None):
    return attention_out_numpy(Q, K, V, scale, causal, offset, mask), \
        attention_lse_numpy(Q, K, scale, causal, offset, mask)


def _seen_torch(q, k, offset):
    import torch
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(offset)


def _scores_torch(q, k, scale, causal, offset=0, mask=None):
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask
    if causal:
        scores = scores.masked_fill(~_seen_torch(q, k, offset), float("-inf"))
    return scores


def attention_fwd_torch(Q, K, V, scale, causal=False, offset=0):
    import torch
    from moagen.baselines import sdpa
    q, k, v = (torch.from_numpy(a) for a in (Q, K, V))
    out = sdpa(q, k, v, scale, causal, offset=offset)
    return out.numpy(), torch.logsumexp(_scores_torch(q, k, scale, causal, offset),
                                        dim=-1).numpy()


def attention_bwd_numpy(Q, K, V, O, dO, lse, scale, causal=False, offset=0, mask=None):
    """The textbook backward: P from the scores, delta as rowsum(dP * P)."""
    scores = _scores_numpy(Q, K, scale, False, mask=mask)
    probs = np.exp(scores - lse[..., None])
    if causal:
        probs = np.tril(probs, offset)
    dprobs = dO @ np.swapaxes(V, -1, -2)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    return scale * dscores @ K, scale * np.swapaxes(dscores, -1, -2) @ Q, \
        np.swapaxes(probs, -1, -2) @ dO


def attention_bwd_torch(Q, K, V, O, dO, lse, scale, causal=False, offset=0):
    """Autograd of scaled_dot_product_attention (O and lse are the forward's own)."""
    import torch
    from moagen.baselines import sdpa
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in (Q, K, V))
    out = sdpa(q, k, v, scale, causal, offset=offset)
    out.backward(torch.from_numpy(dO))
    return q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


def attention_fwdbwd_numpy(Q, K, V, dO, scale, causal=False):
    O, lse = attention_fwd_numpy(Q, K, V, scale, causal)
    return (O, lse) + attention_bwd_numpy(Q, K, V, O, dO, lse, scale, causal)


def attention_fwdbwd_torch(Q, K, V, dO, scale, causal=False):
    import torch
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in (Q, K, V))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)
    out.backward(torch.from_numpy(dO))
    lse = torch.logsumexp(_scores_torch(q, k, scale, causal).detach(), dim=-1)
    return (out.detach().numpy(), lse.numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy())


def _heads(Q):
    """Grouped queries (batch, kv_heads, group, n, ...) as (batch, heads, n, ...): query head
    g * group + r is the r-th of KV head g's group."""
    return Q.reshape(Q.shape[0], -1, *Q.shape[3:])


def _grouped_mask(mask):
    """A grouped mask (batch, kv_heads, group, n_q, n_k) as SDPA's heads', or None."""
    return None if mask is None else _heads(mask)


def attention_gqa_fwd_numpy(Q, K, V, scale, causal=False, offset=0, mask=None):
    """Every KV head repeated for its group's query heads."""
    group = Q.shape[2]
    O, lse = attention_fwd_numpy(_heads(Q), *(np.repeat(a, group, axis=1) for a in (K, V)),
                                 scale, causal, offset, _grouped_mask(mask))
    return O.reshape(Q.shape), lse.reshape(Q.shape[:-1])


def _grouped_mask_torch(mask):
    import torch
    return None if mask is None else torch.from_numpy(_heads(mask))


def attention_gqa_fwd_torch(Q, K, V, scale, causal=False, offset=0, mask=None):
    """SDPA's own grouped heads (enable_gqa); the lse from the repeated keys' scores."""
    import torch
    from moagen.baselines import sdpa
    q, k, v = (torch.from_numpy(a) for a in (_heads(Q), K, V))
    mask = _grouped_mask_torch(mask)
    out = sdpa(q, k, v, scale, causal, True, offset, mask)
    keys = k.repeat_interleave(Q.shape[2], dim=1)
    lse = torch.logsumexp(_scores_torch(q, keys, scale, causal, offset, mask), dim=-1)
    return out.numpy().reshape(Q.shape), lse.numpy().reshape(Q.shape[:-1])


def attention_gqa_bwd_numpy(Q, K, V, O, dO, lse, scale, causal=False, offset=0, mask=None):
    """The repeated KV heads' gradients summed over each group."""
    group = Q.shape[2]
    dQ, dK, dV = attention_bwd_numpy(_heads(Q), *(np.repeat(a, group, axis=1) for a in (K, V)),
                                     _heads(O), _heads(dO), _heads(lse), scale, causal, offset,
                                     _grouped_mask(mask))
    return (dQ.reshape(Q.shape),
            *(g.reshape(*K.shape[:2], group, *K.shape[2:]).sum(axis=2) for g in (dK, dV)))


def attention_gqa_bwd_torch(Q, K, V, O, dO, lse, scale, causal=False, offset=0, mask=None):
    """Autograd of SDPA with enable_gqa (O and lse are the forward's own)."""
    import torch
    from moagen.baselines import sdpa
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in (_heads(Q), K, V))
    out = sdpa(q, k, v, scale, causal, True, offset, _grouped_mask_torch(mask))
    out.backward(torch.from_numpy(_heads(dO)))
    return q.grad.numpy().reshape(Q.shape), k.grad.numpy(), v.grad.numpy()


# dropout (moagen.kernels.attention_dropout): the probabilities of the (batch, heads, n, n)
# scores times moagen.philox's keep mask, scaled by 1 / (1 - p), weight V; the lse is the
# softmax's own
def _dropout_scale(Q, dropout_p, seed):
    """Z / (1 - p) of the grouped queries' probabilities, as (batch, heads, n, n)."""
    from moagen.philox import keep_mask
    heads, n = Q.shape[1] * Q.shape[2], Q.shape[3]
    return keep_mask((Q.shape[0], heads, n, n), seed, dropout_p) / (1.0 - dropout_p)


def _dropout_probs(Q, K, scale, dropout_p, seed, causal):
    """The grouped queries as heads, each KV head repeated for its group, the softmax's
    probabilities and the dropped ones."""
    keys = np.repeat(K, Q.shape[2], axis=1)
    scores = _scores_numpy(_heads(Q), keys, scale, causal)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs, probs * _dropout_scale(Q, dropout_p, seed)


def attention_dropout_fwd_numpy(Q, K, V, scale, dropout_p, seed, causal=False):
    _, dropped = _dropout_probs(Q, K, scale, dropout_p, seed, causal)
    O = dropped @ np.repeat(V, Q.shape[2], axis=1)
    lse = attention_lse_numpy(_heads(Q), np.repeat(K, Q.shape[2], axis=1), scale, causal)
    return O.reshape(Q.shape), lse.reshape(Q.shape[:-1])


def attention_dropout_bwd_numpy(Q, K, V, O, dO, lse, scale, dropout_p, seed, causal=False):
    """The textbook backward through the dropped probabilities, delta as rowsum(dP * P)
    (O and lse unused); the repeated KV heads' gradients summed over each group."""
    group = Q.shape[2]
    probs, dropped = _dropout_probs(Q, K, scale, dropout_p, seed, causal)
    values, dout = np.repeat(V, group, axis=1), _heads(dO)
    dprobs = dout @ np.swapaxes(values, -1, -2) * _dropout_scale(Q, dropout_p, seed)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    dK = scale * np.swapaxes(dscores, -1, -2) @ _heads(Q)
    dV = np.swapaxes(dropped, -1, -2) @ dout
    return ((scale * dscores @ np.repeat(K, group, axis=1)).reshape(Q.shape),
            *(g.reshape(*K.shape[:2], group, *K.shape[2:]).sum(axis=2) for g in (dK, dV)))


def _dropout_torch(Q, K, V, scale, dropout_p, seed, causal):
    """O and lse by PyTorch's operators under the same keep mask (as a tensor), from
    leaves q, k, v that require grad."""
    import torch
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in (_heads(Q), K, V))
    keys, values = (t.repeat_interleave(Q.shape[2], dim=1) for t in (k, v))
    scores = _scores_torch(q, keys, scale, causal)
    mask = torch.from_numpy(_dropout_scale(Q, dropout_p, seed))
    out = (torch.softmax(scores, dim=-1) * mask) @ values
    return (q, k, v), out, torch.logsumexp(scores, dim=-1)


def attention_dropout_fwd_torch(Q, K, V, scale, dropout_p, seed, causal=False):
    _, out, lse = _dropout_torch(Q, K, V, scale, dropout_p, seed, causal)
    return out.detach().numpy().reshape(Q.shape), lse.detach().numpy().reshape(Q.shape[:-1])


def attention_dropout_bwd_torch(Q, K, V, O, dO, lse, scale, dropout_p, seed, causal=False):
    """Autograd through the same dropped probabilities (O and lse unused)."""
    import torch
    leaves, out, _ = _dropout_torch(Q, K, V, scale, dropout_p, seed, causal)
    out.backward(torch.from_numpy(_heads(dO)))
    q, k, v = (t.grad.numpy() for t in leaves)
    return q.reshape(Q.shape), k, v


def attention_decode_numpy(q, K, V, scale, n):
    """One query row per head against the first n cache rows; query head h reads KV head
    h // (q_heads / kv_heads)."""
    group = q.shape[1] // K.shape[1]
    keys, values = (np.repeat(c[:, :, :n], group, axis=1) for c in (K, V))
    O, lse = attention_fwd_numpy(q[:, :, None, :], keys, values, scale)
    return O[:, :, 0, :], lse[:, :, 0]


def attention_decode_torch(q, K, V, scale, n):
    import torch
    query = torch.from_numpy(q)[:, :, None, :]
    keys, values = (torch.from_numpy(np.ascontiguousarray(c[:, :, :n])) for c in (K, V))
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale,
                                                           enable_gqa=True)
    group = q.shape[1] // K.shape[1]
    scores = _scores_torch(query, keys.repeat_interleave(group, dim=1), scale, False)
    return out[:, :, 0, :].numpy(), torch.logsumexp(scores, dim=-1)[:, :, 0].numpy()


def kv_append_numpy(K, V, k_new, v_new, n):
    K, V = K.copy(), V.copy()
    K[:, :, n], V[:, :, n] = k_new, v_new
    return K, V


def kv_append_torch(K, V, k_new, v_new, n):
    import torch
    caches = [torch.from_numpy(c).clone() for c in (K, V)]
    for cache, row in zip(caches, (k_new, v_new)):
        cache.index_copy_(2, torch.tensor([n]), torch.from_numpy(row)[:, :, None, :])
    return tuple(c.numpy() for c in caches)


# a packed batch (varlen): Q (total_q, kv_heads, group, d), K, V (total_k, kv_heads, d),
# sequence s the rows cu_q[s]..cu_q[s+1]-1 of Q and cu_k[s]..cu_k[s+1]-1 of K and V; causal
# bottom-right within a sequence (query i of n_q sees keys j <= i + n_k - n_q); a query that
# sees no key O = 0, lse = -inf (FlashAttention's varlen)
def _sequences(cu_q, cu_k, causal):
    """Each sequence's query rows, key rows, and the first of its queries that sees a key,
    for the sequences where one does."""
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
        first = (max(n_q - n_k, 0) if causal else 0) if n_k else n_q
        if first < n_q:
            yield rows, keys, first


def _varlen_scores(q, k, scale, causal):
    """A sequence's scores (group heads, query heads, queries, keys) of the queries q that
    see a key."""
    scores = np.einsum("igrc,jgc->grij", q, k) * scale
    if causal:  # query first + i at i + first + n_k - n_q = i + (n_k - len(q)) here
        seen = np.tril(np.ones((len(q), len(k)), dtype=bool), len(k) - len(q))
        scores = np.where(seen, scores, -np.inf)
    return scores


def attention_varlen_fwd_numpy(Q, K, V, cu_q, cu_k, scale, causal=False):
    """Each sequence's softmax by its own scores, written from the math."""
    O, lse = np.zeros(Q.shape), np.full(Q.shape[:-1], -np.inf)
    for rows, keys, first in _sequences(cu_q, cu_k, causal):
        q, k, v = Q[rows][first:], K[keys], V[keys]
        scores = _varlen_scores(q, k, scale, causal)
        top = scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores - top)
        total = weights.sum(axis=-1, keepdims=True)
        O[rows][first:] = np.einsum("grij,jgc->igrc", weights / total, v)
        lse[rows][first:] = (top + np.log(total))[..., 0].transpose(2, 0, 1)
    return O, lse


def attention_varlen_fwd_torch(Q, K, V, cu_q, cu_k, scale, causal=False):
    """SDPA (enable_gqa) on each sequence's queries that see a key; lse by torch's
    logsumexp of the same scores."""
    import torch
    from moagen.baselines import sdpa
    O, lse = torch.zeros(Q.shape, dtype=torch.float64), torch.full(Q.shape[:-1], -np.inf,
                                                                     dtype=torch.float64)
    for rows, keys, first in _sequences(cu_q, cu_k, causal):
        q = torch.from_numpy(Q[rows][first:]).flatten(1, 2).transpose(0, 1)[None]
        k, v = (torch.from_numpy(a[keys]).transpose(0, 1)[None] for a in (K, V))
        offset = k.shape[2] - q.shape[2]
        out = sdpa(q, k, v, scale, causal, True, offset)
        scores = _scores_torch(q, k.repeat_interleave(Q.shape[2], dim=1), scale, causal, offset)
        O[rows][first:] = out[0].transpose(0, 1).reshape(-1, *Q.shape[1:])
        lse[rows][first:] = torch.logsumexp(scores, dim=-1)[0].transpose(0, 1).reshape(
            -1, *Q.shape[1:3])
    return O.numpy(), lse.numpy()


def attention_varlen_bwd_numpy(Q, K, V, cu_q, cu_k, O, dO, lse, scale, causal=False):
    """Each sequence's gradients from its own probabilities, written from the math (O and
    lse unused); dK and dV summed over each KV head's group. A query that sees no key, and
    a key that no query sees, gets zeros."""
    dQ, dK, dV = np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)
    for rows, keys, first in _sequences(cu_q, cu_k, causal):
        q, k, v, do = Q[rows][first:], K[keys], V[keys], dO[rows][first:]
        scores = _varlen_scores(q, k, scale, causal)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = weights / weights.sum(axis=-1, keepdims=True)
        dprobs = np.einsum("igrc,jgc->grij", do, v)
        dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) * scale
        dQ[rows][first:] = np.einsum("grij,jgc->igrc", dscores, k)
        dK[keys] = np.einsum("grij,igrc->jgc", dscores, q)
        dV[keys] = np.einsum("grij,igrc->jgc", probs, do)
    return dQ, dK, dV


def attention_varlen_bwd_torch(Q, K, V, cu_q, cu_k, O, dO, lse, scale, causal=False):
    """Autograd of SDPA (enable_gqa) on each sequence's queries that see a key (O and lse
    unused)."""
    import torch
    from moagen.baselines import sdpa
    grads = [np.zeros(a.shape) for a in (Q, K, V)]
    for rows, keys, first in _sequences(cu_q, cu_k, causal):
        leaves = [torch.from_numpy(a.copy()).requires_grad_()
                  for a in (Q[rows][first:], K[keys], V[keys])]
        q, k, v = (t.flatten(1, -2).transpose(0, 1)[None] for t in leaves)
        out = sdpa(q, k, v, scale, causal, True, k.shape[2] - q.shape[2])
        out.backward(torch.from_numpy(dO[rows][first:]).flatten(1, 2).transpose(0, 1)[None])
        for grad, at, leaf in zip(grads, (slice(rows.start + first, rows.stop), keys, keys),
                                  leaves):
            grad[at] = leaf.grad.numpy()
    return tuple(grads)
