"""Schedule defaults per dtype: a Tunable's overrides for one dtype reach the ONF, each
dtype's function in an emitted source, the runtime's binding, `moagen show` and the bench's
record; an explicit or tuned parameter wins over them."""
import numpy as np
import pytest

from moagen.targets.toolchain import Toolchain
from moagen import reference, reference_block, runtime
from moagen import tuning
from moagen.bench import calls
from moagen.cli import main
from moagen.emit import emit
from moagen.errors import SpecError, UnknownNameError
from moagen.kernels import get_kernel
from moagen.kernels.tunable import Tunable
from moagen.onf.interpret import run_onf
from moagen.pipeline import onf_of
from moagen.verify import check_case

FLASH = get_kernel("attention_fwd").variant("flash")


def _lanes(signature) -> int:
    """The key panel's width in a flash signature: its scratch K_panel[..., d, lanes]."""
    panel, = (a for a in signature.arrays if a.name == "K_panel")
    return int(panel.shape[-1])


def test_a_tunable_overrides_its_defaults_per_target_and_dtype():
    tunable = Tunable(frozenset(), lambda **p: (), defaults={"rows": 8, "lanes": 16},
                      space={}, cuda={"rows": 4}, dtypes={"float32": {"lanes": 32}},
                      cuda_dtypes={"float32": {"rows": 2}})
    assert tunable.per_target() == {
        "cpu": {"float64": {"rows": 8, "lanes": 16}, "float32": {"rows": 8, "lanes": 32}},
        "cuda": {"float64": {"rows": 4, "lanes": 16}, "float32": {"rows": 2, "lanes": 16}}}


def test_overrides_for_an_unknown_dtype_or_parameter_are_errors():
    make = lambda **overrides: Tunable(frozenset(), lambda **p: (), defaults={"lanes": 16},
                                       space={}, **overrides)
    with pytest.raises(SpecError, match="unknown dtype float16; expected float64, float32"):
        make(dtypes={"float16": {"lanes": 32}})
    with pytest.raises(SpecError, match="unknown dtype bf16"):
        make(cuda_dtypes={"bf16": {"lanes": 8}})
    with pytest.raises(SpecError, match=r"dtypes\['float32'\] sets width, not among"):
        make(dtypes={"float32": {"width": 32}})
    with pytest.raises(SpecError, match=r"cuda_dtypes\['float64'\] sets width, not among"):
        make(cuda={"block": 32}, cuda_dtypes={"float64": {"width": 16}})
    with pytest.raises(UnknownNameError, match="unknown dtype 'int8'"):
        FLASH.params(None, "cpu", "int8")


def test_each_dtype_function_is_built_with_its_own_parameters():
    f64, f32 = (FLASH.defaults_for("cpu", d) for d in ("float64", "float32"))
    assert f64["lanes"] != f32["lanes"]  # what the rest of this file relies on
    text = lambda params: " ".join(f"{k}={v}" for k, v in params.items())
    source = emit("attention_fwd", "flash", "c")
    first, second = source.split("void attention_fwd_flash_f32(")
    # one accumulator per query row and key lane: qk_<row>_<lane>
    assert f"qk_0_{f64['lanes'] - 1} " in first and f"qk_0_{f64['lanes']} " not in first
    assert f"qk_0_{f32['lanes'] - 1} " in second
    assert f"schedule parameters {text(f64)} (float64), {text(f32)} (float32)." in source
    assert "Schedule (float64): " in source and "Schedule (float32): " in source
    # one dtype alone: its parameters, no per-dtype lines
    alone = emit("attention_fwd", "flash", "c", dtypes=("float32",))
    assert f"schedule parameters {text(f32)}." in alone and "Schedule: " in alone
    # an explicit parameter holds for every dtype
    explicit = emit("attention_fwd", "flash", "c", params={"lanes": f64["lanes"]})
    assert f"schedule parameters {text(f64)}." in explicit
    assert f"qk_0_{f64['lanes']} " not in explicit.split("void attention_fwd_flash_f32(")[1]


def test_show_takes_the_dtype(capsys):
    assert main(["show", "attention_fwd", "--variant", "flash", "--stage", "onf",
                 "--dtype", "float32"]) == 0
    lanes = FLASH.defaults_for("cpu", "float32")["lanes"]
    assert f"key_tiles(rows, j, {lanes}, also=(rows.edge, rows.edge.edge))" in \
        capsys.readouterr().out
    assert main(["show", "attention_fwd", "--variant", "flash", "--stage", "onf",
                 "--dtype", "float32", "--param", "lanes=8"]) == 0
    assert "key_tiles(rows, j, 8, also=(rows.edge, rows.edge.edge))" in capsys.readouterr().out


