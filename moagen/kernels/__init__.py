"""The kernel registry: each kernel is a MoA spec plus named variants, a variant being what
it materializes and its steps in three layers (moagen.kernels.layers); or a composite of
registered kernels (the block).

A variant's steps may have parameters (tile sizes, rows unrolled together): the module
gives a Tunable, whose defaults per target kind and dtype are what generated/ holds (C and
Fortran the CPU's, CUDA the GPU's; float32 may have its own) and whose space is what
`moagen tune` searches on a machine.

Each module also declares what its kernels are verified and measured on (CHECKS and BENCH,
moagen.kernels.cases): every registered kernel has both."""
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Dict, FrozenSet, Mapping, Optional, Tuple

from moagen.errors import SpecError, UnknownNameError
from moagen.kernels import (attention, attention_bwd, attention_cross, attention_decode,
                            attention_dropout, attention_fwdbwd, attention_gqa, attention_varlen,
                            block, kv_append, mlp, projections, rmsnorm)
from moagen.kernels.cases import Bench, Check
from moagen.kernels.compose import Composite
from moagen.kernels.layers import Layers, cpu
from moagen.kernels.tunable import Tunable
from moagen.moa.spec import KernelSpec
from moagen.onf.signature import DTYPE_BYTES, DTYPES, check_dtype
from moagen.kinds import DEFAULT_KINDS, KINDS, get_kind


@dataclass(frozen=True)
class Variant:
    name: str
    materialize: FrozenSet[str]
    build: Callable[..., Tuple]
    # the parameters' defaults per target kind ("cpu", "cuda") and dtype: what is fast there
    defaults: Mapping[str, Mapping[str, Mapping[str, int]]] = field(default_factory=dict)
    space: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)
    # dtype -> the CPU defaults it overrides where the compiler targets AVX-512 (Tunable)
    avx512: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    accepts: Optional[Callable[..., bool]] = None  # Tunable's
    kinds: Tuple[str, ...] = tuple(KINDS)  # the target kinds it runs on (Tunable's)

    def runs_on(self, kind: str) -> bool:
        return get_kind(kind).name in self.kinds

    def defaults_for(self, target: str = "cpu", dtype: str = "float64") -> Dict[str, int]:
        target, dtype = get_kind(target).defaults, check_dtype(dtype)
        if target not in self.defaults and self.defaults:
            raise UnknownNameError(f"variant {self.name} has no defaults for target {target!r}; "
                                   f"it has {', '.join(self.defaults)}")
        return dict(self.defaults.get(target, {}).get(dtype, {}))

    def params(self, chosen=None, target: str = "cpu", dtype: str = "float64") -> Dict[str, int]:
        """The defaults of the target and dtype with `chosen` (a mapping or pairs) over them;
        unknown names are an error."""
        chosen = dict(chosen or {})
        defaults = self.defaults_for(target, dtype)
        unknown = set(chosen) - set(defaults)
        if unknown:
            raise UnknownNameError(f"variant {self.name} has no schedule parameter "
                                   f"{', '.join(sorted(unknown))}; its parameters: "
                                   f"{', '.join(defaults) or '(none)'}")
        return {**defaults, **chosen}

    def layers(self, params=None, target: str = "cpu", dtype: str = "float64") -> Layers:
        return self.build(**self.params(params, target, dtype))

    def steps(self, params=None, target: str = "cpu", dtype: str = "float64") -> Tuple:
        """Every step for the target: its algorithm, loop schedule and mapping."""
        return self.layers(params, target, dtype).steps(target)


class _Variants:
    def variants_on(self, kind: str) -> Dict[str, Variant]:
        """The variants that run on a target kind, by name: what every enumeration of a
        kernel's variants for a language lists."""
        return {name: v for name, v in self.variants.items() if v.runs_on(kind)}

    def variant(self, name=None, target: Optional[str] = None, dtype: str = "float64"):
        """The named variant, refused where a target kind is given that it does not run on;
        when name is None the kind's default for the dtype (default_variant; the CPU's where
        no kind is given)."""
        if name is None:
            return self.variants[self.default_variant(target or "cpu", dtype)]
        if name not in self.variants:
            raise UnknownNameError(f"kernel {self.name} has no variant {name!r}; its variants: "
                                   f"{', '.join(self.variants)}")
        if target and not self.variants[name].runs_on(target):
            raise UnknownNameError(
                f"{self.name} {name} runs on {' and '.join(self.variants[name].kinds)} only, "
                f"not on target kind {get_kind(target).name}; its variants on it: "
                f"{', '.join(self.variants_on(target))}")
        return self.variants[name]

    def variant_on_each(self, name: str, kinds) -> Variant:
        """The named variant, refused (as variant() refuses) on the first of `kinds` it does
        not run on: a variant asked for in several languages at once."""
        for kind in kinds:
            self.variant(name, kind)
        return self.variant(name)  # an unknown name refused where no kind is given too

    def default_variant(self, target: str = "cpu", dtype: str = "float64",
                        otherwise: str = None) -> str:
        """The variant a target kind runs where none is named: the module's DEVICE_DEFAULTS
        entry for the kind and dtype (the CUDA GEMMs' tensor cores) where that runs on the
        kind (OpenACC takes CUDA's defaults, not its tensor cores), else `otherwise`, else
        the first that runs there."""
        by_dtype = getattr(self, "device_defaults", {}).get(get_kind(target).defaults, {})
        chosen = by_dtype.get(check_dtype(dtype))
        if chosen and self.variants[chosen].runs_on(target):
            return chosen
        return otherwise or next(iter(self.variants_on(target)))


