"""A schedule with parameters, as a kernel module lists it among its variants."""
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Tunable:
    """build(**params) gives the transforms; the defaults are what generated/ holds, the
    space the candidates of each parameter `moagen tune` tries on a machine. `defaults` are
    the CPU's (what the tuner picks on the development machines); `cuda` overrides some of
    them for a GPU, where one thread runs what a CPU core runs in a loop."""
    materialize: FrozenSet[str]
    build: Callable[..., Tuple]
    defaults: Mapping[str, int]
    space: Mapping[str, Tuple[int, ...]]
    cuda: Optional[Mapping[str, int]] = None

    def per_target(self) -> Dict[str, Dict[str, int]]:
        return {"cpu": dict(self.defaults), "cuda": {**self.defaults, **(self.cuda or {})}}
