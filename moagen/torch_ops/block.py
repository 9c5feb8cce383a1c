"""The transformer block as an nn.Module over moagen's composed block kernels:

    forward   block_fwd[_causal]: y, and the activations the backward reads (the per-row
              RMSNorm statistics, Q, K, V, the attention output and its row logsumexp,
              the residual, the MLP's U and V), saved by autograd
    backward  block_bwd[_causal]: dx and every weight's gradient from x, the weights, those
              activations and dy

x (batch, n, d_model) -> rmsnorm -> Q, K, V per head -> attention (causal or not) -> output
projection + x -> rmsnorm -> gated MLP -> + residual. The weights in the kernels' layout: Wq, Wk, Wv (d_model, heads, d_head), Wo
(heads, d_head, d_model), Wg, Wu (d_model, d_ff), Wd (d_ff, d_model)."""
import math
from typing import List

import torch
from torch import Tensor, nn

from moagen.kernels.block import FORWARD
from moagen.torch_ops.native import (call, causal_name, check_dims, check_lang, check_size,
                                     check_tensors)
from moagen.torch_ops.operator import Operator

WEIGHTS = tuple(a.name for a in FORWARD.inputs[1:])  # norm1, Wq, ..., Wd
KEPT = FORWARD.kept()  # what block_fwd returns after y, in its order


def _shapes(x, heads, d_head, d_ff):
    d_model = x.shape[-1]
    head_w = (d_model, heads, d_head)
    return {"norm1": (d_model,), "Wq": head_w, "Wk": head_w, "Wv": head_w,
            "Wo": (heads, d_head, d_model), "norm2": (d_model,), "Wg": (d_model, d_ff),
            "Wu": (d_model, d_ff), "Wd": (d_ff, d_model)}


def _check(op, x, weights, lang):
    check_lang(op, lang)
    if len(weights) != len(WEIGHTS):
        raise ValueError(f"{op}: expected the {len(WEIGHTS)} weights {', '.join(WEIGHTS)}, "
                         f"got {len(weights)}")
    check_tensors(op, x=x, **dict(zip(WEIGHTS, weights)))
    check_dims(op, "x", x, 3, "(batch, n, d_model)")
    check_dims(op, "Wq", weights[1], 3, "(d_model, heads, d_head)")
    check_dims(op, "Wg", weights[6], 2, "(d_model, d_ff)")
    _, heads, d_head = weights[1].shape
    expected = _shapes(x, heads, d_head, weights[6].shape[1])
    for name, w in zip(WEIGHTS, weights):
        check_size(op, f"{name}'s shape", tuple(w.shape), expected[name])


def _kept_shapes(x, weights):
    batch, n, d_model = x.shape
    _, heads, d_head = weights[1].shape
    per_head = (batch, heads, n, d_head)
    hidden = (batch, n, weights[6].shape[1])
    return {"inv_rms1": (batch, n), "Q": per_head, "K": per_head, "V": per_head,
            "attn": per_head, "lse": (batch, heads, n), "resid": (batch, n, d_model),
            "inv_rms2": (batch, n), "U": hidden, "Vu": hidden}


def _block(x: Tensor, weights: List[Tensor], eps: float, scale: float, causal: bool,
           lang: str) -> List[Tensor]:
    """[y, *kept]."""
    _check("moagen::block", x, weights, lang)
    return list(call(causal_name("block_fwd", causal), "composed", lang, x, *weights,
                     eps=eps, scale=scale))


def _block_fake(x, weights, eps, scale, causal, lang):
    _check("moagen::block", x, weights, lang)
    return [x.new_empty(x.shape)] + [x.new_empty(s) for s in _kept_shapes(x, weights).values()]


def _block_backward(x: Tensor, weights: List[Tensor], kept: List[Tensor], grad_y: Tensor,
                    scale: float, causal: bool, lang: str) -> List[Tensor]:
    """[dx, dnorm1, dWq, ..., dWd]."""
    return list(call(causal_name("block_bwd", causal), "composed", lang, x, *weights, *kept,
                     grad_y, scale=scale))


block_backward_op = Operator(
    "moagen::block_backward", _block_backward,
    lambda x, weights, kept, grad_y, scale, causal, lang: [t.new_empty(t.shape)
                                                           for t in (x, *weights)])


def _setup(ctx, inputs, output):
    x, weights, _eps, ctx.scale, ctx.causal, ctx.lang = inputs
    ctx.n_weights = len(weights)
    ctx.save_for_backward(x, *weights, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    # a gradient not given stays None (the non-differentiable outputs': never read), not zeros
    ctx.set_materialize_grads(False)


def _backward(ctx, grads):
    if grads[0] is None:
        return None, [None] * ctx.n_weights, None, None, None, None
    x, *rest = ctx.saved_tensors
    weights, kept = rest[:ctx.n_weights], rest[ctx.n_weights:]
    dx, *dweights = block_backward_op(x, weights, kept, grads[0], ctx.scale, ctx.causal,
                                      ctx.lang)
    return dx, dweights, None, None, None, None


# a list of tensors (the weights) takes the custom op's path (moagen.torch_ops.operator)
block_op = Operator("moagen::block", _block, _block_fake, backward=_backward,
                    setup_context=_setup,
                    instead="PyTorch's operators (the block of moagen/reference_block.py)")


class Block(nn.Module):
    """A pre-norm transformer block whose forward and backward are moagen's block kernels.
    Weights are initialized as a model's are (matrices N(0, 1/fan_in), norms 1). lang: the
    CPU kernels' language; moved to a GPU (.cuda()), the block runs the CUDA kernels.
    Differentiable once: differentiating the gradients raises (moagen.torch_ops.operator)."""

    def __init__(self, d_model: int, heads: int, d_head: int, d_ff: int, eps: float = 1e-5,
                 dtype=torch.float32, lang: str = "c", causal: bool = False):
        super().__init__()
        check_lang("moagen.torch.Block", lang)
        if min(d_model, heads, d_head, d_ff) < 1:
            raise ValueError("moagen.torch.Block: d_model, heads, d_head and d_ff must be at "
                             f"least 1, got {d_model}, {heads}, {d_head}, {d_ff}")
        if not eps > 0:
            raise ValueError(f"moagen.torch.Block: eps must be positive, got {eps}")
        self.eps, self.scale, self.lang, self.causal = eps, 1 / math.sqrt(d_head), lang, causal
        probe = torch.empty(1, 1, d_model)
        for name, shape in _shapes(probe, heads, d_head, d_ff).items():
            if len(shape) == 1:
                value = torch.ones(shape, dtype=dtype)
            else:
                fan_in = math.prod(shape[:2]) if name == "Wo" else shape[0]
                value = torch.randn(shape, dtype=dtype) / math.sqrt(fan_in)
            setattr(self, name, nn.Parameter(value))

    def weights(self):
        return [getattr(self, name) for name in WEIGHTS]

    def forward(self, x: Tensor) -> Tensor:
        return block_op(x, self.weights(), self.eps, self.scale, self.causal, self.lang)[0]
