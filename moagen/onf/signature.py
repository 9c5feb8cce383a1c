"""The one kernel ABI: every generated kernel, in every language, is a plain function over
raw arrays plus integer sizes plus scalar parameters, in this order:

    arrays (inputs, outputs, then scratch), sizes (int64), scalars (the kernel's float type)

Arrays are of the kernel's float type, except an input declared of an integer element type
(int64 offsets into a packed batch: moagen.moa.expr.offsets).

An input may be updated in place (intent "inout": a KV cache receiving a row).

Kernels return nothing and never allocate: scratch arrays (the full-size temporaries of a
variant that materializes them) are allocated by the Python caller and passed in, so an
allocation failure is a Python MemoryError, never a crash inside native code.

A Signature is derived from the ONF by the generator; the printers print it, the loaders
check calls against it.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import sympy

from moagen.errors import UnknownNameError
from moagen.onf.loops import is_grid, walk

DTYPES = ("float64", "float32")
DTYPE_SUFFIX = {"float64": "f64", "float32": "f32"}
DTYPE_BYTES = {"float64": 8, "float32": 4}
LAYOUTS = ("row", "col")


def check_dtype(dtype):
    if dtype not in DTYPES:
        raise UnknownNameError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return dtype


@dataclass(frozen=True)
class ArrayParam:
    name: str
    shape: Tuple[sympy.Expr, ...]  # symbolic, in terms of the size symbols
    intent: str  # "in", "inout" (an input updated in place), "out" or "scratch"
    element: str = ""  # "" the signature's float dtype, or "int64" (an input's)
    # offsets: the extent of the axis they cut into sequences, checked by the loaders
    offsets_into: Optional[sympy.Expr] = None

    def dtype(self, float_dtype: str) -> str:
        """The array's numpy dtype in a kernel of float type float_dtype."""
        return self.element or float_dtype


@dataclass(frozen=True)
class Signature:
    name: str  # the exported symbol, e.g. "attention_fwd_dnf_f64"
    arrays: Tuple[ArrayParam, ...]
    sizes: Tuple[sympy.Symbol, ...]
    scalars: Tuple[str, ...]
    dtype: str  # one of DTYPES
    layout: str = "row"  # "row" (C order) or "col" (Fortran order), one of LAYOUTS
    # (size, its largest value): a size the kernel is compiled for up to a bound (a tiled
    # CUDA kernel's head dim: its register tiles' columns a compile-time count)
    limits: Tuple[Tuple[str, int], ...] = ()
    # (size, choose(sizes, sms)): a given size the binding chooses where the caller gives
    # none (moagen.steps.algebra.given)
    chosen: Tuple[Tuple[str, Callable], ...] = ()

    @property
    def inputs(self):
        """What the caller passes: read-only inputs and inputs updated in place."""
        return tuple(a for a in self.arrays if a.intent in ("in", "inout"))

    @property
    def outputs(self):
        return tuple(a for a in self.arrays if a.intent == "out")

    @property
    def scratch(self):
        return tuple(a for a in self.arrays if a.intent == "scratch")


def signature(onf, dtype: str) -> Signature:
    """The ABI of one ONF at one dtype: inputs, outputs, scratch; sizes; scalars."""
    arrays = ([ArrayParam(b.name, b.shape, "inout" if b.name in onf.inout else "in",
                          b.element, b.offsets_into) for b in onf.inputs]
              + [ArrayParam(b.name, b.shape, "out") for b in onf.outputs]
              + [ArrayParam(b.name, b.shape, "scratch") for b in onf.temps])
    limits = {}
    for nest in onf.nests:
        for lp in walk(nest.body):
            if is_grid(lp) and lp.gpu.bounds:
                for name, values in lp.gpu.bounds:
                    limits[name] = min(limits.get(name, max(values)), max(values))
    return Signature(f"{onf.name}_{onf.variant}_{DTYPE_SUFFIX[dtype]}", tuple(arrays),
                     onf.sizes, onf.scalars, dtype, onf.layout, tuple(limits.items()), onf.chosen)
