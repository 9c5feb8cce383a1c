"""The targets registry: every language looked up in one place, with what it needs from each
stage; an unknown language named with the known ones."""
import pytest

from moagen import verify
from moagen.targets.toolchain import Toolchain
from moagen.cli import main
from moagen.emit import emit, filename
from moagen.errors import SpecError, UnknownNameError
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import array, inner, transpose
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.realize import realize
from moagen.pipeline import TARGET_KINDS
from moagen.targets import LANGS, TARGETS, emulated, get_target, of_kind
from moagen.targets.fortran.target import NAME_LIMIT


@pytest.mark.parametrize("name", TARGETS)
def test_every_target_has_what_each_stage_looks_up(name):
    target = get_target(name)
    assert target is TARGETS[name] and target.name == name
    assert target.kind in TARGET_KINDS
    assert target.toolchain in Toolchain().describe()
    assert filename("rmsnorm_fwd", "dnf", name) == f"rmsnorm_fwd_dnf.{target.extension}"
    assert "rmsnorm_fwd_dnf_f32" in emit("rmsnorm_fwd", "dnf", name)
    assert all(callable(f) for f in (target.build, target.load, target.bind, target.runs_here))


def test_languages_are_the_targets_but_the_experiments_variants():
    assert LANGS == ("c", "fortran", "cuda")
    assert get_target("c-norestrict").variant_of == "c"
    assert get_target("cuda-emulated").variant_of == "cuda"
    assert emulated("cuda") == "cuda-emulated" and emulated("c") == "c"
    assert get_target("cuda-emulated").emit is get_target("cuda").emit
    assert of_kind("cpu") == ("c", "fortran") and of_kind("cuda") == ("cuda",)
    assert get_target("cuda").compile_only and not get_target("c").compile_only


def test_unknown_language_names_the_known_ones():
    with pytest.raises(UnknownNameError,
                       match=r"unknown language 'rust'; expected one of c, fortran, cuda, c-norestrict, "
                             r"cuda-emulated"):
        get_target("rust")


@pytest.mark.parametrize("name", [n for n in TARGETS if TARGETS[n].runs_here()])
def test_every_target_that_runs_here_computes_the_references(name):
    from moagen import runtime
    row = verify.check_case("rmsnorm_fwd", "dnf", name, "float64", dict(batch=2, n=3, d=5),
                            runtime.load)
    assert row.status == "pass", verify.format_row(row)


def test_the_fortran_target_refuses_names_f90wrap_would_mangle():
    A = array("A", "n", "n")
    long = "k" * (NAME_LIMIT - len("_dnf_f64") + 1)
    spec = KernelSpec(long, (A,), (), (Output("C", inner(A, transpose(A)), ("i", "j")),))
    pairs = [("float64", realize(psi_reduce(spec), "dnf", ()))]
    with pytest.raises(SpecError, match=f"longer than the {NAME_LIMIT} characters"):
        get_target("fortran").emit(pairs, [])
    assert f"{long}_dnf_f64" in get_target("c").emit(pairs, [])


def test_the_ablation_regenerates_as_its_banner_says(capsys):
    assert main(["emit", "--lang", "c-norestrict", "rmsnorm_fwd", "--variant", "dnf"]) == 0
    source = capsys.readouterr().out
    assert source == emit("rmsnorm_fwd", "dnf", "c-norestrict")
    assert "moagen emit --lang c-norestrict rmsnorm_fwd --variant dnf" in source
