"""RMSNorm and the gated (SwiGLU) MLP as PyTorch operators over every row of x (any leading
dimensions; the kernels see them as one batch of rows).

    rms_norm    forward rmsnorm_fwd (z and the per-row 1/rms, kept for the backward),
                backward rmsnorm_bwd (dx, and dweight summed in fixed parts, 16 on a CPU
                and 528 thread blocks on a GPU: the same bits on any thread count)
    swiglu_mlp  forward mlp_fwd (F, and U = x w_gate and V = x w_up, kept), backward
                mlp_bwd (H recomputed from U and V); both register tiled ("tiled") on a
                CPU, on a GPU the kernels' default there (`moagen list`: tensor cores)

The weights are in the kernels' (and x @ W's) orientation: w_gate, w_up (d_model, d_ff),
w_down (d_ff, d_model); an nn.Linear stores the transpose (its .weight.T)."""
from typing import Optional

from torch import Tensor

from moagen.torch_ops.native import call, check_dims, check_lang, check_size, check_tensors
from moagen.torch_ops.operator import Operator


def _mlp_variant(x: Tensor) -> Optional[str]:
    """The CPU's register-tiled kernels; on a GPU None: the variant the kernels' module makes
    CUDA's default (Kernel.default_variant)."""
    return None if x.is_cuda else "tiled"


def _rows(x):
    """x (..., d) seen as the kernels' (batch = 1, rows, d)."""
    return x, (1, x.numel() // x.shape[-1], x.shape[-1])


def _check_rows(op, x):
    """x (..., d) with d at least 1; no rows gives no rows (moagen.torch_ops.operator)."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a last dimension d of at least 1 (..., d), got "
                         f"shape {tuple(x.shape)}")


def _check_norm(op, x, weight, eps, lang):
    check_lang(op, lang)
    check_tensors(op, x=x, weight=weight)
    _check_rows(op, x)
    check_dims(op, "weight", weight, 1, "(d,)")
    check_size(op, "weight's length (x's last dimension)", weight.shape[0], x.shape[-1])
    if not eps > 0:
        raise ValueError(f"{op}: eps must be positive, got {eps}")


def _rms_norm(x: Tensor, weight: Tensor, eps: float, lang: str) -> tuple[Tensor, Tensor]:
    """z and the per-row 1/rms."""
    return call("rmsnorm_fwd", "dnf", lang, _rows(x), weight, eps=eps,
                out_shapes=(x.shape, x.shape[:-1]))


def _rms_norm_fake(x, weight, eps, lang):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1])


def _rms_norm_backward(x: Tensor, weight: Tensor, inv_rms: Tensor, grad_z: Tensor,
                       lang: str) -> tuple[Tensor, Tensor]:
    return call("rmsnorm_bwd", "dnf", lang, _rows(x), weight,
                (inv_rms, (1, inv_rms.numel())), _rows(grad_z), out_shapes=(x.shape,))


rms_norm_backward_op = Operator(
    "moagen::rms_norm_backward", _rms_norm_backward,
    lambda x, weight, inv_rms, grad_z, lang: (x.new_empty(x.shape), weight.new_empty(weight.shape)))


def _setup_norm(ctx, inputs, output):
    x, weight, _eps, ctx.lang = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    # a gradient not given stays None (the non-differentiable outputs': never read), not zeros
    ctx.set_materialize_grads(False)


def _backward_norm(ctx, grad_z, _grad_inv_rms):
    if grad_z is None:
        return None, None, None, None
    x, weight, inv_rms = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(x, weight, inv_rms, grad_z, ctx.lang)
    return dx, dweight, None, None


rms_norm_op = Operator("moagen::rms_norm", _rms_norm, _rms_norm_fake,
                       check=lambda *args: _check_norm("moagen::rms_norm", *args),
                       backward=_backward_norm, setup_context=_setup_norm,
                       instead="F.rms_norm")


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5, *, lang: str = "c") -> Tensor:
    """weight * x / sqrt(mean(x^2 over the last axis) + eps), as
    F.rms_norm(x, (d,), weight, eps); differentiable in x and weight (once: differentiating
    the gradients raises, moagen.torch_ops.operator)."""
    _check_norm("moagen.torch.rms_norm", x, weight, eps, lang)
    return rms_norm_op(x, weight, float(eps), lang)[0]


def _check_mlp(op, x, w_gate, w_up, w_down, lang):
    check_lang(op, lang)
    check_tensors(op, x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    _check_rows(op, x)
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        check_dims(op, name, t, 2, "(d_model, d_ff)" if name != "w_down" else "(d_ff, d_model)")
    d_model, d_ff = x.shape[-1], w_gate.shape[1]
    check_size(op, "w_gate's shape (d_model = x's last dimension, d_ff)", tuple(w_gate.shape),
               (d_model, d_ff))
    check_size(op, "w_up's shape (as w_gate's)", tuple(w_up.shape), (d_model, d_ff))
    check_size(op, "w_down's shape (d_ff, d_model)", tuple(w_down.shape), (d_ff, d_model))
    if d_ff == 0:
        raise ValueError(f"{op}: d_ff must be at least 1")


def _swiglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                lang: str) -> tuple[Tensor, Tensor, Tensor]:
    """F, U = x w_gate and V = x w_up."""
    hidden = (*x.shape[:-1], w_gate.shape[1])
    return call("mlp_fwd", _mlp_variant(x), lang, _rows(x), w_gate, w_up, w_down,
                out_shapes=(x.shape, hidden, hidden))


def _swiglu_mlp_fake(x, w_gate, w_up, w_down, lang):
    hidden = (*x.shape[:-1], w_gate.shape[1])
    return x.new_empty(x.shape), x.new_empty(hidden), x.new_empty(hidden)


def _swiglu_mlp_backward(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, u: Tensor,
                         v: Tensor, grad_f: Tensor,
                         lang: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return call("mlp_bwd", _mlp_variant(x), lang, _rows(x), w_gate, w_up, w_down, _rows(u), _rows(v),
                _rows(grad_f), out_shapes=(x.shape,))


swiglu_mlp_backward_op = Operator(
    "moagen::swiglu_mlp_backward", _swiglu_mlp_backward,
    lambda x, w_gate, w_up, w_down, u, v, grad_f, lang: tuple(
        t.new_empty(t.shape) for t in (x, w_gate, w_up, w_down)))


def _setup_mlp(ctx, inputs, output):
    *tensors, ctx.lang = inputs
    ctx.save_for_backward(*tensors, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    # a gradient not given stays None (the non-differentiable outputs': never read), not zeros
    ctx.set_materialize_grads(False)


def _backward_mlp(ctx, grad_f, _grad_u, _grad_v):
    if grad_f is None:
        return None, None, None, None, None
    return swiglu_mlp_backward_op(*ctx.saved_tensors, grad_f, ctx.lang) + (None,)


swiglu_mlp_op = Operator("moagen::swiglu_mlp", _swiglu_mlp, _swiglu_mlp_fake,
                         check=lambda *args: _check_mlp("moagen::swiglu_mlp", *args),
                         backward=_backward_mlp, setup_context=_setup_mlp,
                         instead="(F.silu(x @ w_gate) * (x @ w_up)) @ w_down")


def swiglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *,
               lang: str = "c") -> Tensor:
    """(silu(x w_gate) * (x w_up)) w_down over the last axis of x; differentiable in x and
    the weights (once: differentiating the gradients raises, moagen.torch_ops.operator)."""
    _check_mlp("moagen.torch.swiglu_mlp", x, w_gate, w_up, w_down, lang)
    return swiglu_mlp_op(x, w_gate, w_up, w_down, lang)[0]
