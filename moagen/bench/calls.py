"""What a sweep runs: each kernel's sizes as a function of one length n, and the callables
timed on the same inputs: generated kernels per language (moagen.targets) and the baselines:
the numpy reference, and the PyTorch a user would write, eager (`torch`) and compiled by
torch.compile (`compiled`: Inductor, C++ and OpenMP on a CPU). Each kernel's module declares
its sizes, lengths, references and PyTorch baseline (its `bench` and `check`,
moagen.kernels.cases). A language whose kernels run on a device (CUDA) is measured on that
device's arrays, next to PyTorch on the same device (moagen.bench.worker)."""
import numpy as np

from moagen.errors import DeviceUnavailable, MoagenError, UnknownNameError
from moagen.request import resolve

BASELINES = ("numpy", "torch", "compiled")
# compiled is asked for by name: Inductor takes tens of seconds per kernel and shape
DEFAULT_BASELINES = ("numpy", "torch")


def _bench(kernel: str):
    from moagen.kernels import get_kernel
    return get_kernel(kernel).bench


def sizes(kernel: str, n: int, overrides=None) -> dict:
    """Sizes of a transformer layer's shape, at sequence (or cache) length n; overrides
    replace the kernel's other sizes of the same names (n is never overridden)."""
    base = _bench(kernel).sizes(n)
    bad = {k for k in overrides or {} if k == "n" or not isinstance(overrides[k], int)
           or overrides[k] < 1}
    if bad:
        raise UnknownNameError(f"cannot set {', '.join(sorted(bad))}: give other sizes than n "
                               "as positive integers (n with --n)")
    return {k: (overrides or {}).get(k, v) for k, v in base.items()}


def lengths(kernel: str, quick: bool):
    return _bench(kernel).lengths(quick)


def targets(items, langs):
    """KERNEL[:VARIANT] -> [(kernel, variant)] measured in each of these languages: every
    variant that runs on all their kinds when none is named; a named one is refused on a
    kind it does not run on (CUDA's tensor cores in C)."""
    from moagen.kernels import get_kernel
    from moagen.targets import get_target
    kinds = {get_target(lang).kind for lang in langs}
    out = []
    for item in items:
        name, _, variant = item.partition(":")
        kernel = get_kernel(name)
        if variant:
            out.append((kernel.name, kernel.variant_on_each(variant, kinds).name))
        else:
            out += [(kernel.name, v) for v in kernel.variants
                    if all(v in kernel.variants_on(kind) for kind in kinds)]
    return out


def check_impl(lang: str, dry_run=False):
    """A language to measure (the baselines run next to every one anyway), refused up front
    where its kernels cannot run here or its times would mean nothing (unless the run is a
    dry run, which checks the sweep end to end and measures nothing)."""
    from moagen.targets import get_target
    target = get_target(lang)
    if not target.measured and not dry_run:
        raise MoagenError(f"{lang} is for verification: its times say nothing about the "
                          f"machine it is meant for; measure {target.variant_of} there")
    if not target.runs_here():
        raise DeviceUnavailable(f"{lang} requested but {target.missing} is available here")
    return lang


def device_of(langs):
    """The device target the languages' kernels run on (a name), or None for the host; a
    sweep measures on one side only, so that every call of a group gets the same arrays."""
    from moagen.targets import get_target
    devices = {lang: get_target(lang).device is not None for lang in langs}
    if len(set(devices.values())) > 1:
        raise MoagenError(f"{', '.join(l for l, d in devices.items() if d)} run on a device and "
                          f"{', '.join(l for l, d in devices.items() if not d)} on the host: "
                          "measure them in separate runs")
    return next((lang for lang, on_device in devices.items() if on_device), None)


def check_baselines(baselines, device):
    """The baselines that can run next to kernels on `device` (None: the host): PyTorch
    runs on a GPU, the numpy reference does not."""
    if device and "numpy" in baselines:
        raise MoagenError("the numpy baseline runs on the host only: leave it out where the "
                          f"kernels run on a device ({device}); torch runs there")
    return tuple(baselines)


