"""What a user would write in PyTorch for each kernel, as fast as PyTorch's own operators
make it: the bench's `torch` baseline, and under torch.compile its `compiled` one. Unlike
the verification references (moagen.reference, moagen.reference_block) these need not be
independent of ours, only honest: each kernel module's BENCH says, next to the function,
what it computes and which of the kernel's outputs it leaves out.

Each takes the kernel's inputs as torch tensors (and its scalars) and returns tensors."""
import torch
import torch.nn.functional as F


def sdpa(Q, K, V, scale, causal=False, enable_gqa=False, offset=0, mask=None):
    """O only: the public SDPA returns no lse. enable_gqa: K and V have fewer heads than Q,
    shared without a copy. offset: causal's query i sees keys j <= i + offset, SDPA's
    is_causal at 0, its boolean mask at any other. mask: its attn_mask."""
    if mask is not None:
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=scale,
                                              enable_gqa=enable_gqa)
    if causal and offset:
        seen = torch.ones(Q.shape[-2], K.shape[-2], dtype=torch.bool, device=Q.device)
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=seen.tril(offset), scale=scale,
                                              enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(Q, K, V, scale=scale, is_causal=causal,
                                          enable_gqa=enable_gqa)


def _attention_grads(Q, K, V, dO, scale, causal, enable_gqa=False, offset=0, mask=None):
    """SDPA's forward, then autograd's backward: (O, dQ, dK, dV)."""
    q, k, v = (t.detach().requires_grad_() for t in (Q, K, V))
    out = sdpa(q, k, v, scale, causal, enable_gqa, offset, mask)
    return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dO)


def sdpa_bwd(Q, K, V, O, dO, lse, scale, causal=False):
    """dQ, dK, dV by autograd, which recomputes the forward (O and lse unused)."""
    return _attention_grads(Q, K, V, dO, scale, causal)[1:]


def sdpa_fwdbwd(Q, K, V, dO, scale, causal=False):
    """O, dQ, dK, dV: the forward and autograd's backward, no lse."""
    return _attention_grads(Q, K, V, dO, scale, causal)


def sdpa_gqa(Q, K, V, scale, causal=False, offset=0):
    """O only, the grouped queries (batch, kv_heads, group, n, d) as SDPA's heads, the KV
    heads shared by enable_gqa."""
    return sdpa(Q.flatten(1, 2), K, V, scale, causal, True, offset).view(Q.shape)


def sdpa_gqa_bwd(Q, K, V, O, dO, lse, scale, causal=False, offset=0):
    """dQ, dK, dV by autograd of SDPA with enable_gqa, which recomputes the forward."""
    _, dq, dk, dv = _attention_grads(Q.flatten(1, 2), K, V, dO.flatten(1, 2), scale, causal,
                                     True, offset)
    return dq.view(Q.shape), dk, dv


def _heads_mask(M):
    """A grouped mask M (batch, kv_heads, group, n_q, n) as SDPA's heads'; a shared one
    (n_q, n) as it is (SDPA broadcasts it)."""
    return M.flatten(1, 2) if M.dim() == 5 else M


def sdpa_gqa_masked(Q, K, V, M, scale):
    """O only, as sdpa_gqa, the mask M (grouped, or shared by every head) as SDPA's
    attn_mask: float (added), or bool (True: the key is seen)."""
    return sdpa(Q.flatten(1, 2), K, V, scale, enable_gqa=True, mask=_heads_mask(M)).view(Q.shape)


def sdpa_gqa_masked_bwd(Q, K, V, M, O, dO, lse, scale):
    """dQ, dK, dV as sdpa_gqa_bwd, under the attn_mask M (float or bool)."""
    _, dq, dk, dv = _attention_grads(Q.flatten(1, 2), K, V, dO.flatten(1, 2), scale, False,
                                     True, mask=_heads_mask(M))
    return dq.view(Q.shape), dk, dv


def _sdpa_dropout(Q, K, V, scale, dropout_p, causal):
    """SDPA with dropout on the grouped queries as its heads: its own random numbers (a
    seed of moagen's has no meaning to it)."""
    return F.scaled_dot_product_attention(Q.flatten(1, 2), K, V, dropout_p=dropout_p,
                                          scale=scale, is_causal=causal, enable_gqa=True)


def sdpa_gqa_dropout(Q, K, V, scale, dropout_p, seed, causal=False):
    """O only, as sdpa_gqa, dropping with SDPA's own generator (seed unused)."""
    return _sdpa_dropout(Q, K, V, scale, dropout_p, causal).view(Q.shape)


