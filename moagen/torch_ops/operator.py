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
"""
import functools
import inspect

import torch
from torch import nn

PLAIN = (torch.Tensor, nn.Parameter)


class Operator:
    def __init__(self, name, impl, fake, *, check=None, mutates_args=(), backward=None,
                 setup_context=None):
        """name: "moagen::..."; impl(*args) the operator (annotated: the schema is read off
        it); fake(*args) empty outputs of its shapes; check(*args): see above;
        backward(ctx, *grads) and setup_context(ctx, inputs, output) as
        torch.library.register_autograd takes them, or neither for an operator without a
        gradient. mutates_args: impl's parameters it writes in place (an operator without a
        gradient)."""
        if mutates_args and backward is not None:
            raise ValueError(f"{name}: an operator that writes its arguments has no gradient "
                             "here (its eager path would not mark them dirty)")
        self.custom_op = torch.library.custom_op(name, _checked(check, impl),
                                                 mutates_args=mutates_args)
        self.custom_op.register_fake(_checked(check, fake))
        self._impl = impl
        # the eager path bumps their version counters, as the custom op does, so that
        # autograd refuses a gradient through a value the call overwrote
        parameters = list(inspect.signature(impl).parameters)
        self._mutated = tuple(parameters.index(arg) for arg in mutates_args)
        self._function = None
        if backward is not None:
            self.custom_op.register_autograd(backward, setup_context=setup_context)
            self._function = _function(name, impl, setup_context, backward)

    def __call__(self, *args):
        if torch.compiler.is_compiling() or not _plain(args):
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


def _plain(args):
    """Whether every argument is a plain CPU or CUDA tensor or parameter, or not a tensor at
    all."""
    for a in args:
        if isinstance(a, (list, tuple)) or (isinstance(a, torch.Tensor) and (
                type(a) not in PLAIN or not (a.is_cpu or a.is_cuda))):
            return False
    return True


def _function(name, impl, setup_context, backward):
    """The torch.autograd.Function of impl with this autograd formula. Its forward takes
    the context and sets it up itself: given a setup_context of its own, Function.apply
    would bind every call's arguments to forward's signature through inspect, at every call."""
    def forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        return output

    return type(name.replace("::", "_"), (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})
