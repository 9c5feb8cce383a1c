"""moagen.torch on CUDA tensors: the CUDA kernels against PyTorch's own operators on the same
GPU, gradients by torch.autograd.gradcheck (float64, odd
sizes), torch.compile(fullgraph=True), decode through a KVCache on the GPU; each call queued
on PyTorch's current stream, with no copy between host and device. bench/gpu.sh runs this
on the GPU machine; where there is no GPU every test skips (tests/test_torch_ops.py checks
the same operators on the CPU, and fake CUDA tensors through the checks)."""
import pytest
import torch
import torch.nn.functional as F

import moagen.torch as mt
from moagen.targets.cuda import loader as cuda
from moagen.targets.abi import KernelCallable
from test_torch_ops import (TinyModel, assert_block_is_pytorchs, assert_compiled_is_eager,
                            assert_decode_is_sdpa)

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and cuda.available()),
                                reason="no GPU (or no cuda-python) here")

F64 = torch.float64


def _randn(*shape, dtype=F64, seed=[0]):
    seed[0] += 1
    g = torch.Generator(device="cuda").manual_seed(seed[0])
    return torch.randn(*shape, dtype=dtype, device="cuda", generator=g).requires_grad_()


def _close(got, want, rtol=1e-12):
    assert got.device == want.device
    scale = max(want.abs().max().item(), 1.0)
    assert (got - want).abs().max().item() <= rtol * scale


@pytest.fixture
def launches(monkeypatch):
    """The streams of the kernel calls made, and a count of the driver's host-device copies."""
    seen = {"streams": [], "copies": 0}
    call = KernelCallable.__call__

    def spy(self, *args, stream=None, **kwargs):
        seen["streams"].append(stream)
        return call(self, *args, stream=stream, **kwargs)

    monkeypatch.setattr(KernelCallable, "__call__", spy)
    gpu = cuda.device()
    for method in ("copy_in", "copy_out"):
        original = getattr(gpu, method)
        monkeypatch.setattr(gpu, method, lambda *args, _o=original:
                            seen.__setitem__("copies", seen["copies"] + 1) or _o(*args))
    return seen


@pytest.mark.parametrize("causal, kv_heads", [(False, 3), (True, 1)])
def test_attention_is_sdpa_on_the_gpu_and_passes_gradcheck(causal, kv_heads, launches):
    q, k, v = _randn(2, 3, 7, 5), _randn(2, kv_heads, 7, 5), _randn(2, kv_heads, 7, 5)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    got = mt.attention(q, k, v, causal=causal)
    _close(got, want)
    dq, dk, dv = torch.autograd.grad(got.square().sum(), (q, k, v))
    for ours, theirs in zip((dq, dk, dv), torch.autograd.grad(want.square().sum(), (q, k, v))):
        _close(ours, theirs)
    assert launches["copies"] == 0 and set(launches["streams"]) == {0}  # the default stream
    assert torch.autograd.gradcheck(
        lambda q, k, v: mt.attention(q, k, v, causal=causal, scale=0.3), (q, k, v))


def test_attention_at_a_longer_sequence_in_both_dtypes():
    """Past one key block and one thread block; float32 to float32's precision."""
    for dtype, rtol in ((F64, 1e-12), (torch.float32, 2e-5)):
        q, k, v = (_randn(1, 4, 300, 64, dtype=dtype) for _ in range(3))
        got = mt.attention(q, k, v, causal=True)
        want = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=True)
        _close(got.double(), want, rtol)
        grads = torch.autograd.grad(got.double().square().sum(), (q, k, v))
        expected = torch.autograd.grad(want.square().sum(), (q, k, v))
        for ours, theirs in zip(grads, expected):
            _close(ours.double(), theirs.double(), rtol * 10)


def test_rms_norm_and_the_mlp_pass_gradcheck_on_the_gpu():
    x, w = _randn(2, 3, 7, 5), _randn(5)
    _close(mt.rms_norm(x, w, 1e-5), F.rms_norm(x, (5,), w, 1e-5))
    assert torch.autograd.gradcheck(lambda x, w: mt.rms_norm(x, w, 1e-5), (x, w))
    x, wg, wu, wd = _randn(2, 7, 5), _randn(5, 9), _randn(5, 9), _randn(9, 5)
    _close(mt.swiglu_mlp(x, wg, wu, wd), (F.silu(x @ wg) * (x @ wu)) @ wd)
    assert torch.autograd.gradcheck(mt.swiglu_mlp, (x, wg, wu, wd))


@pytest.mark.parametrize("causal", [False, True])
def test_the_block_on_the_gpu_is_the_pytorch_block_and_passes_gradcheck(causal):
    """A Block moved to the GPU: its values and every gradient against autograd through the
    PyTorch block on the same GPU (no CPU kernel is needed)."""
    torch.manual_seed(3)
    block = mt.Block(d_model=7, heads=3, d_head=5, d_ff=11, dtype=F64, causal=causal).cuda()
    assert_block_is_pytorchs(block, _randn(2, 5, 7))


def test_decode_through_a_kv_cache_on_the_gpu_is_sdpa_over_the_cache():
    cache = mt.KVCache(batch=2, kv_heads=2, capacity=9, head_dim=5, dtype=F64, device="cuda")
    assert_decode_is_sdpa(cache, _randn)


def test_calls_are_queued_on_the_current_stream(launches):
    """Made, used and read on a side stream (PyTorch's are non-blocking: the default stream
    does not wait for them): each kernel is queued there, after the work that made its
    inputs."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q, k, v = (_randn(2, 4, 257, 64) for _ in range(3))
        got = mt.attention(q, k, v)
        grads = torch.autograd.grad(got.sum(), (q, k, v))
        want = F.scaled_dot_product_attention(q, k, v)
        expected = torch.autograd.grad(want.sum(), (q, k, v))
    torch.cuda.synchronize()
    _close(got, want)
    for ours, theirs in zip(grads, expected):
        _close(ours, theirs)
    assert set(launches["streams"]) == {stream.cuda_stream} and launches["copies"] == 0


def test_torch_compile_fullgraph_on_the_gpu_matches_eager():
    torch.manual_seed(0)
    assert_compiled_is_eager(TinyModel().cuda(), torch.randn(2, 5, 8, dtype=F64, device="cuda"))


def test_tensors_on_two_devices_are_refused():
    q = _randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="the tensors must be on one device, got q: cuda:0, "
                                         "k: cpu"):
        mt.attention(q, q.detach().cpu(), q)
