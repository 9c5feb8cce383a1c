"""A schedule with parameters, as a kernel module lists it among its variants."""
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Mapping, Optional, Tuple

from moagen.errors import SpecError
from moagen.kinds import KINDS, get_kind
from moagen.onf.signature import DTYPES

Params = Mapping[str, int]


@dataclass(frozen=True)
class Tunable:
    """build(**params) gives the transforms; the defaults are what generated/ holds, the
    space the candidates of each parameter `moagen tune` tries on a machine. `defaults` are
    the CPU's (what the tuner picks on the development machines); `cuda` overrides some of
    them for a GPU, where one thread runs what a CPU core runs in a loop, and may add its
    own (a thread block's rows: the CPU has none, build's default stands there). `dtypes`
    overrides some of the CPU's for one dtype (a vector register holds twice as many
    float32 lanes as float64 ones), `cuda_dtypes` some of the GPU's (float64's tiles take
    twice the shared memory); unnamed dtypes take the target's own. `kinds`: the target
    kinds the variant runs on, where not every kind (tensor cores are CUDA's: elsewhere the
    variant would print its SIMT twin again)."""
    materialize: FrozenSet[str]
    build: Callable[..., Tuple]
    defaults: Params
    space: Mapping[str, Tuple[int, ...]]
    cuda: Optional[Params] = None
    dtypes: Mapping[str, Params] = field(default_factory=dict)
    cuda_dtypes: Mapping[str, Params] = field(default_factory=dict)
    avx512: Mapping[str, Params] = field(default_factory=dict)
    # accepts(**params): whether the schedule takes a combination of the space (a row block
    # must hold whole tiles); None: every combination
    accepts: Optional[Callable[..., bool]] = None
    kinds: Tuple[str, ...] = tuple(KINDS)

    def __post_init__(self):
        for kind in self.kinds:
            get_kind(kind)  # an unknown kind is an error here, not a variant nowhere
        overridden = (("dtypes", self.dtypes), ("cuda_dtypes", self.cuda_dtypes),
                      ("avx512", self.avx512))
        for what, overrides in overridden:
            unknown = set(overrides) - set(DTYPES)
            if unknown:
                raise SpecError(f"Tunable {what} names unknown dtype "
                                f"{', '.join(sorted(unknown))}; expected {', '.join(DTYPES)}")
        on_gpu = {**self.defaults, **(self.cuda or {})}
        for what, by_dtype in overridden:
            known = on_gpu if what == "cuda_dtypes" else self.defaults
            for d, params in by_dtype.items():
                unknown = set(params) - set(known)
                if unknown:
                    raise SpecError(f"Tunable {what}[{d!r}] sets {', '.join(sorted(unknown))}, "
                                    f"not among its parameters {', '.join(known) or '(none)'}")

    def per_target(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """target kind -> dtype -> every parameter's default, for the kinds whose defaults
        the variant runs."""
        gpu = {**self.defaults, **(self.cuda or {})}
        every = {"cpu": {d: {**self.defaults, **self.dtypes.get(d, {})} for d in DTYPES},
                 "cuda": {d: {**gpu, **self.cuda_dtypes.get(d, {})} for d in DTYPES}}
        runs = {get_kind(kind).defaults for kind in self.kinds}
        return {kind: params for kind, params in every.items() if kind in runs}
