"""Attention with dropout on its probabilities as a PyTorch operator, for
moagen.torch.attention(..., dropout_p=p) (#54 item 3): O = (P * Z / (1 - p)) v, as
F.scaled_dot_product_attention(..., dropout_p=p) computes it, but with moagen's random
numbers, not SDPA's: Z is drawn by Philox4x32-10 (moagen.philox) from a 63-bit seed that
each call draws from PyTorch's default CPU generator, so that torch.manual_seed makes a call
reproducible. The seed is all the backward keeps of Z: attention_dropout_bwd draws the same
mask again from it, and stores none.

    forward   O and the row logsumexp by attention_dropout_fwd's `flash` kernel (one pass
              over key blocks, both products register tiles, O(n d) memory; its schedule
              fitted to n and d as attention_gqa_fwd's)
    backward  dQ, dK, dV by attention_dropout_bwd's `flash` kernel (derived from the forward
              by moagen.moa.grad: delta = rowsum(dO * O), O the dropped forward's output;
              FlashAttention-2's backward, the key rows owning dK and dV)

Queries and keys as many (so that both causal alignments are one), no attn_mask: the
kernels' cases; the public function refuses the others with dropout."""
import torch
from torch import Tensor

from moagen.torch_ops.attention_args import check_attention, fitted_params, grouped
from moagen.torch_ops.native import call, causal_name, check_size
from moagen.torch_ops.operator import Operator



def draw_seed() -> int:
    """A seed for one call's mask, from PyTorch's default CPU generator (a CUDA call's too:
    the kernels take the seed as an integer argument)."""
    return int(torch.randint(2 ** 63 - 1, (), dtype=torch.int64))


def check_dropout_p(op: str, dropout_p) -> float:
    """dropout_p as a float in [0, 1): SDPA's range (p = 1 would scale by 1 / 0)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{op}: dropout_p must be a float in [0, 1), got "
                        f"{type(dropout_p).__name__}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def _check_dropout(op, q, k, v, lang, dropout_p, seed):
    check_attention(op, q, k, v, lang)
    check_size(op, "k's length (dropout needs as many queries as keys)", k.shape[2], q.shape[2])
    check_dropout_p(op, dropout_p)
    # a seed drawn under torch.compile is symbolic there: nothing to check until it runs
    if isinstance(seed, int) and not 0 <= seed < 2 ** 63:
        raise ValueError(f"{op}: the seed must be in [0, 2**63), got {seed}")


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, dropout_p: float,
             seed: int, lang: str) -> tuple[Tensor, Tensor]:
    """O and the row logsumexp (the softmax's, which dropout leaves as it is)."""
    name = causal_name("attention_dropout_fwd", causal)
    return call(name, "flash", lang, grouped(q, k.shape[1]), k, v, scale=scale,
                dropout_p=dropout_p, seed=seed, params=fitted_params(name, q, k, causal, lang),
                out_shapes=(q.shape, q.shape[:-1]))


def _forward_fake(q, k, v, causal, scale, dropout_p, seed, lang):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1])


def _backward_kernel(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     grad_out: Tensor, causal: bool, scale: float, dropout_p: float, seed: int,
                     lang: str) -> tuple[Tensor, Tensor, Tensor]:
    kv_heads, name = k.shape[1], causal_name("attention_dropout_bwd", causal)
    return call(name, "flash", lang, grouped(q, kv_heads), k, v,
                *(grouped(t, kv_heads) for t in (out, grad_out, lse)), scale=scale,
                dropout_p=dropout_p, seed=seed, params=fitted_params(name, q, k, causal, lang),
                out_shapes=(q.shape,))


def _backward_fake(q, k, v, out, lse, grad_out, causal, scale, dropout_p, seed, lang):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


attention_dropout_backward_op = Operator(
    "moagen::attention_dropout_backward", _backward_kernel, _backward_fake,
    check=lambda q, k, v, out, lse, grad_out, causal, scale, dropout_p, seed, lang:
    _check_dropout("moagen::attention_dropout_backward", q, k, v, lang, dropout_p, seed))


def _setup(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.scale, ctx.dropout_p, ctx.seed, ctx.lang = inputs
    ctx.save_for_backward(q, k, v, *output)  # the seed, not the mask
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # the logsumexp's gradient: never read


def _backward(ctx, grad_out, _grad_lse):
    if grad_out is None:
        return (None,) * 8
    dq, dk, dv = attention_dropout_backward_op(*ctx.saved_tensors, grad_out, ctx.causal,
                                               ctx.scale, ctx.dropout_p, ctx.seed, ctx.lang)
    return dq, dk, dv, None, None, None, None, None


attention_dropout_op = Operator(
    "moagen::attention_dropout", _forward, _forward_fake,
    check=lambda q, k, v, causal, scale, dropout_p, seed, lang: _check_dropout(
        "moagen::attention_dropout", q, k, v, lang, dropout_p, seed),
    backward=_backward, setup_context=_setup, instead="F.scaled_dot_product_attention")


def attention_with_dropout(op: str, q: Tensor, k: Tensor, v: Tensor, attn_mask, causal,
                           scale: float, dropout_p, lang: str) -> Tensor:
    """moagen.torch.attention's dropout_p != 0 (its q, k, v and lang checked, scale set)."""
    dropout_p = check_dropout_p(op, dropout_p)
    if attn_mask is not None or q.shape[2] != k.shape[2]:
        raise NotImplementedError(
            f"{op}: dropout_p with an attn_mask, or with queries and keys of different "
            f"lengths ({q.shape[2]} and {k.shape[2]}), is not implemented; the dropout "
            "kernels take as many queries as keys, causal or not")
    # as many queries as keys: causal "lower_right" is top-left
    return attention_dropout_op(q.contiguous(), k.contiguous(), v.contiguous(), bool(causal),
                                scale, dropout_p, draw_seed(), lang)[0]
