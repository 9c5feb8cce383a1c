"""Independent references: numpy written from the math (not from the specs), and PyTorch's
own operators. Both take and return float64 arrays."""
import numpy as np


def attention_fwd_numpy(Q, K, V, scale, causal=False):
    scores = np.einsum("bhic,bhjc->bhij", Q, K) * scale
    if causal:
        n = Q.shape[-2]
        scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ V


def attention_fwd_torch(Q, K, V, scale, causal=False):
    import torch
    q, k, v = (torch.from_numpy(a) for a in (Q, K, V))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale,
                                                            is_causal=causal).numpy()


def rmsnorm_fwd_numpy(x, weight, eps):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rmsnorm_fwd_torch(x, weight, eps):
    import torch
    t = torch.nn.functional.rms_norm(torch.from_numpy(x), (x.shape[-1],),
                                     torch.from_numpy(weight), eps)
    return t.numpy()


def attention_lse_numpy(Q, K, scale, causal=False):
    """The per-row logsumexp of the (masked) scaled scores, as the forward pass keeps it."""
    scores = np.einsum("bhic,bhjc->bhij", Q, K) * scale
    if causal:
        n = Q.shape[-2]
        scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0]


def attention_bwd_numpy(Q, K, V, O, dO, lse, scale, causal=False):
    """The textbook backward: P from the scores, delta as rowsum(dP * P)."""
    scores = np.einsum("bhic,bhjc->bhij", Q, K) * scale
    probs = np.exp(scores - lse[..., None])
    if causal:
        probs = np.tril(probs)
    dprobs = dO @ np.swapaxes(V, -1, -2)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    return scale * dscores @ K, scale * np.swapaxes(dscores, -1, -2) @ Q, \
        np.swapaxes(probs, -1, -2) @ dO


def attention_bwd_torch(Q, K, V, O, dO, lse, scale, causal=False):
    """Autograd of scaled_dot_product_attention (O and lse are the forward's own)."""
    import torch
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in (Q, K, V))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)
    out.backward(torch.from_numpy(dO))
    return q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


def attention_fwdbwd_numpy(Q, K, V, dO, scale, causal=False):
    O = attention_fwd_numpy(Q, K, V, scale, causal)
    lse = attention_lse_numpy(Q, K, scale, causal)
    return (O, lse) + attention_bwd_numpy(Q, K, V, O, dO, lse, scale, causal)


def attention_fwdbwd_torch(Q, K, V, dO, scale, causal=False):
    import torch
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in (Q, K, V))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)
    out.backward(torch.from_numpy(dO))
    scores = (q @ k.transpose(-1, -2) * scale).detach()
    if causal:
        n = Q.shape[-2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (out.detach().numpy(), lse.numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy())
