"""The target kinds: what a variant's mapping layer is written for. A kind is one record: how
its mapping is derived from the CPU's where a variant gives none, whose schedule defaults it
runs, and whether a machine's own choice (its `moagen tune` choice, AVX-512 defaults) applies
to it. The languages printed from a kind are moagen.targets.of_kind(name).

A new kind is a record here and its line in KINDS; a new language on a kind is a target
package (moagen.targets)."""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from moagen.errors import UnknownNameError
from moagen.steps.loop.parallel import GpuThreads


def gpu_threads(cpu: Tuple) -> Tuple:
    """The GPU mapping derived from a CPU one: each Parallel chain as GPU threads, one an
    iteration."""
    return tuple(GpuThreads(step.vars, nest=step.nest) for step in cpu)


@dataclass(frozen=True)
class TargetKind:
    name: str
    # the CPU mapping -> this kind's, where a variant gives none; None: every variant
    # gives its own (the CPU's is what the others derive from)
    derive_mapping: Optional[Callable[[Tuple], Tuple]] = None
    # the kind whose schedule defaults it runs; None: its own (a Tunable's per target)
    defaults_of: Optional[str] = None
    # runs on this machine's cores: its tuning and AVX-512 defaults apply
    host: bool = False

    @property
    def defaults(self) -> str:
        return self.defaults_of or self.name


CPU = TargetKind("cpu", host=True)
CUDA = TargetKind("cuda", derive_mapping=gpu_threads)
# an OpenACC vector lane runs what a CUDA thread runs, so it takes CUDA's defaults
OPENACC = TargetKind("openacc", derive_mapping=gpu_threads, defaults_of="cuda")

KINDS = {kind.name: kind for kind in (CPU, CUDA, OPENACC)}
# the kinds with schedule defaults of their own
DEFAULT_KINDS = tuple(name for name, kind in KINDS.items() if kind.defaults_of is None)


def get_kind(name: str) -> TargetKind:
    if name not in KINDS:
        raise UnknownNameError(f"unknown target kind {name!r}; expected one of {', '.join(KINDS)}")
    return KINDS[name]
