"""A request for one kernel, resolved once: the kernel, its variant, the target (language)
and dtype, and every schedule parameter it runs with. Emit, build, load, verify, the bench
and the command line take a Request and resolve nothing again; a bad request (an unknown
name, a parameter the variant does not have, a negative tile) is refused here, before any
source is printed.

    request = resolve("attention_fwd", "flash", lang="c", dtype="float32")
    request.params  # every parameter in effect, as pairs
    request.chosen  # those over the portable defaults: () is what generated/ holds

Where the caller names no parameters, a CPU target runs what this machine chose: its
`moagen tune` choice where tuned (moagen.tuning), else the variant's AVX-512 defaults where
the language's compiler targets AVX-512, else the portable defaults. A composite runs each
stage at what that stage's own request would choose."""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from moagen.errors import ScheduleError
from moagen.kernels import CompositeKernel, get_kernel
from moagen.kinds import get_kind
from moagen.onf.loops import ONF
from moagen.onf.signature import Signature, check_dtype, signature
from moagen.pipeline import onf_of, param_pairs
from moagen.targets import get_target
from moagen.targets.target import Target
from moagen.targets.toolchain import Toolchain
from moagen.tuning import chosen as tuned_choice, load_choices

Pairs = Tuple[Tuple[str, int], ...]


@dataclass(frozen=True)
class Request:
    kernel: str  # the registered name (an alias, attention_fwd_vjp, resolved)
    variant: str
    target: Target
    dtype: str
    chosen: Pairs  # the parameters over the variant's portable defaults
    params: Pairs  # every parameter in effect, in the variant's order

    @property
    def lang(self) -> str:
        return self.target.name

    @property
    def kind(self) -> str:
        return self.target.kind

    def at(self, dtype: str) -> "Request":
        """The same choice at another dtype: the chosen parameters over its defaults."""
        variant = get_kernel(self.kernel).variant(self.variant)
        return replace(self, dtype=check_dtype(dtype),
                       params=tuple(variant.params(self.chosen, self.kind, dtype).items()))

    def onf(self) -> ONF:
        return onf_of(self.kernel, self.variant, params=self.params, target=self.kind,
                      dtype=self.dtype)

    def signature(self) -> Signature:
        return signature(self.onf(), self.dtype)


def resolve(kernel: str, variant: Optional[str] = None, lang: str = "c",
            dtype: str = "float64", params=None, tuned: bool = True,
            here: bool = True) -> Request:
    """params: schedule parameters over the variant's defaults for the target kind and
    dtype; None: this machine's choice (tuned: its tuning file may choose; here=False: the
    portable defaults, what generated/ holds)."""
    target, dtype = get_target(lang), check_dtype(dtype)
    k = get_kernel(kernel)
    v = k.variant(variant, target.kind, dtype)
    if params is None and here:
        params = machine_choice(k.name, v.name, target, dtype, tuned)
    chosen = dict(params or {})
    for name, value in chosen.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ScheduleError(f"{k.name} {v.name}: schedule parameter {name}={value!r} "
                                   "is not a whole number of 0 or more")
    return Request(k.name, v.name, target, dtype, param_pairs(chosen),
                   tuple(v.params(chosen, target.kind, dtype).items()))


def machine_choice(kernel: str, variant: str, target: Target, dtype: str, tuned: bool):
    """What this machine runs over the portable defaults on a CPU target (the module's
    docstring says which), or None."""
    if not get_kind(target.kind).host:
        return None
    k = get_kernel(kernel)
    if isinstance(k, CompositeKernel):
        return k.stage_params(lambda st: machine_choice(st.kernel, st.variant, target, dtype,
                                                        tuned)) or None
    return ((tuned and tuned_choice(load_choices(), kernel, variant, target.name, dtype))
            or avx512_defaults(kernel, variant, target, dtype))


def avx512_defaults(kernel: str, variant: str, target: Target, dtype: str):
    """The variant's AVX-512 defaults (Tunable.avx512) where the language's compiler targets
    AVX-512; None where there are none or it does not. Asked for host targets only
    (machine_choice)."""
    overrides = get_kernel(kernel).variant(variant).avx512.get(dtype)
    if overrides and Toolchain().targets_avx512(target.toolchain):
        return dict(overrides)
    return None
