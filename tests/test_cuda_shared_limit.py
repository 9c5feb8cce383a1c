"""A tiled kernel's launcher asks the device its opt-in shared memory a block before it
launches: on an architecture whose limit an instance exceeds (attention_fwd flash's float64
d <= 128 instance, 174,080 bytes, against sm_80's 166,912), the call raises
SharedMemoryLimit naming the instance, the bytes and the limit, and the instances that fit
run. On the emulation, which plays the architecture MOAGEN_EMULATED_ARCH names."""
import numpy as np
import pytest

from moagen import runtime
from moagen.errors import EmulationCheckError, SharedMemoryLimit
from moagen.reference import attention_fwd_numpy


def _attention(d, dtype="float64"):
    """attention_fwd flash on the emulation at head dimension d: its result and numpy's."""
    rng = np.random.default_rng(d)
    q, k, v = (rng.standard_normal((1, 2, 9, d)).astype(dtype) for _ in range(3))
    kernel = runtime.load("attention_fwd", "flash", "cuda-emulated", dtype)
    o, _ = kernel(q, k, v, scale=d ** -0.5)
    return o, attention_fwd_numpy(q, k, v, d ** -0.5)[0]


def test_an_instance_over_sm_80s_limit_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("MOAGEN_EMULATED_ARCH", "sm_80")
    with pytest.raises(SharedMemoryLimit) as refused:
        _attention(d=100)
    message = str(refused.value)
    assert "attention_fwd_flash_f64_rows<128>" in message
    assert "174080 bytes" in message and "allows 166912" in message


def test_the_instances_that_fit_sm_80_run(monkeypatch):
    monkeypatch.setenv("MOAGEN_EMULATED_ARCH", "sm_80")
    for d, dtype in ((40, "float64"), (100, "float32")):  # 104,448 and 87,040 bytes
        o, expected = _attention(d, dtype)
        tolerance = 1e-12 if dtype == "float64" else 2e-5
        assert np.abs(o - expected).max() <= tolerance * np.abs(expected).max()


def test_sm_90_runs_the_instance_sm_80_refuses(monkeypatch):
    monkeypatch.setenv("MOAGEN_EMULATED_ARCH", "sm_90")
    o, expected = _attention(d=100)
    assert np.abs(o - expected).max() <= 1e-12 * np.abs(expected).max()


def test_an_architecture_the_emulation_does_not_know_is_named(monkeypatch):
    monkeypatch.setenv("MOAGEN_EMULATED_ARCH", "sm_75")
    with pytest.raises(EmulationCheckError, match="MOAGEN_EMULATED_ARCH=sm_75"):
        _attention(d=40)
