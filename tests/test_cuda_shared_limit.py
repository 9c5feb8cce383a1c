"""A tiled kernel's launcher picks the instance compiled for the call's head dim and asks
the device its opt-in shared memory a block before it launches it. Every instance fits
sm_80's 166,912 bytes (the steps refuse one that would not: test_shared_layout), so on
sm_80 float64 at d 128 runs, at its tiles of 32 query rows (124,928 bytes); on an
architecture whose limit an instance exceeds (sm_86's 101,376 against the float64
backward's 157,248 at d <= 128) the call raises SharedMemoryLimit naming the instance, the
bytes and the limit. On the emulation, which plays the architecture MOAGEN_EMULATED_ARCH
names."""
import re

import numpy as np
import pytest

from moagen import runtime
from moagen.cuda_archs import SHARED_OPT_IN
from moagen.errors import EmulationCheckError, SharedMemoryLimit
from moagen.reference import attention_bwd_numpy, attention_fwd_numpy
from moagen.templates import ROOT as TEMPLATES


def _inputs(d, dtype, count):
    rng = np.random.default_rng(d)
    return [rng.standard_normal((1, 2, 9, d)).astype(dtype) for _ in range(count)]


def _attention(d, dtype="float64"):
    """attention_fwd flash on the emulation at head dimension d: its result and numpy's."""
    q, k, v = _inputs(d, dtype, 3)
    kernel = runtime.load("attention_fwd", "flash", "cuda-emulated", dtype)
    o, _ = kernel(q, k, v, scale=d ** -0.5)
    return o, attention_fwd_numpy(q, k, v, d ** -0.5)[0]


def _dq_atomic(d):
    """attention_bwd dq_atomic, float64, on the emulation: its dQ, dK, dV and numpy's."""
    q, k, v, do = _inputs(d, "float64", 4)
    scale = d ** -0.5
    o, lse = attention_fwd_numpy(q, k, v, scale)
    kernel = runtime.load("attention_bwd", "dq_atomic", "cuda-emulated", "float64")
    return kernel(q, k, v, o, do, lse, scale=scale), \
        attention_bwd_numpy(q, k, v, o, do, lse, scale)


def _close(got, expected, tolerance=1e-12):
    return np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_float64_at_d_128_runs_on_every_built_arch(monkeypatch, arch):
    monkeypatch.setenv("MOAGEN_EMULATED_ARCH", arch)
    assert _close(*_attention(d=128))  # attention_fwd_flash_f64_rows<128>: 124,928 bytes
    got, expected = _dq_atomic(d=128)  # attention_bwd_dq_atomic_f64_keys<128>: 157,248
    assert all(_close(g, e) for g, e in zip(got, expected))


def test_float32_fits_sm_80_at_its_own_tiles(monkeypatch):
    monkeypatch.setenv("MOAGEN_EMULATED_ARCH", "sm_80")
    assert _close(*_attention(d=100, dtype="float32"), tolerance=2e-5)  # 87,040 bytes


def test_an_instance_over_the_device_s_limit_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("MOAGEN_EMULATED_ARCH", "sm_86")
    with pytest.raises(SharedMemoryLimit) as refused:
        _dq_atomic(d=100)
    message = str(refused.value)
    assert "attention_bwd_dq_atomic_f64_keys<128>" in message
    assert "157248 bytes" in message and "allows 101376" in message


def test_an_architecture_the_emulation_does_not_know_is_named(monkeypatch):
    monkeypatch.setenv("MOAGEN_EMULATED_ARCH", "sm_75")
    with pytest.raises(EmulationCheckError, match="MOAGEN_EMULATED_ARCH=sm_75"):
        _attention(d=40)


def test_the_emulation_plays_each_built_arch_at_the_table_s_limit():
    """The emulated device's opt-in limits (a C table of its own, with architectures not
    built for) agree with moagen.cuda_archs' for those built."""
    header = (TEMPLATES / "cuda" / "emulation" / "cuda_runtime.h").read_text()
    played = {arch: int(kb) * 1024
              for arch, kb in re.findall(r'\{"(sm_\d+)", (\d+) \* 1024\}', header)}
    assert {arch: played.get(arch) for arch in SHARED_OPT_IN} == SHARED_OPT_IN