def sdpa_gqa_dropout_bwd(Q, K, V, O, dO, lse, scale, dropout_p, seed, causal=False):
    """dQ, dK, dV by autograd of sdpa_gqa_dropout, which recomputes the forward."""
    q, k, v = (t.detach().requires_grad_() for t in (Q, K, V))
    out = _sdpa_dropout(q, k, v, scale, dropout_p, causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dO.flatten(1, 2))
    return dq, dk, dv


def _key_padding(K, last):
    """SDPA's boolean key-padding mask (batch, 1, 1, n): keys 0 to last seen."""
    return (torch.arange(K.shape[2], device=K.device) <= last).view(1, 1, 1, -1)


def sdpa_gqa_padded(Q, K, V, scale, last):
    """O only, as sdpa_gqa, under the boolean key-padding mask of keys 0 to last."""
    return sdpa(Q.flatten(1, 2), K, V, scale, enable_gqa=True,
                mask=_key_padding(K, last)).view(Q.shape)


def sdpa_gqa_padded_bwd(Q, K, V, O, dO, lse, scale, last):
    """dQ, dK, dV as sdpa_gqa_bwd, under the boolean key-padding mask of keys 0 to last."""
    _, dq, dk, dv = _attention_grads(Q.flatten(1, 2), K, V, dO.flatten(1, 2), scale, False,
                                     True, mask=_key_padding(K, last))
    return dq.view(Q.shape), dk, dv


