"""The one Python interface of every loaded kernel, whatever its language.

    fn(*inputs, **scalars, out=None) -> output array, or a tuple of them

A KernelCallable checks a call against the kernel's Signature before any pointer reaches
native code: native code trusts shapes, dtype, layout and `restrict`, so a bad call must
fail here with a message that names the argument, never later with wrong numbers.

A kernel that runs on a device (CUDA) also takes device arrays, any object with
`__cuda_array_interface__`, checked the same way (moagen.targets.cuda.arrays); all of one
call's arrays are then on the device, and the outputs it allocates too (of the inputs'
kind where arrays.KINDS knows it: pycuda GPUArrays, else DeviceArrays). Such a call may
name the stream it is queued on:

    fn(*device_arrays, **scalars, out=None, stream=handle)  # a cudaStream_t as an int
"""
import math
import threading
from numbers import Real

import numpy as np
import sympy

from moagen.moa.expr import INDEX_NAMESPACE
from moagen.steps.algebra.given import with_chosen
from moagen.targets.cuda.arrays import DeviceArray, DeviceView, array_kind, device_view

# Host kernels' scratch comes from their thread's arena, one block of memory every host
# kernel the thread calls shares (one runs at a time on a thread), grown to the largest
# call's scratch up to this size and kept: fresh memory is page-faulted and zeroed on first
# touch (docs/PERFORMANCE.md, "Host scratch: one arena a thread"). A call whose scratch is
# larger gets memory of its own, freed after it.
KEEP_HOST_SCRATCH = 1 << 30  # bytes
SCRATCH_ALIGNMENT = 64  # bytes: each array of the arena starts on a cache line
_ARENA = threading.local()  # .buffer: the thread's block; .views: its arrays by dtype and shapes


