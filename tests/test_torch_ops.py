"""moagen.torch: the kernels as PyTorch operators. Values against PyTorch's own operators,
gradients by torch.autograd.gradcheck (float64, odd sizes), the operators' registrations by
torch.library.opcheck, torch.compile(fullgraph=True) through them, decode through KVCache,
and the errors a caller meets."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import moagen.torch as mt
from moagen.reference_block import _block_torch
from moagen.torch_ops.native import call

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """gradcheck makes hundreds of calls on a few dozen numbers each, where two OpenMP
    threads' fork and join would dominate; the kernels share PyTorch's libgomp, so this sets
    theirs too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randn(*shape, dtype=F64, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return torch.randn(*shape, dtype=dtype, generator=g).requires_grad_()


def _close(got, want, rtol=1e-12):
    scale = max(want.abs().max().item(), 1.0)
    assert (got - want).abs().max().item() <= rtol * scale


# C throughout; Fortran once (the operators hand `lang` to moagen.load, and `moagen verify`
# checks every Fortran kernel; each Fortran build takes seconds)
@pytest.mark.parametrize("causal, kv_heads, lang", [(False, 3, "c"), (True, 3, "c"),
                                                    (True, 1, "c"),  # grouped (MQA)
                                                    (False, 1, "fortran")])
def test_attention_is_sdpa_and_passes_gradcheck(causal, kv_heads, lang):
    q, k, v = _randn(2, 3, 7, 5), _randn(2, kv_heads, 7, 5), _randn(2, kv_heads, 7, 5)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    _close(mt.attention(q, k, v, causal=causal, lang=lang), want)
    assert torch.autograd.gradcheck(
        lambda q, k, v: mt.attention(q, k, v, causal=causal, scale=0.3, lang=lang), (q, k, v))


# the forward's schedules past the short sequences' (moagen.kernels.attention.flash_params): a
# float32 head under 32 wide, and the flash kernel's defaults
@pytest.mark.parametrize("n, d, causal, dtype, rtol", [(300, 20, True, torch.float32, 2e-6),
                                                       (300, 40, False, F64, 1e-12)])
def test_attention_forward_past_the_short_sequences_is_sdpa(n, d, causal, dtype, rtol):
    q, k, v = (_randn(1, 2, n, d, dtype=dtype).detach() for _ in range(3))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    _close(mt.attention(q, k, v, causal=causal).double(), want, rtol)


def test_attention_in_float32_and_on_non_contiguous_inputs():
    q, k, v = (_randn(1, 7, 2, 5, dtype=torch.float32).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = mt.attention(q, k, v, causal=True)
    assert got.dtype == torch.float32
    _close(got, want, rtol=2e-6)
    (dq,) = torch.autograd.grad(got.sum(), q)
    (want_dq,) = torch.autograd.grad(want.sum(), q)
    _close(dq, want_dq, rtol=2e-5)


def test_rms_norm_is_pytorchs_and_passes_gradcheck(lang="c"):
    x, w = _randn(2, 3, 7, 5), _randn(5)  # two leading dimensions
    _close(mt.rms_norm(x, w, 1e-5, lang=lang), F.rms_norm(x, (5,), w, 1e-5))
    assert torch.autograd.gradcheck(lambda x, w: mt.rms_norm(x, w, 0.1, lang=lang), (x, w))


def test_swiglu_mlp_is_pytorchs_and_passes_gradcheck(lang="c"):
    x, wg, wu, wd = _randn(2, 7, 5), _randn(5, 9), _randn(5, 9), _randn(9, 5)
    _close(mt.swiglu_mlp(x, wg, wu, wd, lang=lang), (F.silu(x @ wg) * (x @ wu)) @ wd)
    assert torch.autograd.gradcheck(lambda *a: mt.swiglu_mlp(*a, lang=lang), (x, wg, wu, wd))


@pytest.mark.parametrize("causal", [False, True])
def test_block_is_the_pytorch_block_and_passes_gradcheck(causal, lang="c"):
    torch.manual_seed(3)
    block = mt.Block(d_model=7, heads=3, d_head=5, d_ff=11, dtype=F64, lang=lang, causal=causal)
    assert_block_is_pytorchs(block, _randn(2, 5, 7))


def assert_block_is_pytorchs(block, x):
    """The block's output and every gradient against autograd through the PyTorch block on
    the same device, and gradcheck over the block's operator."""
    y = block(x)
    want, _ = _block_torch(x, block.weights(), block.eps, block.scale, block.causal)
    _close(y, want)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *block.weights()], dy)
    expected = torch.autograd.grad(want, [x, *block.weights()], dy)
    for g, e in zip(got, expected):
        _close(g, e)
    # every weight perturbed, not only the ones above: gradcheck on the whole module
    params = [x] + [w.detach().clone().requires_grad_() for w in block.weights()]
    op = lambda x, *w: torch.ops.moagen.block(x, list(w), 0.1, 0.4, block.causal, block.lang)[0]
    assert torch.autograd.gradcheck(op, params, fast_mode=True)


