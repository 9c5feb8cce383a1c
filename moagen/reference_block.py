"""Independent references for the block family (RMSNorm backward, the gated MLP, the whole
block): numpy written from the math, and PyTorch autograd of the same expression. Both
take and return float64 arrays."""
import numpy as np


def rmsnorm_fwd_numpy(x, weight, eps):
    inv_rms = 1 / np.sqrt(np.mean(x * x, axis=-1) + eps)
    return weight * x * inv_rms[..., None], inv_rms


def rmsnorm_fwd_torch(x, weight, eps):
    import torch
    t = torch.from_numpy(x)
    z = torch.nn.functional.rms_norm(t, (x.shape[-1],), torch.from_numpy(weight), eps)
    return z.numpy(), torch.rsqrt(t.pow(2).mean(-1) + eps).numpy()


def rmsnorm_bwd_numpy(x, weight, inv_rms, dz):
    xhat = x * inv_rms[..., None]
    g = dz * weight
    dx = inv_rms[..., None] * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    return dx, (dz * xhat).reshape(-1, x.shape[-1]).sum(axis=0)


def rmsnorm_bwd_torch(x, weight, inv_rms, dz, eps=None):
    """Autograd of rms_norm; the eps it needs is the one inv_rms was computed with."""
    import torch
    t, w = (torch.from_numpy(a).requires_grad_() for a in (x, weight))
    z = torch.nn.functional.rms_norm(t, (x.shape[-1],), w, eps)
    z.backward(torch.from_numpy(dz))
    return t.grad.numpy(), w.grad.numpy()


def rmsnorm_apply_numpy(x, weight, inv_rms):
    return weight * x * inv_rms[..., None]


def rmsnorm_apply_torch(x, weight, inv_rms):
    import torch
    t = torch.from_numpy(x) * torch.from_numpy(inv_rms)[..., None]
    return (t * torch.from_numpy(weight)).numpy()


def _heads(W):
    """(dm, heads, dh) -> the (dm, heads * dh) matrix a framework stores."""
    return W.reshape(W.shape[0], -1)


def _split_heads(Y, heads):
    """(batch, n, heads * dh) -> (batch, heads, n, dh)."""
    b, n, _ = Y.shape
    return Y.reshape(b, n, heads, -1).transpose(0, 2, 1, 3)


def _merge_heads(Y):
    """(batch, heads, n, dh) -> (batch, n, heads * dh)."""
    b, h, n, d = Y.shape
    return Y.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def qkv_proj_numpy(X, Wq, Wk, Wv):
    return tuple(_split_heads(X @ _heads(W), W.shape[1]) for W in (Wq, Wk, Wv))


def qkv_proj_torch(X, Wq, Wk, Wv):
    import torch
    x = torch.from_numpy(X)
    return tuple((x @ torch.from_numpy(_heads(W))).unflatten(-1, W.shape[1:]).transpose(1, 2)
                 .numpy() for W in (Wq, Wk, Wv))


def qkv_proj_bwd_numpy(X, Wq, Wk, Wv, dQ, dK, dV):
    grads = [_merge_heads(g) for g in (dQ, dK, dV)]
    dX = sum(g @ _heads(W).T for g, W in zip(grads, (Wq, Wk, Wv)))
    rows = X.reshape(-1, X.shape[-1])
    return (dX,) + tuple((rows.T @ g.reshape(rows.shape[0], -1)).reshape(W.shape)
                         for g, W in zip(grads, (Wq, Wk, Wv)))


def qkv_proj_bwd_torch(X, Wq, Wk, Wv, dQ, dK, dV):
    import torch
    x, *ws = (torch.from_numpy(a).requires_grad_() for a in (X, Wq, Wk, Wv))
    outs = [(x @ w.flatten(1)).unflatten(-1, w.shape[1:]).transpose(1, 2) for w in ws]
    torch.autograd.backward(outs, [torch.from_numpy(g) for g in (dQ, dK, dV)])
    return tuple(t.grad.numpy() for t in [x] + ws)


def out_proj_numpy(O, Wo, R):
    return R + _merge_heads(O) @ Wo.reshape(-1, Wo.shape[-1])


def out_proj_torch(O, Wo, R):
    import torch
    o = torch.from_numpy(O).transpose(1, 2).flatten(2)
    return (torch.from_numpy(R) + o @ torch.from_numpy(Wo).flatten(0, 1)).numpy()


def out_proj_bwd_numpy(O, Wo, dY):
    heads, dh, dm = Wo.shape
    dO = _split_heads(dY @ Wo.reshape(-1, dm).T, heads)
    rows = _merge_heads(O).reshape(-1, heads * dh)
    return dO, (rows.T @ dY.reshape(-1, dm)).reshape(Wo.shape)


def out_proj_bwd_torch(O, Wo, dY):
    import torch
    o, wo = (torch.from_numpy(a).requires_grad_() for a in (O, Wo))
    y = o.transpose(1, 2).flatten(2) @ wo.flatten(0, 1)
    y.backward(torch.from_numpy(dY))
    return o.grad.numpy(), wo.grad.numpy()


def residual_add_numpy(x, r):
    return x + r


def residual_add_torch(x, r):
    import torch
    return torch.add(torch.from_numpy(x), torch.from_numpy(r)).numpy()


def _sigmoid(u):
    return 1.0 / (1.0 + np.exp(-u))


def _silu(u):
    return u * _sigmoid(u)


def mlp_fwd_numpy(X, Wg, Wu, Wd):
    """F, and U and V (the products the backward keeps)."""
    U, V = X @ Wg, X @ Wu
    return (_silu(U) * V) @ Wd, U, V