class KernelCallable:
    def __init__(self, signature, native_call, validate=None, device=None, address_call=None):
        """native_call(*input arrays, *output arrays, *scratch arrays, *sizes as int, *scalars
        as float) runs the kernel; validate(sizes, scalars), both dicts by name, may add a
        kernel-specific check that raises ValueError. device: where the kernel runs, for a
        kernel that runs on one (moagen.targets.cuda.loader): it checks device arrays' pointers and
        allocates their outputs, and every call's scratch; native_call then gets numpy
        arrays or DeviceViews, never both in one call. address_call: native_call's twin
        taking each array as its address (an int), for call_at; None where the binding
        needs arrays (f2py's)."""
        self.signature = signature
        self._native_call = native_call
        self._address_call = address_call
        self._validate = validate
        self.device = device
        # a device kernel's scratch, kept from call to call: allocating and freeing GPU
        # memory synchronizes the device, which a timed call would pay every time; per
        # stream (calls queued on two streams may run at once; on one, in order). A host
        # kernel's comes from its thread's arena (KEEP_HOST_SCRATCH)
        self._device_scratch = {}
        self._dtype = np.dtype(signature.dtype)
        # each array's dtype: the kernel's float, or an integer input's own
        self._dtypes = {a.name: np.dtype(a.dtype(signature.dtype)) for a in signature.arrays}
        # the offsets among the inputs: (index, param), their values checked on the host
        self._offsets = tuple((k, p) for k, p in enumerate(signature.inputs)
                              if p.offsets_into is not None)
        self._offsets_into = {p.name: sympy.lambdify(signature.sizes, p.offsets_into)
                              for _, p in self._offsets}
        self._largest = float(np.finfo(self._dtype).max)  # a Python float: compares without a cast
        self._shape_of = {a.name: sympy.lambdify(signature.sizes, sympy.Tuple(*a.shape),
                                                 [INDEX_NAMESPACE, "math"])
                          for a in signature.arrays}
        # Each size is read off the first input dimension that is exactly that size, as
        # (name, (input's index, axis)); a size that is no input dimension on its own (a KV
        # cache's valid length) is an argument, (name, None). Kept by name: _sizes walks
        # this on every call, and a sympy symbol's hash is Python code.
        # A size no dimension is exactly is read off one that is the size plus a number
        # (offsets' batch + 1), as (name, (input's index, axis, that number)).
        source = {}
        for index, param in enumerate(signature.inputs):
            for axis, dim in enumerate(param.shape):
                if dim in signature.sizes:
                    source.setdefault(dim, (index, axis, 0))
        for index, param in enumerate(signature.inputs):
            for axis, dim in enumerate(param.shape):
                size, shift = sympy.sympify(dim).as_coeff_Add()[::-1]
                if size in signature.sizes and shift.is_Integer:
                    source.setdefault(size, (index, axis, int(shift)))
        self._size_sources = tuple((s.name, source.get(s)) for s in signature.sizes)
        self._given = tuple(name for name, at in self._size_sources if at is None)
        # the given sizes chosen where the call gives none (a schedule's, GivenSize): by
        # choose(the other sizes, the SMs of the GPU the kernel runs on, None on a CPU)
        self._chosen = dict(signature.chosen)
        # The given sizes that no array's shape holds (a KV cache's valid length): a model
        # passes a new one every call, so they stay out of the remembered fits (_fit); none
        # where a size is chosen, whose choice reads the others
        in_shapes = {s.name for a in signature.arrays for d in a.shape
                     for s in sympy.sympify(d).free_symbols}
        self._free = frozenset(name for name in self._given
                               if name not in in_shapes and not self._chosen)
        self._shaping = tuple(k for k, name in enumerate(self._given) if name not in self._free)
        self._params = (tuple(a.name for a in signature.inputs) + tuple(signature.scalars)
                        + self._given)
        # What every call walks, computed once: a call's checks cost more than a small
        # kernel's work, and a model makes many small calls.
        self._inputs = signature.inputs
        # each input's element type: "" the kernel's float, "int64" (offsets)
        self.input_elements = tuple(p.element for p in self._inputs)
        self._outputs = signature.outputs
        self._scratch_params = signature.scratch
        self._argument = {a.name: f"argument {a.name!r}" for a in self._inputs}
        self._out_argument = {a.name: f"out {a.name!r}" for a in self._outputs}
        self._contiguous = "c_contiguous" if signature.layout == "row" else "f_contiguous"
        self._order = "C" if signature.layout == "row" else "F"
        # the indices of the inputs the kernel writes in place (its inout arguments)
        self.inout = tuple(k for k, p in enumerate(self._inputs) if p.intent == "inout")
        # each inout argument's index and the others its memory must not meet, each pair
        # once (two inout arguments: the first is tested against the second)
        self._written_against = tuple(
            (k, tuple(j for j in range(len(self._inputs))
                      if j != k and not (j in self.inout and j < k)))
            for k in self.inout)
        self._fits = {}  # (input shapes, given sizes shapes hold) -> (sizes, shapes, scratch shapes)
        # whether call_at runs this kernel: a host kernel of row layout bound by addresses
        # (C's cffi binding)
        self.takes_addresses = (address_call is not None and device is None
                                and signature.layout == "row")

    def __call__(self, *args, out=None, stream=None, **kwargs):
        if kwargs or len(args) != len(self._params):
            args = self._bind(args, kwargs)
        n_inputs, n_scalars = len(self._inputs), len(self.signature.scalars)
        argument = self._argument
        inputs = [self._array(argument[p.name], p, a) for p, a in zip(self._inputs, args[:n_inputs])]
        on_device = self.device is not None and self._same_side(
            [(argument[p.name], a) for p, a in zip(self._inputs, inputs)])
        for param, array in zip(self._inputs, inputs):
            self._check_array(argument[param.name], param, array)
        for k, others in self._written_against:
            self._check_writable(argument[self._inputs[k].name], inputs[k],
                                 [inputs[j] for j in others])
        sizes, shapes, scratch_shapes = self._fit(tuple(a.shape for a in inputs),
                                                  args[n_inputs + n_scalars:])
        if on_device:
            for param, array in zip(self._inputs, inputs):
                self._check_memory(argument[param.name], array)
        else:  # a device array's offsets stay unread: reading them would wait for the device
            for k, param in self._offsets:
                self._check_offsets(argument[param.name], param, inputs[k], sizes)
        scalars = self._scalars(args[n_inputs:n_inputs + n_scalars], sizes)
        outputs = self._outputs_for(out, sizes, shapes, inputs, on_device)
        # the full-size temporaries of a variant that materializes them: allocated here, so
        # that running out of memory is a MemoryError, not a crash in native code; where
        # the kernel runs, whatever side its arguments are on
        launch = self._launch_stream(stream, on_device)
        scratch = (self._scratch(scratch_shapes, on_device, launch.get("stream", 0))[0]
                   if scratch_shapes else ())
        self._native_call(*inputs, *outputs, *scratch, *sizes.values(), *scalars, **launch)
        if not outputs:  # the kernel only updates its inout arguments
            return None
        # the caller's own objects back (a torch tensor as given), not our views of them
        if on_device:
            outputs = [a.obj if isinstance(a, DeviceView) else a for a in outputs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def call_at(self, inputs, allocate, **named):
        """The kernel on memory its caller holds and has checked, for arrays numpy does not
        hold (moagen.torch's tensors): inputs as (address, shape) pairs in signature order,
        each address the start of a C-contiguous array of the kernel's dtype and of that
        shape, aligned to the dtype, and writable where the kernel writes it (an inout
        argument); allocate(shape) -> (array, address): new memory for an output; named: the
        scalars and given sizes by name. The shapes, sizes and scalars are checked here as a
        call's are, and that an argument written in place shares no memory with another;
        the scratch is the kernel's own (kept as a call's). Returns the outputs as allocate
        made them (a tuple when there are several; None when the kernel only updates its
        inout arguments)."""
        if not self.takes_addresses:
            raise ValueError(f"{self.signature.name}: this kernel is not called by address "
                             "(see takes_addresses): call it with arrays")
        n_inputs, n_scalars = len(self._inputs), len(self.signature.scalars)
        args = self._bind(tuple(inputs), named)
        sizes, shapes, scratch_shapes = self._fit(tuple(shape for _, shape in inputs),
                                                  args[n_inputs + n_scalars:])
        scalars = self._scalars(args[n_inputs:n_inputs + n_scalars], sizes)
        if self.inout:
            self._check_apart(inputs)
        outputs = [allocate(shapes[p.name]) for p in self._outputs]
        # the scratch arrays are held here until the kernel returns: scratch over
        # KEEP_HOST_SCRATCH is not kept, and its addresses alone would not hold it
        held, scratch = self._scratch(scratch_shapes, False) if scratch_shapes else ((), ())
        self._address_call(*(address for address, _ in inputs),
                           *(address for _, address in outputs), *scratch,
                           *sizes.values(), *scalars)
        del held
        if not outputs:
            return None
        return outputs[0][0] if len(outputs) == 1 else tuple(array for array, _ in outputs)

    def output_shapes(self, input_shapes, **given):
        """The shapes of the outputs a call on inputs of these shapes returns, the shapes
        checked as a call's; given: the sizes passed as arguments, by name (others are
        ignored), for a caller that allocates the outputs itself (out=)."""
        missing = [name for name in self._given if name not in given and name not in self._chosen]
        if missing:
            raise ValueError(f"{self.signature.name}: size {missing[0]} must be given")
        _, shapes, _ = self._fit(tuple(map(tuple, input_shapes)),
                                 tuple(given.get(name) for name in self._given))
        return tuple(shapes[p.name] for p in self._outputs)

    def __repr__(self):
        outputs = ", ".join(p.name for p in self.signature.outputs)
        return f"<KernelCallable {self.signature.name}({', '.join(self._params)}) -> {outputs}>"

    def _bind(self, args, kwargs):
        """The arguments in signature order (inputs, scalars, given sizes), from positional and
        keyword arguments matched like a def's."""
        params = self._params
        # the rest by keyword, in order: the usual call
        if len(args) <= len(params) and tuple(kwargs) == params[len(args):]:
            return (*args, *kwargs.values())
        values = dict(zip(params, args))
        for key, value in kwargs.items():
            if key not in params or key in values:
                break
            values[key] = value
        else:
            values.update({name: None for name in self._chosen if name not in values})
            if len(values) == len(params) and len(args) <= len(params):
                return tuple(values[p] for p in params)
        self._binding_error(args, kwargs)

    def _binding_error(self, args, kwargs):
        name, params = self.signature.name, ", ".join(self._params)
        if len(args) > len(self._params):
            raise ValueError(f"{name}: takes {len(self._params)} arguments ({params}), got {len(args)} positional")
        for key in kwargs:
            if key not in self._params:
                raise ValueError(f"{name}: unexpected argument {key!r}; it takes ({params})")
            if self._params.index(key) < len(args):
                raise ValueError(f"{name}: argument {key!r} given twice")
        missing = [p for p in self._params[len(args):] if p not in kwargs and p not in self._chosen]
        raise ValueError(f"{name}: missing argument(s) {', '.join(missing)}; it takes ({params})")

    def _array(self, what, param, array):
        """A numpy array as it is, a device array as its DeviceView, anything else refused."""
        if isinstance(array, np.ndarray):
            return array
        where = f"{self.signature.name}: {what}"
        view = device_view(array, where)
        if view is None:
            wanted = "a numpy array or a device array" if self.device else "a numpy array"
            raise ValueError(f"{where}: expected {wanted} of shape {_symbolic(param.shape)}, "
                             f"got {type(array).__name__}")
        if self.device is None:
            raise ValueError(f"{where}: got a device array ({type(array).__name__}), but this "
                             "kernel runs on the host: pass a numpy array")
        return view

    def _same_side(self, named):
        """Whether the call's arrays are on the device; all must be on one side."""
        if self.device is None:  # _array let no device array through
            return False
        sides = {isinstance(a, DeviceView) for _, a in named}
        if len(sides) > 1:
            host = next(w for w, a in named if not isinstance(a, DeviceView))
            gpu = next(w for w, a in named if isinstance(a, DeviceView))
            raise ValueError(f"{self.signature.name}: {gpu} is a device array but {host} is a "
                             "numpy array: pass every array on the device, or every one on the host")
        return sides == {True}

    def _empty(self, shape, on_device, kind=None, what=None):
        """A new array: numpy's on the host; on the device a DeviceArray, or for a kind of
        device array (arrays.KINDS) one its library allocates, as a DeviceView of it whose
        memory the device checks (`what`: the output it is, for the message)."""
        if kind is not None:
            view = device_view(kind.empty(shape, self._dtype, self._order), what)
            self._check_memory(f"{what} (allocated by {kind.name})", view)
            return view
        if on_device:
            return DeviceArray(self.device, shape, self._dtype, self._order)
        return np.empty(shape, self._dtype, order=self._order)

    def _launch_stream(self, stream, on_device):
        """native_call's keywords for `stream`: none for a host kernel, the stream (0, the
        legacy default stream, unless given) for a device kernel."""
        if self.device is None:
            if stream is not None:
                raise ValueError(f"{self.signature.name}: stream= is for a kernel that runs "
                                 "on a GPU; this one runs on the host")
            return {}
        if stream is None:
            return {"stream": 0}
        if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
            raise ValueError(f"{self.signature.name}: stream must be a CUDA stream handle (an "
                             f"int such as torch.cuda.Stream's .cuda_stream), got {stream!r}")
        if stream and not on_device:
            raise ValueError(f"{self.signature.name}: stream= orders work on device arrays; "
                             "numpy arrays are copied and run on the default stream")
        return {"stream": stream}

    def _scratch(self, shapes, on_device, stream=0):
        """The call's scratch arrays (shapes: theirs, a tuple) and, on the host, their
        addresses: a device's kept from the last call on the same stream while their shapes
        stay the same, the host's from the thread's arena (KEEP_HOST_SCRATCH)."""
        if not on_device:
            return _host_scratch(self._dtype, self._order, shapes)
        kept = self._device_scratch.setdefault(stream, {})
        last = kept.pop("scratch", None)
        if last is None or last[0] != shapes:
            last = None  # the old memory is freed before the new is allocated
            last = (shapes, [self._empty(shape, True) for shape in shapes])
        kept["scratch"] = last
        return last[1], None

    def _check_array(self, what, param, array):
        """Rank, dtype, layout: what makes the raw pointer mean what the kernel thinks."""
        flags = array.flags
        dtype = self._dtypes[param.name]
        if (array.ndim == len(param.shape) and array.dtype == dtype
                and getattr(flags, self._contiguous) and flags.aligned):
            return
        where = f"{self.signature.name}: {what}"
        if array.ndim != len(param.shape):
            raise ValueError(f"{where}: expected {len(param.shape)} dimensions "
                             f"{_symbolic(param.shape)}, got shape {array.shape}")
        if array.dtype != dtype:
            raise ValueError(f"{where}: expected dtype {dtype}, got {array.dtype} (no implicit casting)")
        if self.signature.layout == "row" and not flags.c_contiguous:
            raise ValueError(f"{where}: expected a C-contiguous array (row layout), got strides "
                             f"{array.strides}; pass np.ascontiguousarray(...)")
        if self.signature.layout == "col" and not flags.f_contiguous:
            raise ValueError(f"{where}: expected an F-contiguous array (col layout), got strides "
                             f"{array.strides}; pass np.asfortranarray(...)")
        raise ValueError(f"{where}: the array's data is not aligned to its dtype")

    def _fit(self, input_shapes, given):
        """The call's sizes by name, each array's shape by name and the scratch arrays' shapes
        (a tuple), after checking that the inputs' shapes fit the signature. A function of
        the inputs' shapes and the given sizes the shapes hold only, so remembered for the
        last few of them: a model calls a kernel again and again at the same shapes."""
        for name, value in zip(self._given, given):
            if value is None and name in self._chosen:
                continue
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{self.signature.name}: size {name} must be an integer, "
                                 f"got {type(value).__name__}")
        key = (input_shapes, tuple(given[k] for k in self._shaping) if self._free else given)
        fit = self._fits.get(key)
        if fit is None:
            sizes = self._sizes(input_shapes, given)
            for name, limit in self.signature.limits:
                if sizes[name] > limit:
                    raise ValueError(f"{self.signature.name}: compiled for {name} up to {limit}, "
                                     f"got {name}={sizes[name]} (another variant takes any)")
            shapes = self._shapes_at(sizes)
            for param, shape in zip(self._inputs, input_shapes):
                if shape != shapes[param.name]:
                    self._shape_error(self._argument[param.name], param, shape, sizes)
            if len(self._fits) >= 64:
                self._fits.clear()
            scratch = tuple(shapes[p.name] for p in self._scratch_params)
            fit = self._fits[key] = (sizes, shapes, scratch)
        elif self._free:  # this call's own values of the sizes no shape holds
            sizes = dict(fit[0])  # in signature order, as native code takes them
            for name, value in zip(self._given, given):
                if name in self._free:
                    sizes[name] = self._given_size(name, value)
            fit = (sizes, *fit[1:])
        return fit

    def _sizes(self, input_shapes, given):
        """Each size by name, in signature order, read off the inputs' shapes or given
        (integers)."""
        given = dict(zip(self._given, given))
        sizes = {}
        for name, source in self._size_sources:
            if source is None:
                # a chosen size after the others (its choice reads them); its place kept
                sizes[name] = None if name in self._chosen else self._given_size(name, given[name])
                continue
            value = input_shapes[source[0]][source[1]] - source[2]
            if value < 1:
                raise ValueError(f"{self.signature.name}: size {name} must be >= 1, got {value} "
                                 f"(axis {source[1]} of argument {self._inputs[source[0]].name!r}"
                                 f"{f' less {source[2]}' if source[2] else ''})")
            sizes[name] = value
        if self._chosen:  # as given, at least 1, or chosen for the device it runs on
            known = {k: v for k, v in sizes.items() if v is not None}
            known.update((k, int(given[k])) for k in self._chosen if given[k] is not None)
            try:
                sizes.update(with_chosen(self.signature.chosen, known,
                                         getattr(self.device, "multiprocessors", None)))
            except ValueError as error:
                raise ValueError(f"{self.signature.name}: {error}") from None
        return sizes

    def _given_size(self, name, value):
        """A size passed as an argument: a count, which may be 0 (an empty cache)."""
        value = int(value)
        if value < 0:
            raise ValueError(f"{self.signature.name}: size {name} must be >= 0, got {value} "
                             "(as given)")
        return value

    def _shapes_at(self, sizes):
        """Each array's shape by name at these sizes (a dict by name)."""
        return {name: tuple(int(d) for d in shape_of(*sizes.values()))
                for name, shape_of in self._shape_of.items()}

    def _shape_error(self, what, param, shape, sizes):
        expected = self._shapes_at(sizes)[param.name]
        inferred = ", ".join(f"{name}={sizes[name]}" + ("" if at is None else
                                                        f" from {self._inputs[at[0]].name!r}")
                             for name, at in self._size_sources)
        raise ValueError(f"{self.signature.name}: {what}: expected shape {_symbolic(param.shape)} = "
                         f"{expected}, got {shape} (sizes: {inferred})")

    def _scalars(self, values, sizes):
        """The scalars checked (as floats), in signature order, and then validate's check."""
        scalars = [self._scalar(name, value) for name, value in zip(self.signature.scalars, values)]
        if self._validate is not None:
            self._validate(dict(sizes), dict(zip(self.signature.scalars, scalars)))
        return scalars

    def _scalar(self, name, value):
        if type(value) is float and math.isfinite(value) and abs(value) <= self._largest:
            return value  # the common case, checked without the general tests below
        where = f"{self.signature.name}: scalar {name!r}"
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
            raise ValueError(f"{where}: expected a real number, got {type(value).__name__}")
        # Finite in the kernel's float type: a float32 kernel would see 1e300 as inf.
        if not (math.isfinite(value) and abs(value) <= self._largest):
            raise ValueError(f"{where}: expected a finite {self._dtype} number, got {value}")
        return float(value)

    def _outputs_for(self, out, sizes, shapes, inputs, on_device):
        """The caller's `out` arrays after checking them (as DeviceViews where they are
        device arrays), or new ones on the inputs' side, of the inputs' kind where they are
        all of one (arrays.array_kind: pycuda GPUArrays in, GPUArrays out)."""
        params = self._outputs
        if out is None:
            kind = array_kind(inputs) if on_device else None
            return [self._empty(shapes[p.name], on_device, kind, self._out_argument[p.name])
                    for p in params]
        if len(params) == 1:
            out = (out,)
        elif not isinstance(out, (tuple, list)) or len(out) != len(params):
            names = ", ".join(p.name for p in params)
            raise ValueError(f"{self.signature.name}: out must be a tuple of {len(params)} arrays "
                             f"({names}), got {type(out).__name__}")
        named = self._out_argument
        out = [self._array(named[p.name], p, a) for p, a in zip(params, out)]
        if self.device is not None:
            self._same_side([(named[p.name], a) for p, a in zip(params, out)]
                            + [(self._argument[p.name], a) for p, a in zip(self._inputs, inputs)])
        for i, (param, array) in enumerate(zip(params, out)):
            what = named[param.name]
            self._check_array(what, param, array)
            if array.shape != shapes[param.name]:
                self._shape_error(what, param, array.shape, sizes)
            self._check_memory(what, array)
            self._check_writable(what, array, [*inputs, *out[:i]])
        return list(out)

    def _check_apart(self, inputs):
        """call_at's twin of _check_writable's aliasing test, on (address, shape) pairs of
        checked shapes: an inout argument's bytes overlap no other argument's."""
        spans = [(address, address + math.prod(shape) * self._dtypes[p.name].itemsize)
                 for (address, shape), p in zip(inputs, self._inputs)]
        for k, others in self._written_against:
            start, stop = spans[k]
            if any(start < spans[j][1] and spans[j][0] < stop for j in others):
                raise ValueError(f"{self.signature.name}: {self._argument[self._inputs[k].name]} "
                                 "shares memory with another argument")

    def _check_offsets(self, what, param, offsets, sizes):
        """Offsets cutting an axis into sequences: from 0, never decreasing, to the axis's
        extent; else the kernel's loops would read and write past its arrays."""
        into = int(self._offsets_into[param.name](*sizes.values()))
        where = f"{self.signature.name}: {what}"
        if offsets[0] != 0:
            raise ValueError(f"{where}: offsets must start at 0, got {offsets[0]}")
        steps = np.diff(offsets)
        if (steps < 0).any():
            s = int(np.argmax(steps < 0))
            raise ValueError(f"{where}: offsets must not decrease, got {offsets[s]} then "
                             f"{offsets[s + 1]} at entries {s} and {s + 1}")
        if offsets[-1] != into:
            raise ValueError(f"{where}: offsets must end at {param.offsets_into} = {into}, the "
                             f"rows they cut, got {offsets[-1]}")

    def _check_memory(self, what, array):
        """A device array's bytes, as its checked shape and dtype count them, must be the
        device's memory: the device says (a host pointer would fault in the kernel)."""
        if isinstance(array, DeviceView):
            self.device.check(array, f"{self.signature.name}: {what}")

    def _check_writable(self, what, array, others):
        if not array.flags.writeable:
            raise ValueError(f"{self.signature.name}: {what} is read-only")
        # The kernel's pointers are restrict: what it writes may alias nothing else.
        for other in others:
            if (array.overlaps(other) if isinstance(array, DeviceView)
                    else np.may_share_memory(array, other)):
                raise ValueError(f"{self.signature.name}: {what} shares memory with another argument")