def scalars(kernel: str, sizes: dict) -> dict:
    """The call's scalars, and the sizes no input shape determines (a cache's valid rows)."""
    from moagen.verify import call_scalars
    return call_scalars(kernel, sizes)


def inputs(kernel: str, sizes: dict, dtype: str, seed=0, empty=np.empty):
    """The kernel's inputs, consistent where they depend on each other (a backward's O, lse),
    copied into arrays from `empty` (which decides where their pages are first touched)."""
    from moagen.kernels import get_kernel
    from moagen.verify import make_inputs
    sig = resolve(kernel, dtype=dtype, here=False).signature()
    arrays = make_inputs(sig, sizes, scalars(kernel, sizes), get_kernel(kernel).check,
                         np.random.default_rng(seed))
    placed = [empty(a.shape, a.dtype) for a in arrays]
    for dst, src in zip(placed, arrays):
        np.copyto(dst, src)
    return placed


def kernel_callable(kernel: str, variant: str, lang: str, dtype: str, params=None, device=None):
    """A callable(*inputs, out=None, **scalars) for a generated kernel (params: schedule
    parameters over the variant's defaults) or a baseline; device: where the inputs are
    (a device of moagen.targets, None for numpy arrays), for the baselines."""
    from moagen import runtime
    from moagen.kernels import get_kernel
    if lang == "numpy":
        reference = get_kernel(kernel).check.references[lang]
        return lambda *args, out=None, **kw: reference(*args, **kw)
    if lang in BASELINES:
        return _on_tensors(_torch_baseline(kernel, compiled=lang == "compiled"), device)
    return runtime.load(kernel, variant, lang, dtype, params, tuned=False)


def schedule(kernel: str, variant: str, lang: str, dtype: str, params=None) -> dict:
    """The schedule parameters one of our calls runs with (its target's defaults for the
    dtype, a GPU's for CUDA, this machine's where they differ, under params), and whether
    `moagen tune` chose them."""
    return dict(params=dict(resolve(kernel, variant, lang, dtype, params, tuned=False).params),
                tuned=bool(params))


def computes(kernel: str, baseline: str) -> str:
    """One line: what a baseline computes for this kernel."""
    from moagen.kernels import get_kernel
    if baseline == "numpy":
        return "every output, by the numpy verification reference"
    what = get_kernel(kernel).bench.torch.computes
    return what if baseline == "torch" else f"torch.compile of the torch baseline: {what}"


def _torch_baseline(kernel: str, compiled: bool):
    from moagen.kernels import get_kernel
    fn = get_kernel(kernel).bench.torch.function()
    if not compiled:
        return fn
    import torch
    # a fresh compile per kernel and shape (static shapes): what the timing measures is the
    # code Inductor generates for exactly these sizes, its compile left to the warm-up
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def _on_tensors(fn, device=None):
    """The baseline over the inputs, shared with torch without a copy: numpy arrays, or a
    device's arrays (CUDA tensors on a GPU)."""
    import torch
    tensor = torch.from_numpy if device is None else device.torch_tensor
    return lambda *args, out=None, **kw: fn(*map(tensor, args), **kw)


def outputs(fn, sizes, on_device=False):
    """Preallocated outputs of a generated kernel (None for baselines and in-place kernels),
    so that timed calls allocate nothing; on its device where the inputs are."""
    from moagen.targets.cuda.arrays import DeviceArray
    sig = getattr(fn, "signature", None)
    if sig is None or not sig.outputs:
        return None
    env = {s: sizes[s.name] for s in sig.sizes if s.name in sizes}  # a chosen one shapes no output
    empty = (lambda shape: DeviceArray(fn.device, shape, sig.dtype)) if on_device else \
        (lambda shape: np.empty(shape, sig.dtype))
    outs = tuple(empty(tuple(int(d.subs(env)) for d in p.shape)) for p in sig.outputs)
    return outs if len(outs) > 1 else outs[0]