def test_decode_through_the_kv_cache_is_sdpa_over_the_cache(lang="c"):
    cache = mt.KVCache(batch=2, kv_heads=2, capacity=9, head_dim=5, dtype=F64, lang=lang)
    k, v = assert_decode_is_sdpa(cache, _randn)
    with torch.no_grad(), pytest.raises(ValueError, match="the cache is full"):
        cache.append(k, v)


def assert_decode_is_sdpa(cache, randn):
    """A cache of 2 KV heads of 5 filled a position at a time, 6 query heads attending after
    each: SDPA over the rows so far each time. Returns the last position's k and v."""
    keys, values = [], []
    with torch.no_grad():
        for _ in range(cache.capacity):
            k, v, q = randn(2, 2, 1, 5), randn(2, 2, 1, 5), randn(2, 6, 1, 5)
            cache.append(k, v)
            keys.append(k), values.append(v)
            want = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                  enable_gqa=True)
            _close(cache.attend(q), want)
    assert torch.equal(cache.k, torch.cat(keys, 2))
    return k, v


def _ops_and_args():
    x, w = _randn(2, 7, 5), _randn(5)
    q = _randn(2, 3, 7, 5)
    weights = [_randn(*s) for s in [(7,), (7, 2, 3), (7, 2, 3), (7, 2, 3), (2, 3, 7), (7,),
                                    (7, 11), (7, 11), (11, 7)]]
    ops = torch.ops.moagen
    return [(ops.attention.default, (q, q.detach() * 2, q.detach() + 1, None, True, 0, -1,
                                     0.4, "c")),
            # grouped: dK and dV of the KV heads' shape, not q's
            (ops.attention.default, (q, _randn(2, 1, 7, 5), _randn(2, 1, 7, 5), None, False, 0,
                                     -1, 0.4, "c")),
            # 7 queries against 9 keys, causal bottom-right (offset 2): the cross kernels
            (ops.attention.default, (q, _randn(2, 1, 9, 5), _randn(2, 1, 9, 5), None, True, 2,
                                     -1, 0.4, "c")),
            # against 9 keys of which the first 6 are seen (last key 5): the padded kernels
            (ops.attention.default, (q, _randn(2, 1, 9, 5), _randn(2, 1, 9, 5), None, False, 0,
                                     5, 0.4, "c")),
            # against 9 keys under a float mask (its full shape, as moagen.torch makes it)
            (ops.attention.default, (q, _randn(2, 1, 9, 5), _randn(2, 1, 9, 5),
                                     torch.randn(2, 3, 7, 9, dtype=F64), False, 0, -1, 0.4,
                                     "c")),
            (ops.rms_norm.default, (x, w, 1e-5, "c")),
            (ops.swiglu_mlp.default, (x, _randn(5, 9), _randn(5, 9), _randn(9, 5), "c")),
            (ops.block.default, (_randn(2, 5, 7), weights, 1e-5, 0.5, True, "c")),
            (ops.kv_append.default, (torch.zeros(2, 1, 4, 5, dtype=F64),
                                     torch.zeros(2, 1, 4, 5, dtype=F64),
                                     torch.ones(2, 1, 5, dtype=F64),
                                     torch.ones(2, 1, 5, dtype=F64), 1, "c")),
            (ops.attention_decode.default, (torch.randn(2, 3, 5, dtype=F64),
                                            torch.randn(2, 1, 4, 5, dtype=F64),
                                            torch.randn(2, 1, 4, 5, dtype=F64), 3, 0.4, "c"))]


