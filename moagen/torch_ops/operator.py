"""An operator of moagen.torch, defined once and called two ways.

    rms_norm_op = Operator("moagen::rms_norm", impl, fake, check=check,
                           backward=backward, setup_context=setup_context)
    z, inv_rms = rms_norm_op(x, weight, eps, lang)

It is a torch.library custom op (its schema from impl's annotations, `fake` its shapes for
tracing, the autograd formula registered on it), and that op is what runs wherever PyTorch
traces: under torch.compile, and on any tensor that is not a plain CPU or CUDA tensor or
parameter (fake, functional and meta tensors, subclasses), or a list of tensors (the block's weights,
which an autograd.Function would not differentiate). A call in eager mode on plain tensors
runs the same impl, setup_context and backward through a torch.autograd.Function instead:
the custom op's Python layers (dispatch, argument defaults, its own autograd wrapper) cost
as much as a small kernel's work, and a model makes many small calls (docs/PERFORMANCE.md,
"moagen.torch's calls").

`check(*args)`, where given, raises for arguments the operator refuses. The custom op runs
it before impl and fake; the eager path does not, its caller (the public function, which
names itself in the messages) has checked the same arguments already.

What no path answers silently wrong (tests/test_torch_no_silent.py):
- an empty tensor argument (a batch, heads or rows of 0): the kernels take sizes of at
  least 1, so the outputs are fake's shapes filled with zeros, the kernels' sums over no rows
  (a weight's gradient over an empty batch is zero);
- torch.func.vmap: a tensor a functorch transform wraps takes the custom op, which vmap
  runs once per mapped slice (PyTorch's fallback for an operator without a batching rule);
  the eager path's autograd.Function would refuse it with a message about setup_context;
- torch.func's differentiating transforms (grad, vjp, jacrev, jvp, ...): neither path has
  a rule for them (a custom op's autograd refuses them with that message too), so an
  operator with a gradient refuses them, naming `instead`;
- forward-mode AD (torch.autograd.forward_ad's dual tensors): there is no rule for it
  either, and an operator with a gradient refuses a dual tensor naming `instead` (the
  autograd.Function by its jvp, the custom op before it is called);
- a double backward: the backward kernels compute the gradients with no graph of their own,
  so under create_graph=True they come back through an identity whose own backward raises,
  naming the operator and `instead`, PyTorch's way to differentiate twice (as PyTorch's
  once_differentiable functions do: the error only where the graph is used).
"""
import functools
import inspect

import torch
from torch import nn

PLAIN = (torch.Tensor, nn.Parameter)


class Operator:
    def __init__(self, name, impl, fake, *, check=None, mutates_args=(), backward=None,
                 setup_context=None, instead=None):
        """name: "moagen::..."; impl(*args) the operator (annotated: the schema is read off
        it); fake(*args) empty outputs of its shapes; check(*args): see above;
        backward(ctx, *grads) and setup_context(ctx, inputs, output) as
        torch.library.register_autograd takes them, or neither for an operator without a
        gradient; instead: with a backward, what to use for a double backward (see above).
        mutates_args: impl's parameters it writes in place (an operator without a
        gradient)."""
        if mutates_args and backward is not None:
            raise ValueError(f"{name}: an operator that writes its arguments has no gradient "
                             "here (its eager path would not mark them dirty)")
        impl = _empty_as_zeros(impl, fake)
        self.custom_op = torch.library.custom_op(name, _checked(check, impl),
                                                 mutates_args=mutates_args)
        self.custom_op.register_fake(_checked(check, fake))
        self._impl = impl
        # the eager path bumps their version counters, as the custom op does, so that
        # autograd refuses a gradient through a value the call overwrote
        parameters = list(inspect.signature(impl).parameters)
        self._mutated = tuple(parameters.index(arg) for arg in mutates_args)
        self._function, self._no_torch_func, self._no_forward_mode = None, None, None
        if backward is not None:
            self._no_forward_mode = (
                f"{name} has no forward-mode derivative (a dual tensor of "
                "torch.autograd.forward_ad); take its gradients by torch.autograd.grad, or "
                f"use {instead} for forward mode")
            self._no_torch_func = (
                f"{name} does not support torch.func's differentiating transforms (grad, vjp, "
                "jacrev, jacfwd, jvp, hessian); take its gradients by torch.autograd.grad, or "
                f"use {instead} under torch.func")
            backward = _first_order(name, instead, backward)
            self.custom_op.register_autograd(backward, setup_context=setup_context)
            self._function = _function(name, impl, setup_context, backward,
                                       self._no_forward_mode)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.custom_op(*args)
        if not _plain(args):
            if self._no_torch_func and _torch_func_differentiates():
                raise NotImplementedError(self._no_torch_func)
            if self._no_forward_mode and _dual(args):
                raise NotImplementedError(self._no_forward_mode)
            return self.custom_op(*args)
        if self._function is None:
            result = self._impl(*args)
            if self._mutated:
                torch.autograd.graph.increment_version([args[i] for i in self._mutated])
            return result
        return self._function.apply(*args)


