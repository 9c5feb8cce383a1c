"""The one Python interface of every loaded kernel, whatever its language.

    fn(*inputs, **scalars, out=None) -> output array, or a tuple of them

A KernelCallable checks a call against the kernel's Signature before any pointer reaches
native code: native code trusts shapes, dtype, layout and `restrict`, so a bad call must
fail here with a message that names the argument, never later with wrong numbers.
"""
import math
from numbers import Real

import numpy as np
import sympy

from moagen.moa.expr import INDEX_NAMESPACE


class KernelCallable:
    def __init__(self, signature, native_call, validate=None):
        """native_call(*input arrays, *output arrays, *scratch arrays, *sizes as int, *scalars
        as float) runs
        the kernel; validate(sizes, scalars), both dicts by name, may add a kernel-specific
        check that raises ValueError."""
        self.signature = signature
        self._native_call = native_call
        self._validate = validate
        self._dtype = np.dtype(signature.dtype)
        self._largest = float(np.finfo(self._dtype).max)  # a Python float: compares without a cast
        self._shape_of = {a.name: sympy.lambdify(signature.sizes, sympy.Tuple(*a.shape),
                                                 [INDEX_NAMESPACE, "math"])
                          for a in signature.arrays}
        # Each size is read off the first input dimension that is exactly that size; a size
        # that is no input dimension on its own (a KV cache's valid length) is an argument.
        self._size_from = {}
        for param in signature.inputs:
            for axis, dim in enumerate(param.shape):
                if dim in signature.sizes:
                    self._size_from.setdefault(dim, (param.name, axis))
        self._given = tuple(s.name for s in signature.sizes if s not in self._size_from)
        self._params = (tuple(a.name for a in signature.inputs) + tuple(signature.scalars)
                        + self._given)

    def __call__(self, *args, out=None, **kwargs):
        sig = self.signature
        values = self._bind(args, kwargs)
        inputs = [values[p.name] for p in sig.inputs]
        for k, (param, array) in enumerate(zip(sig.inputs, inputs)):
            self._check_array(f"argument {param.name!r}", param, array)
            if param.intent == "inout":
                self._check_writable(f"argument {param.name!r}", array, inputs[:k] + inputs[k + 1:])
        sizes = self._sizes(values)
        for param, array in zip(sig.inputs, inputs):
            self._check_shape(f"argument {param.name!r}", param, array, sizes)
        scalars = {name: self._scalar(name, values[name]) for name in sig.scalars}
        if self._validate is not None:
            self._validate(dict(sizes), dict(scalars))
        outputs = self._outputs(out, sizes, inputs)
        # the full-size temporaries of a variant that materializes them: allocated here, so
        # that running out of memory is a MemoryError, not a crash in native code
        scratch = [np.empty(self._expected(p, sizes), self._dtype) for p in sig.scratch]
        self._native_call(*inputs, *outputs, *scratch, *sizes.values(), *scalars.values())
        if not outputs:  # the kernel only updates its inout arguments
            return None
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def __repr__(self):
        outputs = ", ".join(p.name for p in self.signature.outputs)
        return f"<KernelCallable {self.signature.name}({', '.join(self._params)}) -> {outputs}>"

    def _bind(self, args, kwargs):
        """Match positional and keyword arguments to the inputs and scalars, like a def would."""
        name, params = self.signature.name, ", ".join(self._params)
        if len(args) > len(self._params):
            raise ValueError(f"{name}: takes {len(self._params)} arguments ({params}), got {len(args)} positional")
        values = dict(zip(self._params, args))
        for key, value in kwargs.items():
            if key not in self._params:
                raise ValueError(f"{name}: unexpected argument {key!r}; it takes ({params})")
            if key in values:
                raise ValueError(f"{name}: argument {key!r} given twice")
            values[key] = value
        missing = [p for p in self._params if p not in values]
        if missing:
            raise ValueError(f"{name}: missing argument(s) {', '.join(missing)}; it takes ({params})")
        return values

    def _check_array(self, what, param, array):
        """Type, rank, dtype, layout: what makes the raw pointer mean what the kernel thinks."""
        sig = self.signature
        where, shape = f"{sig.name}: {what}", _symbolic(param.shape)
        if not isinstance(array, np.ndarray):
            raise ValueError(f"{where}: expected a numpy array of shape {shape}, got {type(array).__name__}")
        if array.ndim != len(param.shape):
            raise ValueError(f"{where}: expected {len(param.shape)} dimensions {shape}, got shape {array.shape}")
        if array.dtype != self._dtype:
            raise ValueError(f"{where}: expected dtype {self._dtype}, got {array.dtype} (no implicit casting)")
        if sig.layout == "row" and not array.flags.c_contiguous:
            raise ValueError(f"{where}: expected a C-contiguous array (row layout), got strides "
                             f"{array.strides}; pass np.ascontiguousarray(...)")
        if sig.layout == "col" and not array.flags.f_contiguous:
            raise ValueError(f"{where}: expected an F-contiguous array (col layout), got strides "
                             f"{array.strides}; pass np.asfortranarray(...)")
        if not array.flags.aligned:
            raise ValueError(f"{where}: the array's data is not aligned to its dtype")

    def _sizes(self, values):
        """Each size by name, in signature order, read off the inputs or given."""
        sizes = {}
        for symbol in self.signature.sizes:
            if symbol.name in self._given:
                value, source = values[symbol.name], "as given"
                if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                    raise ValueError(f"{self.signature.name}: size {symbol} must be an integer, "
                                     f"got {type(value).__name__}")
            else:
                name, axis = self._size_from[symbol]
                value, source = values[name].shape[axis], f"axis {axis} of argument {name!r}"
            sizes[symbol.name] = int(value)
            # a given count may be 0 (an empty cache); an array dimension may not
            least = 0 if symbol.name in self._given else 1
            if sizes[symbol.name] < least:
                raise ValueError(f"{self.signature.name}: size {symbol} must be >= {least}, got "
                                 f"{sizes[symbol.name]} ({source})")
        return sizes

    def _expected(self, param, sizes):
        return tuple(int(d) for d in self._shape_of[param.name](*sizes.values()))

    def _check_shape(self, what, param, array, sizes):
        expected = self._expected(param, sizes)
        if array.shape != expected:
            inferred = ", ".join(f"{s}={sizes[s.name]}" + (f" from {self._size_from[s][0]!r}"
                                                             if s in self._size_from else "")
                                 for s in self.signature.sizes)
            raise ValueError(f"{self.signature.name}: {what}: expected shape {_symbolic(param.shape)} = "
                             f"{expected}, got {array.shape} (sizes: {inferred})")

    def _scalar(self, name, value):
        where = f"{self.signature.name}: scalar {name!r}"
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
            raise ValueError(f"{where}: expected a real number, got {type(value).__name__}")
        # Finite in the kernel's float type: a float32 kernel would see 1e300 as inf.
        if not (math.isfinite(value) and abs(value) <= self._largest):
            raise ValueError(f"{where}: expected a finite {self._dtype} number, got {value}")
        return float(value)

    def _outputs(self, out, sizes, inputs):
        """The caller's `out` arrays after checking them, or new ones."""
        params = self.signature.outputs
        if out is None:
            order = "C" if self.signature.layout == "row" else "F"
            return [np.empty(self._expected(p, sizes), self._dtype, order=order) for p in params]
        if len(params) == 1:
            out = (out,)
        elif not isinstance(out, (tuple, list)) or len(out) != len(params):
            names = ", ".join(p.name for p in params)
            raise ValueError(f"{self.signature.name}: out must be a tuple of {len(params)} arrays "
                             f"({names}), got {type(out).__name__}")
        for i, (param, array) in enumerate(zip(params, out)):
            what = f"out {param.name!r}"
            self._check_array(what, param, array)
            self._check_shape(what, param, array, sizes)
            self._check_writable(what, array, [*inputs, *out[:i]])
        return list(out)

    def _check_writable(self, what, array, others):
        if not array.flags.writeable:
            raise ValueError(f"{self.signature.name}: {what} is read-only")
        # The kernel's pointers are restrict: what it writes may alias nothing else.
        for other in others:
            if np.may_share_memory(array, other):
                raise ValueError(f"{self.signature.name}: {what} shares memory with another argument")


def flat_view(array):
    """A contiguous array as a 1-D view of the same memory, in memory order: what the loaders
    hand to native code. Never a copy, or outputs would be written to the copy."""
    flat = array.reshape(-1, order="A")
    if array.size and not np.may_share_memory(flat, array):  # an empty array has no memory
        raise RuntimeError(f"internal error: flattening an array of strides {array.strides} copied it")
    return flat


def _symbolic(shape):
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
