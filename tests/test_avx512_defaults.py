"""Defaults for AVX-512 machines: a Tunable's `avx512` overrides reach moagen.load and the
bench's record where the compiler targets AVX-512, and nowhere else; generated/ keeps the
portable defaults (which tests/test_verify.py checks), and the AVX-512 tiles keep the value
in C and Fortran where the machine loads them."""
import platform

import numpy as np
import pytest

from moagen.targets import toolchain
from moagen.targets.toolchain import Toolchain
from moagen import pipeline, runtime, verify
from moagen import tuning
from moagen.bench import calls
from moagen.cli import main
from moagen.errors import SpecError, UnknownNameError
from moagen.kernels import get_kernel
from moagen.kernels.attention import FLASH_AVX512, flash_params
from moagen.kernels.attention_dropout import BACKWARD_AVX512
from moagen.philox import KEYS_PER_RUN
from moagen.kernels.mlp import TILE_AVX512
from moagen.kernels.tunable import Tunable
from moagen.onf.signature import DTYPES
from moagen.request import resolve
from moagen.torch_ops.attention_args import fitted

TILED = get_kernel("mlp_fwd").variant("tiled")


@pytest.fixture(params=[True, False], ids=["avx512", "no-avx512"])
def avx512(request, monkeypatch):
    monkeypatch.setattr(Toolchain, "targets_avx512", lambda self, record: request.param)
    return request.param


def test_overrides_for_an_unknown_dtype_or_parameter_are_errors():
    make = lambda avx512: Tunable(frozenset(), lambda **p: (), defaults={"nr": 8}, space={},
                                  avx512=avx512)
    with pytest.raises(SpecError, match="avx512 names unknown dtype float16"):
        make({"float16": {"nr": 16}})
    with pytest.raises(SpecError, match=r"avx512\['float32'\] sets width, not among"):
        make({"float32": {"width": 32}})


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_host_defaults_follow_the_compiler(avx512, dtype):
    portable = TILED.defaults_for("cpu", dtype)
    expected = {**portable, **TILE_AVX512[dtype]} if avx512 else portable
    for lang in ("c", "fortran"):
        assert calls.schedule("mlp_fwd", "tiled", lang, dtype) == dict(params=expected,
                                                                     tuned=False)
    # a GPU, a kernel without such overrides: their own defaults on any machine
    assert resolve("mlp_fwd", "tiled", "cuda", dtype).chosen == ()
    assert resolve("attention_fwd", "online", "c", dtype).chosen == ()
    # an explicit parameter is taken over generated/'s defaults, as everywhere
    assert calls.schedule("mlp_fwd", "tiled", "c", dtype, {"mr": 4})["params"] == \
        {**portable, "mr": 4}