@pytest.mark.parametrize("op, args", _ops_and_args(), ids=lambda p: getattr(p, "__name__", ""))
def test_the_operators_registrations_hold(op, args):
    """opcheck: the schema (mutations declared), the fake implementation's shapes and
    dtypes, the autograd registration, and tracing by AOT autograd."""
    torch.library.opcheck(op, args)


class TinyModel(torch.nn.Module):
    """Every operator in one model: a norm, grouped-query causal attention, the MLP, a
    Block."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads, self.d_head = heads, d // heads
        self.norm = torch.nn.Parameter(torch.ones(d, dtype=F64))
        self.w_qkv = torch.nn.Parameter(torch.randn(d, 2 * d, dtype=F64) / math.sqrt(d))
        # three parameters, not a ParameterList: torch 2.11's dynamo cannot unpack one (*)
        self.w_gate, self.w_up, self.w_down = (
            torch.nn.Parameter(torch.randn(s, dtype=F64) / math.sqrt(s[0]))
            for s in [(d, 12), (d, 12), (12, d)])
        self.block = mt.Block(d, heads, self.d_head, 12, dtype=F64)

    def forward(self, x):
        h = mt.rms_norm(x, self.norm)
        q, kv = (h @ self.w_qkv).split([x.shape[-1], x.shape[-1]], -1)
        q = q.unflatten(-1, (self.heads, self.d_head)).transpose(1, 2)
        kv = kv.unflatten(-1, (2, 1, self.d_head)).permute(2, 0, 3, 1, 4)  # one KV head
        x = x + mt.attention(q, kv[0], kv[1], causal=True).transpose(1, 2).flatten(2)
        x = x + mt.swiglu_mlp(x, self.w_gate, self.w_up, self.w_down)
        return self.block(x)


def test_torch_compile_fullgraph_traces_through_every_operator():
    """fullgraph: a graph break (an operator dynamo cannot trace) would be an error. The
    aot_eager backend traces forward and backward through the fake implementations and the
    autograd formulas as Inductor would, without generating C++ (tens of seconds more)."""
    torch.manual_seed(0)
    assert_compiled_is_eager(TinyModel(), torch.randn(2, 5, 8, dtype=F64))


def assert_compiled_is_eager(model, x):
    """The model under torch.compile(fullgraph=True) gives eager's output and gradients,
    the same bits."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    grads = torch.autograd.grad(y.square().sum(), list(model.parameters()))
    eager = model(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), list(model.parameters()))
    assert torch.equal(y, eager)
    for g, e in zip(grads, eager_grads):
        assert torch.equal(g, e)


def test_eager_calls_skip_the_dispatcher_and_traced_calls_take_the_custom_op():
    """moagen.torch_ops.operator: on plain CPU tensors the implementation runs through an
    autograd.Function (no moagen:: op in the dispatcher's record), on meta tensors the custom
    op and its fake; the compile test above checks that both give the same bits."""
    x, w = _randn(3, 5), _randn(5)
    with torch.profiler.profile() as eager:
        mt.rms_norm(x, w).sum().backward()
    names = {event.name for event in eager.events()}
    assert not any(name.startswith("moagen::") for name in names), names
    assert x.grad is not None and w.grad is not None
    with torch.profiler.profile() as traced:
        z = mt.rms_norm(x.detach().to("meta"), w.detach().to("meta"))
    assert z.device.type == "meta" and z.shape == x.shape
    assert "moagen::rms_norm" in {event.name for event in traced.events()}


