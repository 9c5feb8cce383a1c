"""Schedule parameters and `moagen tune`: the registry's defaults and spaces, sources emitted
with other parameters, the search (each candidate verified, then timed), the tuning file,
and the bench running and recording this machine's choice. No test asserts a time."""
import json

import pytest

from moagen import tuning
from moagen.bench import calls, suite, tune
from moagen.cli import main
from moagen.emit import emit
from moagen.errors import UnknownNameError
from moagen.kernels import get_kernel


def test_defaults_space_and_candidates():
    tiled = get_kernel("mlp_fwd").variant("tiled")
    assert tiled.params({"mr": 4}) == {"mr": 4, "nr": 8, "row_block": 96}
    assert get_kernel("attention_fwd").variant("online").params({"rows": 2}, "cuda") == \
        {"rows": 2, "keys": 4}
    with pytest.raises(UnknownNameError, match="no schedule parameter rows"):
        tiled.params({"rows": 4})
    tried = tune.candidates(tiled)
    # mr 6 in blocks of 64 rows is not a candidate: a block holds whole tiles
    assert len(tried) == 3 * 3 * 3 - 3 and tiled.defaults_for("cpu") in tried
    assert all(p["row_block"] % p["mr"] == 0 for p in tried)
    assert all(tiled.params(tiled.avx512[d], "cpu", d) in tried for d in tiled.avx512)
    assert len({tuple(p.items()) for p in tried}) == len(tried)
    assert not get_kernel("attention_fwd").variant("dnf").space


def test_emitted_source_names_its_parameters():
    default = emit("attention_fwd", "online", "c")
    two = emit("attention_fwd", "online", "c", params={"rows": 2})
    assert "unroll_jam(rows, i, 8)" in default and "--param" not in default
    assert "Target cpu; schedule parameters rows=8 keys=2." in default
    assert "unroll_jam(rows, i, 2)" in two and "--variant online --param rows=2" in two
    assert "Target cpu; schedule parameters rows=2 keys=2." in two
    assert "qk_1" in two and "qk_2" not in two


def test_bad_parameters_on_the_command_line(capsys):
    with pytest.raises(SystemExit):
        main(["emit", "attention_fwd", "--variant", "online", "--param", "rows=four"])
    assert "expected NAME=INTEGER" in capsys.readouterr().err
    assert main(["emit", "attention_fwd", "--variant", "online", "--param", "cols=2"]) != 0
    assert "no schedule parameter cols" in capsys.readouterr().err


def test_a_composite_is_not_searched_its_stages_are_named(capsys):
    assert main(["tune", "block_fwd"]) != 0
    err = capsys.readouterr().err
    assert "block_fwd is a composite" in err and "attention_fwd flash" in err


def test_search_verifies_times_and_records_the_choice(tmp_path, capsys):
    out = tmp_path / "tuning.json"
    code = main(["tune", "attention_decode", "--variant", "split", "--n", "64", "--repeats", "1",
                 "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())[tuning.machine_key()]["attention_decode:split:c:float64"]
    assert [c["params"] for c in record["candidates"]] == [{"heads": h} for h in (1, 2, 4, 8)]
    assert record["params"] == min(record["candidates"], key=lambda c: c["median_s"])["params"]
    assert "<- chosen" in capsys.readouterr().out
    untuned = calls.schedule("attention_decode", "split", "c", "float64")
    assert record["defaults"] == untuned["params"]

    choices = tuning.load_choices(out)
    jobs = suite.plan(["attention_decode"], ["c"], [1], lengths=[64], choices=choices)
    impls = [impl for job in jobs for group in job.groups for impl in group["impls"]]
    assert ["c", "split", record["params"]] in impls
    assert ["c", "dnf", None] in impls  # no parameters: nothing chosen


def test_a_choice_for_parameters_the_variant_no_longer_has_is_left_out(capsys):
    """A schedule changed since the machine was tuned: its defaults run, with a warning."""
    stale = {"rmsnorm_bwd:dnf:c:float64": {"params": {"rows": 2}},
             "mlp_fwd:tiled:c:float64": {"params": {"mr": 4, "nr": 8, "row_block": 0}}}
    assert tuning.chosen(stale, "rmsnorm_bwd", "dnf", "c", "float64") is None
    assert "rmsnorm_bwd dnf c float64 (rows=2) are not the variant's parameters" in \
        capsys.readouterr().err
    assert tuning.chosen(stale, "mlp_fwd", "tiled", "c", "float64") == \
        {"mr": 4, "nr": 8, "row_block": 0}


def test_a_choice_is_kept_per_sizes_set_and_found_for_the_nearest():
    """Tuned at d=128 (and heads=8): used there; at other sizes the choice tuned with fewer
    of the sizes given is used; sizes a kernel does not have do not count."""
    plain = {"params": {"rows": 4, "keys": 4}}
    wide = {"params": {"rows": 8, "keys": 2}}
    key = "attention_fwd:online:c:float64"
    choices = {key: plain, key + "@d=128,heads=8": wide}
    pick = lambda sizes: tuning.chosen(choices, "attention_fwd", "online", "c", "float64", sizes)
    assert pick({"heads": 8, "d": 128}) == wide["params"]
    assert pick({"heads": 8, "d": 128, "dff": 1408}) == wide["params"]  # no dff in attention
    assert pick({"heads": 8, "d": 64}) == pick({}) == pick(None) == plain["params"]
    assert tuning.choice_key("attention_fwd", "online", "c", "float64", {"heads": 8, "d": 128}) == \
        key + "@d=128,heads=8"
