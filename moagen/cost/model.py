"""F, M, scratch and atomics of one kernel variant, derived from the ONF it emits, as sympy
expressions in the kernel's sizes, and as numbers for given sizes."""
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Dict, Tuple

import numpy as np
import sympy

from moagen.pipeline import onf_of, param_pairs
from moagen.cost.flops import FLOP, count_ops
from moagen.cost.traffic import Moved, at_least, minimum_traffic, nest_traffic, working_set
from moagen.cost.view import counting_view
from moagen.errors import MoagenError
from moagen.kernels import get_kernel
from moagen.moa.expr import elements_read
from moagen.onf.count import atomic_updates
from moagen.onf.loops import Loop, walk
from moagen.onf.signature import check_dtype
from moagen.steps.algebra.given import with_chosen

CACHE_ASSUMPTION = ("each nest is one pass over main memory, and what a nest reuses stays in "
                    "cache while it runs (the cache holds the working set)")


class SizeError(MoagenError):
    """A -D size that is unknown, missing, malformed, or that the kernel rejects."""


class NotModelled(MoagenError):
    """A kernel whose counts are no function of its sizes: its loops are bounded by an
    integer input's values (a packed batch's offsets)."""


@dataclass(frozen=True)
class Cost:
    kernel: str
    variant: str
    dtype: str
    sizes: Tuple[sympy.Symbol, ...]
    ops: Dict[str, sympy.Expr]  # FLOP and the operations counted apart (div, exp, ...)
    traffic: Dict[str, Moved]  # elements per array, each nest a pass over memory
    minimum: Dict[str, Moved]  # elements per array, the call as one pass (infinite cache)
    scratch: Dict[str, sympy.Expr]  # elements per temporary the caller allocates
    atomics: Dict[str, sympy.Expr]  # atomic updates per array
    working_set: sympy.Expr  # elements the cache must hold for the in-nest reuse
    assumptions: Tuple[str, ...]  # what the symbolic counts assume of the sizes
    # (size, choose(sizes, sms)): the sizes a binding chooses where a call gives none
    chosen: Tuple[Tuple[str, Callable], ...] = ()
    # the bytes an element of an input of its own element type (a bool mask's 1), by name
    own_itemsize: Dict[str, int] = field(default_factory=dict)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def flops(self) -> sympy.Expr:
        return self.ops.get(FLOP, sympy.Integer(0))

    @property
    def special(self) -> Dict[str, sympy.Expr]:
        return {op: n for op, n in self.ops.items() if op != FLOP}

    @property
    def M(self) -> sympy.Expr:
        """Bytes moved between main memory and the cache, under CACHE_ASSUMPTION."""
        return _bytes(self.traffic, self.itemsize, self.own_itemsize)

    @property
    def M_min(self) -> sympy.Expr:
        """Bytes moved with an infinite cache: the series' M."""
        return _bytes(self.minimum, self.itemsize, self.own_itemsize)

    @property
    def scratch_bytes(self) -> sympy.Expr:
        return sympy.factor(self.itemsize * sum(self.scratch.values(), sympy.Integer(0)))

    def sizes_from(self, given: Dict[str, int], sms=None) -> Dict[sympy.Symbol, int]:
        """The kernel's sizes by symbol, from values by name; every size must be there but
        a chosen one, which where missing is chosen as a call on `sms` SMs (None: this
        machine's CPU) would choose it."""
        names = {s.name: s for s in self.sizes}
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise SizeError(f"{self.kernel} has no size {', '.join(unknown)}; its sizes: "
                            f"{', '.join(names)}")
        chosen = dict(self.chosen)
        missing = [name for name in names if name not in given and name not in chosen]
        if missing:
            raise SizeError(f"{self.kernel} needs every size for numbers; missing: "
                            f"{', '.join(f'-D {m}=...' for m in missing)}")
        validate = get_kernel(self.kernel).validate
        try:
            if validate:
                validate(dict(given), {})
            given = with_chosen(self.chosen, given, sms)
        except ValueError as error:
            raise SizeError(str(error)) from error
        return {s: given[s.name] for s in self.sizes}