def sdpa_decode(q, K, V, scale, n):
    """O only, over the cache's first n rows, the KV heads shared by enable_gqa (no copy of
    the cache per query head)."""
    out = F.scaled_dot_product_attention(q[:, :, None, :], K[:, :, :n], V[:, :, :n],
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def kv_append(K, V, k_new, v_new, n):
    """Row n written in place, as the kernel does (no copy of the caches)."""
    K[:, :, n], V[:, :, n] = k_new, v_new
    return K, V


def rmsnorm(x, weight, eps):
    """z and inv_rms in the operators F.rms_norm itself runs on a CPU (pow, mean, rsqrt and
    two products), so the statistic the backward keeps costs no extra pass."""
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * inv_rms * weight, inv_rms[..., 0]


def rmsnorm_bwd(x, weight, inv_rms, dz, eps):
    """dx, dweight by autograd of F.rms_norm, which recomputes the statistic."""
    t, w = (a.detach().requires_grad_() for a in (x, weight))
    return torch.autograd.grad(F.rms_norm(t, (x.shape[-1],), w, eps), (t, w), dz)


def rmsnorm_apply(x, weight, inv_rms):
    return x * inv_rms[..., None] * weight


def mlp(X, Wg, Wu, Wd):
    """F, and U = X Wg and V = X Wu (kept for the backward)."""
    u, v = X @ Wg, X @ Wu
    return (F.silu(u) * v) @ Wd, u, v


def mlp_bwd(X, Wg, Wu, Wd, U, V, dF):
    """dX and the weights' gradients by autograd, which recomputes the forward (U and V
    unused)."""
    leaves = [t.detach().requires_grad_() for t in (X, Wg, Wu, Wd)]
    x, wg, wu, wd = leaves
    return torch.autograd.grad((F.silu(x @ wg) * (x @ wu)) @ wd, leaves, dF)


def _split(Y, heads_dh):
    """(batch, n, heads * dh) -> (batch, heads, n, dh)."""
    return Y.unflatten(-1, heads_dh).transpose(1, 2)


def _merged(G):
    """(batch, heads, n, dh) -> (batch * n, heads * dh)."""
    return G.transpose(1, 2).flatten(2).flatten(0, 1)


def qkv_proj(X, Wq, Wk, Wv):
    """Q, K, V as (batch, heads, n, dh) views of one matmul each."""
    return tuple(_split(X @ W.flatten(1), W.shape[1:]) for W in (Wq, Wk, Wv))


def qkv_proj_bwd(X, Wq, Wk, Wv, dQ, dK, dV):
    """The matmuls autograd's backward runs, without its forward."""
    grads = [_merged(g) for g in (dQ, dK, dV)]
    weights = [W.flatten(1) for W in (Wq, Wk, Wv)]
    rows = X.flatten(0, 1)
    dX = sum(g @ w.T for g, w in zip(grads, weights)).view(X.shape)
    return (dX,) + tuple((rows.T @ g).view(W.shape) for g, W in zip(grads, (Wq, Wk, Wv)))


def out_proj(O, Wo, R):
    return torch.addmm(R.flatten(0, 1), _merged(O), Wo.flatten(0, 1)).view(R.shape)


def out_proj_bwd(O, Wo, dY):
    """The matmuls autograd's backward runs, without its forward."""
    rows = dY.flatten(0, 1)
    dO = (rows @ Wo.flatten(0, 1).T).view(dY.shape[0], dY.shape[1], -1)
    return _split(dO, Wo.shape[:2]), (_merged(O).T @ rows).view(Wo.shape)


def residual_add(x, r):
    return x + r


def _block(x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd, eps, scale, causal=False):
    """y and the activations the backward keeps but lse: the stages above in a row."""
    xn1, inv_rms1 = rmsnorm(x, norm1, eps)
    q, k, v = qkv_proj(xn1, Wq, Wk, Wv)
    attn = sdpa(q, k, v, scale, causal)
    resid = out_proj(attn, Wo, x)
    xn2, inv_rms2 = rmsnorm(resid, norm2, eps)
    f, u, up = mlp(xn2, Wg, Wu, Wd)
    return resid + f, (inv_rms1, q, k, v, attn, resid, inv_rms2, u, up)


def block(x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd, eps, scale, causal=False):
    """y, inv_rms1, Q, K, V, attn, resid, inv_rms2, U, Vu: every output but lse."""
    y, kept = _block(x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd, eps, scale, causal)
    return (y,) + kept


def block_bwd(x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd, inv_rms1, Q, K, V, attn, lse,
              resid, inv_rms2, U, Vu, dy, scale, eps, causal=False):
    """The ten gradients by autograd of the block, which recomputes the forward (the kept
    activations unused)."""
    leaves = [t.detach().requires_grad_() for t in (x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu,
                                                    Wd)]
    y, _ = _block(*leaves, eps, scale, causal)
    return torch.autograd.grad(y, leaves, dy)


def _varlen_sequences(cu_q, cu_k, causal):
    """(the first query row that sees a key, the sequence's query end, its key rows) of the
    sequences where a query sees a key: causal bottom-right, a sequence with no keys none."""
    for s in range(len(cu_q) - 1):
        a, b, c, e = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        first = (a + max(b - a - (e - c), 0) if causal else a) if e > c else b
        if first < b:
            yield first, b, slice(c, e)


def _one_sequence(t):
    """A sequence's rows (n, kv_heads, [group,] d) as SDPA's (1, heads, n, d)."""
    return t.flatten(1, -2).transpose(0, 1)[None]


def sdpa_varlen(Q, K, V, cu_q, cu_k, scale, causal=False):
    """O only, a packed batch by one SDPA (enable_gqa) per sequence, causal bottom-right
    (its boolean mask); Q (total_q, kv_heads, group, d), K, V (total_k, kv_heads, d). A
    query that sees no key gets zeros: only those that see one are run."""
    O = torch.zeros_like(Q)
    for first, b, keys in _varlen_sequences(cu_q, cu_k, causal):
        q, k, v = _one_sequence(Q[first:b]), _one_sequence(K[keys]), _one_sequence(V[keys])
        out = sdpa(q, k, v, scale, causal, True, k.shape[2] - q.shape[2])
        O[first:b] = out[0].transpose(0, 1).reshape(O[first:b].shape)
    return O


def sdpa_varlen_bwd(Q, K, V, cu_q, cu_k, O, dO, lse, scale, causal=False):
    """dQ, dK, dV by autograd of one SDPA (enable_gqa) per sequence, which recomputes its
    forward (O and lse unused); zeros for a query that sees no key and a key none sees."""
    dQ, dK, dV = (torch.zeros_like(t) for t in (Q, K, V))
    for first, b, keys in _varlen_sequences(cu_q, cu_k, causal):
        q, k, v, do = (_one_sequence(t) for t in (Q[first:b], K[keys], V[keys], dO[first:b]))
        _, dq, dk, dv = _attention_grads(q, k, v, do, scale, causal, True,
                                         k.shape[2] - q.shape[2])
        for grad, rows in ((dq, dQ[first:b]), (dk, dK[keys]), (dv, dV[keys])):
            rows.copy_(grad[0].transpose(0, 1).reshape(rows.shape))
    return dQ, dK, dV