def test_a_tuned_choice_wins_over_the_avx512_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Toolchain, "targets_avx512", lambda self, record: True)
    choice = {"mr": 4, "nr": 8, "row_block": 0}
    tuning.save([dict(kernel="mlp_fwd", variant="tiled", lang="c", dtype="float64",
                    params=choice)], tmp_path / tuning.DEFAULT_FILE)
    assert dict(resolve("mlp_fwd", "tiled", "c", "float64").chosen) == choice
    assert dict(resolve("mlp_fwd", "tiled", "c", "float64", tuned=False).chosen) == \
        TILE_AVX512["float64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_composites_stages_take_their_own_avx512_defaults(avx512, dtype):
    """The block's parameters are its stages' (attn.rows, mlp.nr): where the compiler
    targets AVX-512 each stage runs its AVX-512 defaults, as its own kernel would there."""
    params = calls.schedule("block_fwd", "composed", "c", dtype)["params"]
    stage = lambda label: {k.split(".")[1]: v for k, v in params.items()
                           if k.startswith(label + ".")}
    flash = get_kernel("attention_fwd").variant("flash").defaults_for("cpu", dtype)
    assert stage("attn") == {**flash, **(FLASH_AVX512[dtype] if avx512 else {})}
    assert stage("mlp") == {**TILED.defaults_for("cpu", dtype),
                            **(TILE_AVX512[dtype] if avx512 else {})}
    # and the composite composes each stage's ONF at its own
    by_stage = pipeline.stage_params("block_fwd", params)
    assert by_stage["attn"] == stage("attn") and by_stage["mlp"] == stage("mlp")


def test_a_composite_runs_a_stages_tuned_choice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    choice = {"rows": 4, "lanes": 8, "block": 64}
    tuning.save([dict(kernel="attention_fwd", variant="flash", lang="c", dtype="float64",
                    params=choice)], tmp_path / tuning.DEFAULT_FILE)
    attn = lambda params: {k: v for k, v in params if k.startswith("attn.")}
    assert attn(resolve("block_fwd", "composed", "c", "float64").chosen) == \
        {"attn.rows": 4, "attn.lanes": 8, "attn.block": 64}
    assert attn(resolve("block_fwd", "composed", "c", "float64",
                        tuned=False).chosen).get("attn.rows") != 4


def test_a_composite_refuses_a_parameter_no_stage_has():
    with pytest.raises(UnknownNameError, match="no schedule parameter attn.width"):
        pipeline.onf_of("block_fwd", params={"attn.width": 8})


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 target options")
def test_the_compiler_is_asked_with_its_flags():
    cc = Toolchain().cc
    assert toolchain._enables(cc, ("-march=skylake-avx512",), "-mavx512f")
    assert not toolchain._enables(cc, ("-march=x86-64-v3",), "-mavx512f")  # AVX2
    assert not toolchain._enables("no-such-compiler-here", (), "-mavx512f")


@pytest.mark.parametrize("lang", ["c", "fortran"])
# the flash kernels' causal twins run the same tiles (with blocks skipped): the plain ones
# stand for them
@pytest.mark.parametrize("kernel, variant", [("mlp_fwd", "tiled"), ("mlp_bwd", "tiled"),
                                             ("attention_fwd", "flash"),
                                             ("attention_bwd", "flash")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tiles_this_machine_loads_keep_the_value(kernel, variant, lang, dtype):
    """tests/test_verify.py checks generated/'s tiles: here also the AVX-512 ones, where
    this machine loads them."""
    if resolve(kernel, variant, lang, dtype, tuned=False).chosen == ():
        pytest.skip("this machine loads generated/'s tiles: tests/test_verify.py checks them")
    load = lambda k, v, l, d: runtime.load(k, v, l, d, tuned=False)
    for sizes in get_kernel(kernel).check.sizes:
        row = verify.check_case(kernel, variant, lang, dtype, sizes, load=load)
        assert row.status == "pass", verify.format_row(row)
        assert max(row.errors.values()) <= verify.TOLERANCE[dtype]


def test_list_shows_them(capsys):
    assert main(["list"]) == 0
    mlp_fwd, = (line for line in capsys.readouterr().out.splitlines()
                if line.startswith("mlp_fwd:"))
    shown = " ".join(f"{k}={v}" for k, v in TILE_AVX512["float64"].items())
    assert f"(avx512 float64: {shown})" in mlp_fwd


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_portable_flash_tiles_fit_avx2s_registers(dtype):
    """generated/'s flash tiles are AVX2's (16 vector registers of 32 bytes): a row of the
    score tile in two registers, 6 rows, 12 accumulators; AVX-512's wider tiles are its
    overrides."""
    portable = get_kernel("attention_fwd").variant("flash").defaults_for("cpu", dtype)
    assert portable["lanes"] * np.dtype(dtype).itemsize == 2 * 32
    assert portable["rows"] * 2 <= 12


def test_the_small_models_flash_parameters_never_widen_the_tiles():
    assert flash_params(1024, 16, False, lanes=8) == {}  # AVX2's float64 tiles stand
    assert flash_params(1024, 16, False, lanes=32) == {"lanes": 16}
    assert flash_params(64, 64, True, lanes=8) == {"block": 16, "rows": 8, "lanes": 8}
    assert flash_params(1024, 64, True, lanes=32) == {}


@pytest.fixture
def fresh_fits():
    fitted.cache_clear()  # fits are kept per process; these tests change the machine
    yield
    fitted.cache_clear()


def test_moagen_torch_fits_the_flash_tiles_over_this_machines_defaults(avx512, fresh_fits,
                                                                       tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no tuning file
    forward, plain = "attention_gqa_fwd_causal", "attention_gqa_fwd"
    portable = get_kernel(forward).variant("flash").defaults_for("cpu", "float64")
    machine = {**portable, **(FLASH_AVX512["float64"] if avx512 else {})}
    # a short causal sequence: blocks of 16 keys, tiles of 8 rows at most 16 lanes wide
    assert dict(fitted(forward, "c", "float64", 64, 64, True)) == \
        {**machine, "block": 16, "rows": 8, "lanes": min(machine["lanes"], 16)}
    # a head under 32 wide: AVX-512's float32 32 lanes narrowed, the rest (rows, blocks)
    # this machine's, not generated/'s; 16 lanes (float32's portable ones) kept
    wide = {**get_kernel(plain).variant("flash").defaults_for("cpu", "float32"),
            **(FLASH_AVX512["float32"] if avx512 else {})}
    assert wide["lanes"] == (32 if avx512 else 16)
    assert dict(fitted(plain, "c", "float32", 1024, 16, False)) == \
        ({**wide, "lanes": 16} if avx512 else {})
    # the backward has no key blocks of its own: its tiles of 8 rows, no wider than 16 lanes
    backward = "attention_gqa_bwd_causal"
    owner = dict(resolve(backward, "flash", "c", "float64").params)
    assert dict(fitted(backward, "c", "float64", 64, 64, True)) == \
        ({} if owner["rows"] == 8 else {**owner, "rows": 8})
    assert fitted(backward, "c", "float64", 1024, 64, True) == ()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_dropout_backward_widens_its_columns_not_philox_groups(avx512, dtype, tmp_path,
                                                                    monkeypatch):
    """Its AVX-512 tiles keep 8 key rows (a Philox group each, UnrollDraws) and take a row
    in two 512-bit registers."""
    monkeypatch.chdir(tmp_path)  # no tuning file
    variant = get_kernel("attention_dropout_bwd").variant("flash")
    here = dict(resolve("attention_dropout_bwd", "flash", "c", dtype).params)
    assert here == {**variant.defaults_for("cpu", dtype),
                    **(BACKWARD_AVX512[dtype] if avx512 else {})}
    assert here["rows"] == KEYS_PER_RUN
    assert here["lanes"] * np.dtype(dtype).itemsize == (128 if avx512 else 64)
