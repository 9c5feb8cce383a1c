"""The kernel registry: each kernel is a MoA spec plus named variants, a variant being what
it materializes and its schedule."""
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Optional, Tuple

from moagen.errors import UnknownNameError
from moagen.kernels import (attention, attention_bwd, attention_decode, attention_fwdbwd,
                            kv_append, rmsnorm)
from moagen.moa.spec import KernelSpec


@dataclass(frozen=True)
class Variant:
    name: str
    materialize: FrozenSet[str]
    schedule: Tuple


@dataclass(frozen=True)
class Kernel:
    spec: KernelSpec
    variants: Dict[str, Variant]
    # checks of a call's sizes and scalars beyond shapes: validate(sizes, scalars) raises
    # ValueError before native code runs
    validate: Optional[Callable] = None

    @property
    def name(self):
        return self.spec.name

    def variant(self, name=None) -> Variant:
        """The named variant; the first one when name is None."""
        if name is None:
            return next(iter(self.variants.values()))
        if name not in self.variants:
            raise UnknownNameError(f"kernel {self.name} has no variant {name!r}; its variants: "
                                   f"{', '.join(self.variants)}")
        return self.variants[name]


def _kernel(spec, variants, validate=None) -> Kernel:
    return Kernel(spec, {name: Variant(name, materialize, schedule)
                         for name, (materialize, schedule) in variants.items()}, validate)


# each kernel module lists its (spec, variants[, validate]) tuples
MODULES = (attention, attention_bwd, attention_fwdbwd, attention_decode, kv_append, rmsnorm)
KERNELS = {k.name: k for module in MODULES for k in (_kernel(*entry) for entry in module.KERNELS)}


def get_kernel(name: str) -> Kernel:
    if name not in KERNELS:
        raise UnknownNameError(f"unknown kernel {name!r}; known kernels: {', '.join(KERNELS)}")
    return KERNELS[name]