def test_the_runtime_binds_the_dtype_defaults_and_a_tuned_choice_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # this machine's tuning file: none yet, then the one below
    # a machine without AVX-512 (tests/test_avx512_defaults.py: what it changes)
    monkeypatch.setattr(Toolchain, "targets_avx512", lambda self, record: False)
    f64, f32 = (FLASH.defaults_for("cpu", d) for d in ("float64", "float32"))
    sizes = dict(batch=1, heads=2, n=37, d=5)  # n cuts both panel widths
    defaults = runtime.load("attention_fwd", "flash", "c", "float32")
    assert _lanes(defaults.signature) == f32["lanes"]
    row = check_case("attention_fwd", "flash", "c", "float32", sizes, lambda *a: defaults)
    assert row.status == "pass", row

    tuning.save([dict(kernel="attention_fwd", variant="flash", lang="c", dtype="float32",
                    params=f64)], tmp_path / tuning.DEFAULT_FILE)
    tuned = runtime.load("attention_fwd", "flash", "c", "float32")
    assert _lanes(tuned.signature) == f64["lanes"]
    row = check_case("attention_fwd", "flash", "c", "float32", sizes, lambda *a: tuned)
    assert row.status == "pass", row


def test_the_bench_records_the_parameters_of_the_dtype(monkeypatch):
    # a machine without AVX-512: what it adds over these is tests/test_avx512_defaults.py's
    monkeypatch.setattr(Toolchain, "targets_avx512", lambda self, record: False)
    assert calls.schedule("attention_fwd", "flash", "c", "float32") == \
        dict(params=FLASH.defaults_for("cpu", "float32"), tuned=False)
    chosen = calls.schedule("attention_fwd", "flash", "c", "float32", {"lanes": 8})
    assert chosen["params"]["lanes"] == 8 and chosen["tuned"]
    assert calls.schedule("attention_fwd", "flash", "cuda", "float32")["params"] == \
        FLASH.defaults_for("cuda", "float32")


def test_the_float32_defaults_keep_the_value():
    """The schedules the float32 defaults make, run by the ONF interpreter (in float64
    arithmetic) against numpy: keys past a block and a panel, columns past a tile."""
    rng = np.random.default_rng(0)
    qkv = {name: rng.standard_normal((1, 1, 70, 5)) for name in "QKV"}
    got = run_onf(onf_of("attention_fwd", "flash", dtype="float32"), qkv, {"scale": 0.5})
    want_o, want_lse = reference.attention_fwd_numpy(qkv["Q"], qkv["K"], qkv["V"], 0.5)
    np.testing.assert_allclose(got["O"], want_o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got["lse"], want_lse, rtol=1e-12)

    shapes = dict(X=(1, 7, 13), Wg=(13, 37), Wu=(13, 37), Wd=(37, 13))
    mlp = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    got = run_onf(onf_of("mlp_fwd", "tiled", dtype="float32"), mlp, {})
    for name, want in zip(("F", "U", "V"), reference_block.mlp_fwd_numpy(*mlp.values())):
        np.testing.assert_allclose(got[name], want, rtol=1e-12, atol=1e-13)


def test_the_projections_take_the_mlps_tiles_per_dtype():
    """qkv_proj, out_proj and their backwards: the MLP's mr and nr, its float32 nr too; the
    float32 schedule run by the ONF interpreter against numpy, head columns past a tile."""
    from moagen.kernels.mlp import TILE_DEFAULTS, TILE_DTYPE_DEFAULTS
    f64 = {k: TILE_DEFAULTS[k] for k in ("mr", "nr")}
    f32 = dict(f64, **TILE_DTYPE_DEFAULTS["float32"])
    assert f32["nr"] > f64["nr"]  # what the check below relies on
    for kernel in ("qkv_proj", "qkv_proj_bwd", "out_proj", "out_proj_bwd"):
        tiled = get_kernel(kernel).variant("tiled")
        assert (tiled.defaults_for("cpu", "float64"), tiled.defaults_for("cpu", "float32")) == \
            (f64, f32), kernel
    rng = np.random.default_rng(3)
    dh = f32["nr"] + 3
    arrays = dict(X=rng.standard_normal((1, 7, 13)),
                  **{w: rng.standard_normal((13, 2, dh)) for w in ("Wq", "Wk", "Wv")},
                  **{g: rng.standard_normal((1, 2, 7, dh)) for g in ("dQ", "dK", "dV")})
    got = run_onf(onf_of("qkv_proj_bwd", "tiled", dtype="float32"), arrays, {})
    want = reference_block.qkv_proj_bwd_numpy(*arrays.values())
    for name, value in zip(("dX", "dWq", "dWk", "dWv"), want):
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=1e-13, err_msg=name)


def test_a_gpu_only_parameter_is_the_gpu_s_alone():
    """cuda may add a parameter the CPU has none of (a thread block's rows), and
    cuda_dtypes override it for one dtype; the CPU's build takes its own default."""
    tunable = Tunable(frozenset(), lambda **p: (), defaults={}, space={}, cuda={"block": 32},
                      cuda_dtypes={"float64": {"block": 16}})
    defaults = tunable.per_target()
    assert defaults["cpu"] == {"float64": {}, "float32": {}}
    assert defaults["cuda"] == {"float64": {"block": 16}, "float32": {"block": 32}}