def test_an_eager_call_that_writes_its_arguments_bumps_their_versions():
    """The eager path of kv_append (no dispatcher) tells autograd the caches changed, as
    the custom op does: a gradient through a value saved before the append is refused."""
    from moagen.torch_ops.decode import kv_append_op
    cache, other = torch.zeros(1, 2, 4, 3, dtype=torch.float64), torch.zeros(1, 2, 4, 3,
                                                                            dtype=torch.float64)
    row = torch.ones(1, 2, 3, dtype=torch.float64)
    before = cache._version, other._version
    kv_append_op(cache, other, row, row, 0, "c")
    assert (cache._version, other._version) == (before[0] + 1, before[1] + 1)
    kv_append_op.custom_op(cache, other, row, row, 1, "c")
    assert (cache._version, other._version) == (before[0] + 2, before[1] + 2)
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    product = cache * w  # saves cache for w's gradient
    kv_append_op(cache, other, row, row, 2, "c")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()


@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_a_cache_written_in_place_must_be_contiguous(lang):
    """A strided cache is refused: a contiguous copy handed to the kernel would take its
    writes, and the cache would stay as it was."""
    from moagen.torch_ops.decode import kv_append_op
    strided = torch.zeros(1, 4, 2, 3, dtype=torch.float64).transpose(1, 2)
    other, row = torch.zeros(1, 2, 4, 3, dtype=torch.float64), torch.ones(1, 2, 3,
                                                                         dtype=torch.float64)
    assert "K is written in place and must be contiguous" in _errors_of(
        lambda: kv_append_op(strided, other, row, row, 1, lang))
    assert not other.any()  # nothing written
    kv_append_op(other, strided.contiguous(), row, row, 1, lang)  # contiguous: written
    assert other[:, :, 1].eq(1).all()


def _errors_of(call):
    with pytest.raises((ValueError, TypeError)) as error:
        call()
    return str(error.value)


def test_bad_inputs_get_errors_that_name_the_argument():
    q = torch.randn(1, 4, 7, 5)
    assert "dtype torch.float16" in _errors_of(lambda: mt.attention(q.half(), q.half(), q.half()))
    assert "share one dtype" in _errors_of(lambda: mt.attention(q, q.double(), q))
    assert "4 dimensions" in _errors_of(lambda: mt.attention(q[0], q[0], q[0]))
    assert "does not divide" in _errors_of(lambda: mt.attention(q, q[:, :3], q[:, :3]))
    # k and v of one length (q's may differ: tests/test_torch_cross.py)
    assert "k's shape" in _errors_of(lambda: mt.attention(q, q[:, :, :6], q))
    assert "lang must be one of" in _errors_of(lambda: mt.attention(q, q, q, lang="julia"))
    assert "CUDA tensors run moagen's CUDA kernels whatever lang names" in _errors_of(
        lambda: mt.attention(q, q, q, lang="cuda"))
    assert "must be a torch.Tensor" in _errors_of(lambda: mt.rms_norm(q.numpy(), q[0, 0, 0]))
    assert "weight's length" in _errors_of(lambda: mt.rms_norm(q, torch.ones(4)))
    # the custom op called directly checks too (the public function checked above)
    assert "moagen::rms_norm: weight's length" in _errors_of(
        lambda: torch.ops.moagen.rms_norm(q, torch.ones(4), 1e-5, "c"))
    assert "eps must be positive" in _errors_of(lambda: mt.rms_norm(q, torch.ones(5), 0.0))
    x = torch.randn(3, 5)
    assert "w_down's shape" in _errors_of(lambda: mt.swiglu_mlp(x, torch.ones(5, 6),
                                                                torch.ones(5, 6),
                                                                torch.ones(5, 6)))
    cache = mt.KVCache(1, 2, 4, 5)
    assert "the cache is empty" in _errors_of(lambda: cache.attend(torch.randn(1, 2, 1, 5)))
    assert "k's shape" in _errors_of(lambda: cache.append(torch.randn(1, 3, 1, 5),
                                                          torch.randn(1, 3, 1, 5)))
    block = mt.Block(6, 2, 3, 4)
    assert "x must have 3 dimensions" in _errors_of(lambda: block(torch.randn(6)))