def _bytes(per_array, itemsize, own_itemsize):
    return sympy.factor(sum(((m.read + m.written) * own_itemsize.get(name, itemsize)
                             for name, m in per_array.items()), sympy.Integer(0)))


def value(expr, env: Dict[sympy.Symbol, int]):
    """expr at the given sizes: an int when whole. SizeError where it is no number there (a
    count the model left in terms of a loop variable: a causal tile's key blocks)."""
    number = _summed(sympy.sympify(expr).xreplace({k: sympy.Integer(v) for k, v in env.items()}))
    number = number.doit()
    if not (number.is_number and number.is_real):
        raise SizeError(f"the cost model has no number for {expr} at {env}")
    return int(number) if number.is_Integer else float(number)


def _summed(e):
    """e with each sum of a Min or Max over numbers taken term by term: sympy's closed form
    of a sum of Min(n, 64 j_blk + 64) recursed past its limit, for minutes
    (attention_cross_fwd_padded's key blocks, bounded by Min(n / 64, last / 64 + 1)); the
    bounds rounded inwards, as the model's counts assume whole blocks."""
    if isinstance(e, sympy.Sum) and len(e.limits) == 1 and e.function.has(sympy.Min, sympy.Max):
        var, low, high = e.limits[0]
        if low.is_number and high.is_number:
            return sympy.Add(*(_summed(e.function.xreplace({var: sympy.Integer(k)}))
                               for k in range(int(sympy.ceiling(low)),
                                              int(sympy.floor(high)) + 1)))
    return e.func(*(_summed(a) for a in e.args)) if e.args else e


def predict(kernel: str, variant: str = None, dtype: str = "float64", params=None) -> Cost:
    """The cost of the variant's ONF; params: schedule parameters over its defaults (the
    owner's parts take three of its nine n x n x d products away). The ONF is the CPU's
    where the variant runs there, else that of the first kind it runs on (CUDA's tensor
    cores)."""
    return _predict(kernel, variant, dtype, param_pairs(params))


@lru_cache(maxsize=None)
def _predict(kernel, variant, dtype, params) -> Cost:
    kinds = get_kernel(kernel).variant(variant).kinds
    onf = onf_of(kernel, variant, params=params, dtype=dtype,
                 target="cpu" if "cpu" in kinds else kinds[0])
    bounded_by = sorted({a for n in onf.nests for lp in walk(n.body) if isinstance(lp, Loop)
                         for a in elements_read(lp.stop - lp.start)})
    if bounded_by:
        raise NotModelled(f"{onf.name} {onf.variant}: its loops are bounded by the values of "
                          f"{', '.join(bounded_by)}, not by its sizes: its counts are no "
                          "expression in them (not modelled)")
    view = counting_view(onf)
    return Cost(kernel=onf.name, variant=onf.variant, dtype=check_dtype(dtype), sizes=onf.sizes,
                ops=count_ops(view.nests), traffic=nest_traffic(view.nests),
                minimum=_each_element_once(minimum_traffic(view.nests), view.elements),
                scratch={b.name: sympy.Mul(*b.shape) for b in onf.temps},
                atomics=atomic_updates(view.nests), working_set=_largest(working_set(view.nests)),
                assumptions=view.assumptions, chosen=onf.chosen,
                own_itemsize={b.name: np.dtype(b.element).itemsize for b in onf.inputs
                              if b.element})


def _largest(candidates) -> sympy.Expr:
    """Max of the candidates, less those another is at least for every size >= 1."""
    if not candidates:
        return sympy.Integer(0)
    kept = [c for c in candidates
            if not any(other != c and at_least(other, c) for other in candidates)]
    return sympy.Max(*kept)


def _each_element_once(minimum, elements) -> Dict[str, Moved]:
    """With an infinite cache an element moves at most once each way: where the regions
    over-count an array (two index forms of it, taken disjoint: the owner's K read as j in
    the forward and as p + parts j_in in the key rows' pass), its size (as the counting view
    counts it) is the count."""
    # a CUDA-only variant's block tiles (in shared memory) are no array the view sizes
    at_most = lambda n, array: (elements[array] if array in elements
                                and at_least(n, elements[array]) else n)
    return {a: Moved(at_most(m.read, a), at_most(m.written, a)) for a, m in minimum.items()}
