"""The bench's PyTorch baselines (moagen.baselines, declared in each kernel module's BENCH)
compute what they say: the outputs each returns agree with the kernel's numpy reference."""
import numpy as np
import pytest

from moagen.bench import calls
from moagen.kernels import KERNELS


def _normwise(ours, theirs):
    return np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), np.finfo(float).tiny)


def _agreement(kernel, lang):
    """The largest normwise error of a baseline's outputs against the numpy reference's,
    at the kernel's second verification size (odd sizes, batch and heads past one). A
    dropout's baseline draws SDPA's own random numbers, not moagen's: compared at p = 0,
    where neither draws any."""
    check = KERNELS[kernel].check
    sizes = check.sizes[min(1, len(check.sizes) - 1)]
    args, scalars = calls.inputs(kernel, sizes, "float64"), calls.scalars(kernel, sizes)
    if "dropout_p" in scalars:
        scalars["dropout_p"] = 0.0
    expected = check.references["numpy"](*(a.copy() for a in args), **scalars)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = calls.kernel_callable(kernel, None, lang, "float64")(*args, **scalars)
    got = got if isinstance(got, tuple) else (got,)
    which = KERNELS[kernel].bench.torch.outputs or range(len(expected))
    assert len(got) == len(which), f"{kernel}: {len(got)} outputs, declared {list(which)}"
    return max(_normwise(g.detach().numpy(), expected[i]) for g, i in zip(got, which))


@pytest.mark.parametrize("kernel", KERNELS)
def test_eager_baseline_agrees_with_the_numpy_reference(kernel):
    assert _agreement(kernel, "torch") <= 1e-12


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=lambda k: k.name)
def test_every_baseline_says_in_one_line_what_it_computes(kernel):
    baseline = kernel.bench.torch
    assert baseline.computes and "\n" not in baseline.computes
    for lang in calls.BASELINES:
        assert calls.computes(kernel.name, lang)


def test_compiled_baseline_agrees_on_a_small_kernel():
    """torch.compile of the same function (Inductor's C++): one kernel, a tiny size."""
    assert _agreement("rmsnorm_fwd", "compiled") <= 1e-12


def test_the_report_names_what_each_baseline_computes_and_its_compile():
    from moagen.bench import report
    base = dict(record="result", kernel="attention_decode", sizes=dict(n=8), variant=None)
    text = report.baselines([dict(base, lang="torch"), dict(base, lang="compiled", compile_s=2.5),
                             dict(base, lang="c", variant="online")])
    lines = text.splitlines()
    assert len(lines) == 2 and "enable_gqa=True" in lines[0] and "no lse" in lines[0]
    assert lines[1].startswith("- attention_decode, compiled: torch.compile of")
    assert lines[1].endswith("(first call, compiling: 2.5 s at n 8)")