def test_a_c_kernel_reads_no_tensor_whose_address_would_mislead_it():
    """The C kernels take the tensors' addresses: the memory must hold the kernel's dtype,
    aligned to it (checked before the address reaches native code)."""
    shifted = torch.frombuffer(bytearray(4 * 17), dtype=torch.float32, offset=1, count=16)
    assert shifted.data_ptr() % 4
    assert "not aligned" in _errors_of(lambda: mt.rms_norm(shifted.view(2, 8), torch.ones(8)))
    assert "expected a CPU tensor of torch.float32" in _errors_of(
        lambda: call("rmsnorm_fwd", "dnf", "c", torch.ones(1, 2, 8),
                     torch.ones(8, dtype=torch.float64), eps=1e-5))


def test_cuda_tensors_pass_the_checks_and_mixed_devices_do_not():
    """No GPU is needed to see it: fake CUDA tensors reach the checks and fake
    implementations torch.compile runs while tracing (tests/test_torch_cuda.py runs the
    kernels on a GPU)."""
    with FakeTensorMode():
        q = torch.empty(1, 2, 3, 4, device="cuda")
        out, lse = torch.ops.moagen.attention(q, q, q, None, False, 0, -1, 0.5, "c")
        assert out.device == q.device and out.shape == q.shape and lse.shape == q.shape[:-1]
        assert "must be on one device" in _errors_of(
            lambda: mt.attention(q, q, torch.empty(1, 2, 3, 4)))
        x = torch.empty(3, 4, device="cuda")
        assert "x: cuda:0, weight: cpu" in _errors_of(lambda: mt.rms_norm(x, torch.ones(4)))


def test_the_tiny_lm_example_times_each_operator_on_both_sides(tmp_path, capsys):
    """examples/train_tiny_lm.py --operators at a tiny size: a row per operator and dtype,
    each side timed, the two sides' outputs and gradients equal to the dtype's rounding."""
    example = _tiny_lm_example()
    assert example.main(["--operators", "2", "--batch", "2", "--context", "7", "--d-model",
                         "12", "--heads", "3", "--kv-heads", "1", "--d-ff", "10",
                         "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "operators.json").read_text())
    for dtype, bound in (("float64", 1e-12), ("float32", 1e-5)):
        rows = results[dtype]
        assert [r["operator"] for r in rows] == ["attention (causal, GQA)", "rms_norm",
                                                 "swiglu_mlp"]
        for r in rows:
            assert r["max_relative_gap"] < bound and min(r["wall_s"].values()) > 0
            assert r["device_s"] == {"moagen": None, "pytorch": None}  # no GPU clock here
    assert "| swiglu_mlp |" in capsys.readouterr().out


def _tiny_lm_example():
    import importlib.util
    path = Path(__file__).parents[1] / "examples" / "train_tiny_lm.py"
    spec = importlib.util.spec_from_file_location("train_tiny_lm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_tiny_lm_example_trains_and_decodes_the_same_both_ways(tmp_path):
    """examples/train_tiny_lm.py at a tiny size, a few steps: its own checks (float64 losses
    to 1e-9 relative at every step, the same generated tokens through both decode paths)
    hold, and it writes the figure."""
    code = _tiny_lm_example().main([
        "--steps", "4", "--dtype", "float64", "--batch", "2", "--context", "12", "--d-model",
        "12", "--heads", "3", "--kv-heads", "1", "--d-ff", "20", "--chars", "3000",
        "--generate", "6", "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    ours, theirs = results["runs"]["moagen float64"], results["runs"]["pytorch float64"]
    assert len(ours["losses"]) == 4 and ours["losses"] != ours["losses"][:1] * 4  # it trains
    assert results["loss_gap_float64"] <= 1e-9
    assert ours["tokens"] == ours["tokens_other_path"] and len(ours["tokens"]) == 4 + 6
    assert (tmp_path / "loss.png").stat().st_size > 0