def _host_scratch(dtype, order, shapes):
    """Arrays of these shapes carved from the calling thread's arena, grown (its old memory
    freed first) where it is too small, and their addresses; the same arrays again for the
    same dtype and shapes while the arena stays. Scratch over KEEP_HOST_SCRATCH is carved
    from memory of its own, which the arrays hold."""
    key = (dtype, order, shapes)
    views = _ARENA.__dict__.setdefault("views", {})
    carved = views.get(key)
    if carved is not None:
        return carved
    spans = [-(-math.prod(shape) * dtype.itemsize // SCRATCH_ALIGNMENT) * SCRATCH_ALIGNMENT
             for shape in shapes]
    size = sum(spans) + SCRATCH_ALIGNMENT  # room to align the first array
    buffer = getattr(_ARENA, "buffer", None)
    if buffer is None or buffer.nbytes < size:
        if size > KEEP_HOST_SCRATCH:
            return _carve(_new_buffer(size), dtype, order, shapes, spans)
        views.clear()
        _ARENA.buffer = buffer = None  # the old memory is freed before the new is allocated
        _ARENA.buffer = buffer = _new_buffer(size)
    if len(views) >= 64:
        views.clear()
    carved = views[key] = _carve(buffer, dtype, order, shapes, spans)
    return carved


def _new_buffer(nbytes):
    return np.empty(nbytes, np.uint8)


def _carve(buffer, dtype, order, shapes, spans):
    """The arrays laid one after another in buffer, each at an aligned address."""
    start = buffer.ctypes.data
    offset = -start % SCRATCH_ALIGNMENT
    arrays, addresses = [], []
    for shape, span in zip(shapes, spans):
        nbytes = math.prod(shape) * dtype.itemsize
        arrays.append(buffer[offset:offset + nbytes].view(dtype).reshape(shape, order=order))
        addresses.append(start + offset)
        offset += span
    return arrays, addresses


def flat_view(array):
    """A contiguous array as a 1-D view of the same memory, in memory order: what the loaders
    hand to native code. Never a copy, or outputs would be written to the copy."""
    flat = array.reshape(-1, order="A")
    if array.size and not np.may_share_memory(flat, array):  # an empty array has no memory
        raise RuntimeError(f"internal error: flattening an array of strides {array.strides} copied it")
    return flat


def _symbolic(shape):
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