@dataclass(frozen=True)
class Kernel(_Variants):
    spec: KernelSpec
    variants: Dict[str, Variant]
    check: Check  # the references and sizes moagen.verify compares it with
    bench: Bench  # the sizes and lengths moagen bench measures it at
    # checks of a call's sizes and scalars beyond shapes: validate(sizes, scalars) raises
    # ValueError before native code runs
    validate: Optional[Callable] = None
    # target kind -> dtype -> the variant it runs where none is named (default_variant)
    device_defaults: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def name(self):
        return self.spec.name

    @property
    def given(self):
        return self.spec.given

    def dnf(self, variant=None):
        from moagen.moa.dnf import psi_reduce
        return psi_reduce(self.spec, self.variant(variant).materialize)

    def onf(self, variant=None, layout="row", params=None, target="cpu", upto=None,
            dtype="float64", element_bytes=None):
        """The final ONF for a target kind, with the dtype's defaults under `params`;
        upto = K: the ONF after its first K steps; element_bytes: those of the dtypes it is
        printed for (None: the dtype's)."""
        from moagen.onf.realize import realize
        v = self.variant(variant, target, dtype)
        return realize(self.dnf(v.name), v.name, v.steps(params, target, dtype), layout, upto,
                       element_bytes or (DTYPE_BYTES[dtype],))


@dataclass(frozen=True)
class CompositeKernel(_Variants):
    """One variant, `composed`: the stages as the composite lists them. Its schedule
    parameters are its stages', each named `<stage label>.<parameter>` (attn.rows), with the
    stages' defaults per target kind and dtype; moagen.load runs each stage at what that
    stage's own kernel would load on the machine (moagen.request); moagen.pipeline
    composes its ONF from theirs."""
    composite: Composite
    check: Check
    bench: Bench
    validate: Optional[Callable] = None
    given = ()

    @property
    def name(self):
        return self.composite.name

    @cached_property
    def variants(self):
        def defaults_for(target, dtype):
            return self.stage_params(lambda st: get_kernel(st.kernel)
                                     .variant(stage_variant(st, target, dtype))
                                     .defaults_for(target, dtype))

        defaults = {target: {dtype: defaults_for(target, dtype) for dtype in DTYPES}
                    for target in DEFAULT_KINDS}
        return {"composed": Variant("composed", frozenset(), _stage_layers, defaults)}

    def stage_params(self, choose) -> Dict[str, int]:
        """The composite's parameters that choose(stage) gives each stage (a mapping of the
        stage kernel's parameters, or None for none), named under the stage's label."""
        return {f"{st.label}.{name}": value for st in self.composite.stages
                for name, value in (choose(st) or {}).items()}


def stage_variant(stage, target: str, dtype: str) -> str:
    """The variant a composite's stage runs on a target kind: its kernel's default there
    where the kernel's module declares one that runs there (DEVICE_DEFAULTS: CUDA's GEMMs
    on tensor cores, CUDA's alone), else the one the stage names."""
    return get_kernel(stage.kernel).default_variant(target, dtype, stage.variant)


def _stage_layers(**stage_params):
    """A composite's own layers: an empty CPU mapping; its steps are its stages'
    (moagen.pipeline composes them)."""
    return Layers(mapping=cpu())


def _kernel(module, spec, variants, validate=None):
    cases = (_declared(module, "CHECKS", spec.name), _declared(module, "BENCH", spec.name))
    if isinstance(spec, Composite):
        return CompositeKernel(spec, *cases, validate)
    defaults = getattr(module, "DEVICE_DEFAULTS", {}).get(spec.name, {})
    for kind, by_dtype in defaults.items():
        unknown = set(by_dtype.values()) - set(variants)
        if unknown or set(by_dtype) - set(DTYPES):
            raise SpecError(f"{module.__name__}: DEVICE_DEFAULTS[{spec.name!r}][{kind!r}] names "
                            f"{', '.join(sorted(set(by_dtype) - set(DTYPES)) or unknown)}, "
                            f"not a dtype and a variant of {spec.name}")
    return Kernel(spec, {name: _variant(name, entry) for name, entry in variants.items()},
                  *cases, validate, defaults)


def _declared(module, table, kernel):
    """What a kernel's module declares for it in one of its tables (CHECKS, BENCH)."""
    declared = getattr(module, table, {})
    if kernel not in declared:
        raise SpecError(f"{module.__name__} lists kernel {kernel} but has no {table} entry "
                        "for it (moagen.kernels.cases)")
    return declared[kernel]


def _variant(name, entry):
    if isinstance(entry, Tunable):
        return Variant(name, entry.materialize, entry.build, entry.per_target(),
                       dict(entry.space), dict(entry.avx512), entry.accepts, entry.kinds)
    materialize, layers = entry
    return Variant(name, materialize, lambda: layers)


# each kernel module lists its (spec, variants[, validate]) tuples; a composite's variants
# are None
MODULES = (attention, attention_bwd, attention_fwdbwd, attention_gqa, attention_cross,
           attention_varlen, attention_dropout, attention_decode, kv_append, rmsnorm, mlp,
           projections, block)
KERNELS = {k.name: k for module in MODULES
           for k in (_kernel(module, *entry) for entry in module.KERNELS)}


# the name a derived backward has, <forward>_vjp (moagen.moa.grad), for the kernels that are
# one: the same kernel as its own name
ALIASES = {alias: name for module in MODULES
           for alias, name in getattr(module, "ALIASES", {}).items()}


def get_kernel(name: str):
    name = ALIASES.get(name, name)
    if name not in KERNELS:
        raise UnknownNameError(f"unknown kernel {name!r}; known kernels: {', '.join(KERNELS)}")
    return KERNELS[name]
