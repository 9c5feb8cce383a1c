"""FlushExp: every exponential of a nest flushed (exp, or 0 below -700), the value a softmax
computes kept, the C helper's edge values, and what it refuses."""
import math
import subprocess

import numpy as np
import pytest
import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import sym
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, stmt_exprs, walk
from moagen.pipeline import onf_of
from moagen.steps.loop.flush_exp import FlushExp
from moagen.targets.c.printer import _flushed_exp

I, J, N = sym("i"), sym("j"), sym("n")


def _softmax_rows():
    """p[i, j] = exp(s[i, j] - max_j s[i, j]) / sum_j exp(...), one nest."""
    s = lambda: S.Access("s", (I, J))
    shifted = S.Un("exp", S.Bin("-", s(), S.Local("m")))
    body = (Let("m", S.Num(float("-inf"))),
            Loop(J, sympy.Integer(0), N, (Update("m", "max", s()),)),
            Let("l", S.Num(0.0)),
            Loop(J, sympy.Integer(0), N, (Update("l", "+", shifted),)),
            Loop(J, sympy.Integer(0), N, (Store("p", (I, J), S.Bin("/", shifted, S.Local("l"))),)))
    return ONF("softmax", "test", (Buffer("s", (N, N)),), (Buffer("p", (N, N)),), (), (N,), (),
               (Nest("p", (Loop(I, sympy.Integer(0), N, body),), "p = softmax(s)"),))


def _functions(onf):
    return [x.fn for n in onf.nests for s in walk(n.body) for e in stmt_exprs(s)
            for x in S.subexpressions(e) if isinstance(x, S.Un)]


def test_every_exp_flushed_and_a_masked_softmax_kept():
    """Masked scores (-inf) and scores 800 below their row's maximum give 0, as exp does
    in float64 beside the row's 1; the rest the same to rounding."""
    onf = FlushExp()(_softmax_rows())
    assert _functions(onf) == ["exp_flushed"] * 2
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((9, 9))
    scores[rng.random((9, 9)) < 0.3] = -np.inf
    scores[:, 0] = 1.0  # every row sees a key
    scores[2, 1] = -800.0
    want = run_onf(_softmax_rows(), {"s": scores}, {})["p"]
    got = run_onf(onf, {"s": scores}, {})["p"]
    assert got[2, 1] == 0.0 and np.all(got[scores == -np.inf] == 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


def test_the_masked_flash_kernels_flush_on_a_cpu_only():
    for kernel in (f"attention_cross_{kind}_{mask}" for kind in ("fwd", "bwd")
                   for mask in ("masked", "masked2d", "bool2d")):
        functions = _functions(onf_of(kernel, "flash"))
        assert "exp_flushed" in functions and "exp" not in functions
        assert "exp_flushed" not in _functions(onf_of(kernel, "flash", target="cuda"))
    assert "exp_flushed" not in _functions(onf_of("attention_cross_fwd", "flash"))


def test_a_nest_with_no_exp_is_refused():
    with pytest.raises(ScheduleError, match="no exp"):
        FlushExp(nest="p")(_no_exp())


def _no_exp():
    return ONF("copy", "test", (Buffer("s", (N,)),), (Buffer("p", (N,)),), (), (N,), (),
               (Nest("p", (Loop(I, sympy.Integer(0), N, (Store("p", (I,), S.Access("s", (I,))),)),),
                     "p = s"),))


C_EDGES = """#include <math.h>
#include <stdio.h>
{double}
{float}
int main(void)
{{
    const double x[] = {{-INFINITY, -1e300, -709.0, -700.5, -699.5, -1.0, 0.0, NAN}};
    for (int k = 0; k < 8; ++k)
        printf("%.17g %.9g\\n", exp_flushed_double(x[k], moagen_exp_floor_double),
               (double)exp_flushed_float((float)x[k], moagen_exp_floor_float));
    return 0;
}}
"""


def test_the_c_helper_gives_exp_or_zero(tmp_path):
    """Below -700 (float: -80) 0, -inf included; above, exp's own value; NaN stays NaN."""
    source = tmp_path / "edges.c"
    source.write_text(C_EDGES.format(double=_flushed_exp("float64"),
                                     float=_flushed_exp("float32")))
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-std=c99", str(source), "-o",
                    str(tmp_path / "edges"), "-lm"], check=True)
    lines = subprocess.run([str(tmp_path / "edges")], capture_output=True, text=True,
                           check=True).stdout.split("\n")
    got = [tuple(map(float, line.split())) for line in lines if line]
    inputs = (-math.inf, -1e300, -709.0, -700.5, -699.5, -1.0, 0.0, math.nan)
    for x, (flushed, flushed_float) in zip(inputs, got):
        if math.isnan(x):
            assert math.isnan(flushed) and math.isnan(flushed_float)
            continue
        assert flushed == (0.0 if x < -700 else math.exp(x))
        assert flushed_float == (0.0 if x < -80 else pytest.approx(math.exp(x), rel=1e-6))
