"""What a kernel is run on besides its spec, declared by its module next to the spec:
the independent references and sizes it is verified against (moagen.verify), and the sizes
and lengths it is measured at (moagen.bench) with the PyTorch a user would write for it.
Each kernel module maps its kernels' names to a Check in CHECKS and to a Bench in BENCH."""
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Dict, Mapping, Optional, Tuple


def no_scalars(sizes) -> dict:
    return {}


@dataclass(frozen=True)
class Check:
    references: Dict[str, Callable]  # name -> f(*inputs as float64, **scalars) -> output(s)
    sizes: Tuple[dict, ...]  # n = 1, primes, sizes that divide no tile
    scalars: Callable[[dict], dict] = no_scalars  # the scalar arguments for given sizes
    # inputs that depend on each other (a backward's O and lse come from its forward);
    # by default every input is random normal
    inputs: Optional[Callable] = None  # f(random inputs as float64 by name, scalars) -> dict
    # the integer inputs (a packed batch's offsets) at given sizes, by name: f(sizes) -> dict
    integers: Optional[Callable[[dict], dict]] = None


def references(numpy, torch, **keywords) -> Dict[str, Callable]:
    """A kernel's numpy and PyTorch references, both given `keywords` (causal=True)."""
    return {"numpy": partial(numpy, **keywords), "torch": partial(torch, **keywords)}


@dataclass(frozen=True)
class Baseline:
    """The fastest PyTorch a user would write for a kernel: the bench's `torch` baseline, and
    under torch.compile its `compiled` one. Not a reference: it may leave out an output
    PyTorch cannot give cheaply, and says so in `computes`."""
    name: str  # a function of moagen.baselines (named: torch is imported only to run it)
    computes: str  # one line: what it computes, and what of the kernel's outputs it leaves out
    outputs: Optional[Tuple[int, ...]] = None  # the kernel's outputs it returns; None: all
    keywords: Mapping = field(default_factory=dict)  # given to it besides the call's scalars

    def function(self) -> Callable:
        """f(*inputs as torch tensors, **scalars) -> tensor or tuple of tensors."""
        from moagen import baselines
        return partial(getattr(baselines, self.name), **self.keywords)


@dataclass(frozen=True)
class Bench:
    sizes: Callable[[int], dict]  # a transformer layer's sizes at sequence (or cache) length n
    quick: Tuple[int, ...]  # the lengths of a sanity sweep
    full: Tuple[int, ...]  # the lengths of a full sweep
    torch: Optional[Baseline] = None  # set per kernel with `measured_against`

    def lengths(self, quick: bool) -> Tuple[int, ...]:
        return self.quick if quick else self.full

    def measured_against(self, name, computes, outputs=None, **keywords) -> "Bench":
        """These sizes and lengths, with this kernel's PyTorch baseline."""
        return replace(self, torch=Baseline(name, computes, outputs, keywords))


# the benchmarks' model: 8 heads of 64, d_ff = 2.75 d_model
MODEL = dict(dm=512, heads=8, dh=64, dff=1408)


def on_model(*names) -> Bench:
    """A layer kernel measured on the model: batch 1, length n and the model's sizes it
    has, in that order."""
    return Bench(lambda n: dict(batch=1, n=n, **{name: MODEL[name] for name in names}),
                 quick=(256,), full=(512, 2048))
