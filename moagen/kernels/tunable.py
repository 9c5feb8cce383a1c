"""A schedule with parameters, as a kernel module lists it among its variants."""
from dataclasses import dataclass
from typing import Callable, FrozenSet, Mapping, Tuple


@dataclass(frozen=True)
class Tunable:
    """build(**params) gives the transforms; the defaults are what generated/ holds, the
    space the candidates of each parameter `moagen tune` tries on a machine."""
    materialize: FrozenSet[str]
    build: Callable[..., Tuple]
    defaults: Mapping[str, int]
    space: Mapping[str, Tuple[int, ...]]