def mlp_fwd_torch(X, Wg, Wu, Wd):
    import torch
    x, wg, wu, wd = (torch.from_numpy(a) for a in (X, Wg, Wu, Wd))
    u, v = x @ wg, x @ wu
    return (torch.nn.functional.silu(u) * v @ wd).numpy(), u.numpy(), v.numpy()


def mlp_bwd_numpy(X, Wg, Wu, Wd, U, V, dF):
    """The chain rule by hand, H recomputed from U and V."""
    sig = _sigmoid(U)
    H = U * sig * V
    dH = dF @ Wd.T
    dV = dH * U * sig
    dU = dH * V * sig * (1 + U * (1 - sig))
    rows = lambda a: a.reshape(-1, a.shape[-1])
    return (dU @ Wg.T + dV @ Wu.T, rows(X).T @ rows(dU), rows(X).T @ rows(dV),
            rows(H).T @ rows(dF))


def mlp_bwd_torch(X, Wg, Wu, Wd, U, V, dF):
    """Autograd of the forward (U and V unused: the kernel assumes they are X Wg and X Wu)."""
    import torch
    x, wg, wu, wd = (torch.from_numpy(a).requires_grad_() for a in (X, Wg, Wu, Wd))
    f = torch.nn.functional.silu(x @ wg) * (x @ wu) @ wd
    f.backward(torch.from_numpy(dF))
    return tuple(t.grad.numpy() for t in (x, wg, wu, wd))


def block_fwd_numpy(x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd, eps, scale, causal=False):
    """y and what the backward keeps: inv_rms1, Q, K, V, attn, lse, resid, inv_rms2, and the
    MLP's U and V (Vu)."""
    from moagen.reference import attention_fwd_numpy
    xn1, inv_rms1 = rmsnorm_fwd_numpy(x, norm1, eps)
    Q, K, V = qkv_proj_numpy(xn1, Wq, Wk, Wv)
    attn, lse = attention_fwd_numpy(Q, K, V, scale, causal)
    resid = out_proj_numpy(attn, Wo, x)
    xn2, inv_rms2 = rmsnorm_fwd_numpy(resid, norm2, eps)
    F, U, Vu = mlp_fwd_numpy(xn2, Wg, Wu, Wd)
    return resid + F, inv_rms1, Q, K, V, attn, lse, resid, inv_rms2, U, Vu


def _block_torch(x, weights, eps, scale, causal=False):
    """The block in PyTorch's own operators (rms_norm, matmuls, sdpa, silu): y and the
    activations the backward keeps, in block_fwd's order."""
    import torch
    norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd = weights
    rms = lambda t, w: torch.nn.functional.rms_norm(t, (t.shape[-1],), w, eps)
    inv_rms = lambda t: torch.rsqrt(t.pow(2).mean(-1) + eps)
    xn1 = rms(x, norm1)
    q, k, v = ((xn1 @ w.flatten(1)).unflatten(-1, w.shape[1:]).transpose(1, 2)
               for w in (Wq, Wk, Wv))
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale,
                                                            is_causal=causal)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        n = scores.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    resid = x + attn.transpose(1, 2).flatten(2) @ Wo.flatten(0, 1)
    xn2 = rms(resid, norm2)
    u, up = xn2 @ Wg, xn2 @ Wu
    y = resid + (torch.nn.functional.silu(u) * up) @ Wd
    return y, (inv_rms(x), q, k, v, attn, lse, resid, inv_rms(resid), u, up)


def block_fwd_torch(x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd, eps, scale, causal=False):
    import torch
    t = [torch.from_numpy(a) for a in (x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd)]
    y, kept = _block_torch(t[0], t[1:], eps, scale, causal)
    return tuple(a.numpy() for a in (y,) + kept)


def block_bwd_numpy(x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd, inv_rms1, Q, K, V, attn, lse,
                    resid, inv_rms2, U, Vu, dy, scale, causal=False):
    """The chain rule through the stages by hand (the numpy references above)."""
    from moagen.reference import attention_bwd_numpy
    xn2 = rmsnorm_apply_numpy(resid, norm2, inv_rms2)
    dxn2, dWg, dWu, dWd = mlp_bwd_numpy(xn2, Wg, Wu, Wd, U, Vu, dy)
    dresid_norm, dnorm2 = rmsnorm_bwd_numpy(resid, norm2, inv_rms2, dxn2)
    dresid = dy + dresid_norm
    dattn, dWo = out_proj_bwd_numpy(attn, Wo, dresid)
    dQ, dK, dV = attention_bwd_numpy(Q, K, V, attn, dattn, lse, scale, causal)
    xn1 = rmsnorm_apply_numpy(x, norm1, inv_rms1)
    dxn1, dWq, dWk, dWv = qkv_proj_bwd_numpy(xn1, Wq, Wk, Wv, dQ, dK, dV)
    dx_norm, dnorm1 = rmsnorm_bwd_numpy(x, norm1, inv_rms1, dxn1)
    return dresid + dx_norm, dnorm1, dWq, dWk, dWv, dWo, dnorm2, dWg, dWu, dWd


def block_bwd_torch(x, norm1, Wq, Wk, Wv, Wo, norm2, Wg, Wu, Wd, inv_rms1, Q, K, V, attn, lse,
                    resid, inv_rms2, U, Vu, dy, scale, eps=None, causal=False):
    """Autograd of the whole block from x and the weights (the kept arrays unused)."""
    import torch
    t = [torch.from_numpy(a).requires_grad_() for a in (x, norm1, Wq, Wk, Wv, Wo, norm2, Wg,
                                                         Wu, Wd)]
    y, _ = _block_torch(t[0], t[1:], eps, scale, causal)
    y.backward(torch.from_numpy(dy))
    return tuple(a.grad.numpy() for a in t)