def _checked(check, fn):
    """fn after check (fn's signature and annotations kept: the schema is read off them)."""
    if check is None:
        return fn

    @functools.wraps(fn)
    def checked(*args):
        check(*args)
        return fn(*args)

    return checked


def _empty_as_zeros(impl, fake):
    """impl, except that where a tensor argument (not one in a list: the weights) is empty its
    outputs are fake's filled with zeros (see above)."""
    @functools.wraps(impl)
    def nonempty(*args):
        if not any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args):
            return impl(*args)
        outputs = fake(*args)
        if outputs is None:  # an operator that writes its arguments
            return None
        if isinstance(outputs, torch.Tensor):
            return outputs.zero_()
        return type(outputs)(t.zero_() for t in outputs)

    return nonempty


def _first_order(name, instead, backward):
    """backward, whose gradients under create_graph=True depend on its inputs through
    _NoDoubleBackward (see above)."""
    message = (f"{name} has no double backward: its backward kernels compute the gradients "
               "without a graph, so differentiating them (create_graph=True) would be wrong; "
               f"use {instead} where second derivatives are needed")

    @functools.wraps(backward)
    def first_order(ctx, *grads):
        result = backward(ctx, *grads)
        if not torch.is_grad_enabled():  # create_graph=False
            return result
        # the gradients, a list's (the block's weights') among them
        computed = [t for r in result for t in (r if isinstance(r, list) else [r])
                    if t is not None]
        marked = iter(_NoDoubleBackward.apply(message, len(computed), *computed,
                                              *ctx.saved_tensors,
                                              *(g for g in grads if g is not None)))
        return tuple([next(marked) for _ in r] if isinstance(r, list) else
                     None if r is None else next(marked) for r in result)

    return first_order


class _NoDoubleBackward(torch.autograd.Function):
    """The identity on the first `count` tensors, which requires grad where the others (what
    they were computed from) do; its backward raises `message`."""

    @staticmethod
    def forward(ctx, message, count, *tensors):
        ctx.message = message
        return tensors[:count]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def _torch_func_differentiates():
    """Whether a torch.func transform that differentiates is active (PyTorch has no public
    test for one)."""
    transform = torch._C._functorch.TransformType
    return any(interpreter.key() in (transform.Grad, transform.Jvp)
               for interpreter in torch._C._functorch.get_interpreter_stack() or ())


def _dual(args):
    """Whether a tensor argument, one in a list included, carries a forward-mode tangent."""
    tensors = (t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]))
    return any(isinstance(t, torch.Tensor) and
               torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _plain(args):
    """Whether every argument is a plain CPU or CUDA tensor or parameter, not wrapped by a
    functorch transform (vmap), or not a tensor at all."""
    for a in args:
        if isinstance(a, (list, tuple)) or (isinstance(a, torch.Tensor) and (
                type(a) not in PLAIN or not (a.is_cpu or a.is_cuda)
                # PyTorch has no public test for a tensor a transform wraps
                or torch._C._functorch.is_functorch_wrapped_tensor(a))):
            return False
    return True


def _function(name, impl, setup_context, backward, no_forward_mode):
    """The torch.autograd.Function of impl with this autograd formula. Its forward takes
    the context and sets it up itself: given a setup_context of its own, Function.apply
    would bind every call's arguments to forward's signature through inspect, at every call.
    Its jvp refuses forward-mode AD by name (PyTorch's own message asks the Function's
    author for a jvp)."""
    def forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        return output

    def jvp(ctx, *tangents):
        raise NotImplementedError(no_forward_mode)

    return type(name.replace("::", "_"), (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward),
                 "jvp": staticmethod(jvp)})
