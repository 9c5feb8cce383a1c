"""The peak-memory benchmark sees what the ONF predicts: the naive forward's n x n scratch
shows in the measured peak of a fresh process, and the row-wise variants have none (online:
a scratch row of a block of keys per query row)."""
import json

import pytest

from moagen.bench import memory
from moagen.cli import main

SIZES = dict(batch=1, heads=1, n=1024, d=16)


@pytest.fixture(scope="module")
def records():
    return {v: memory.measure("attention_fwd", v, SIZES) for v in ("naive", "dnf", "online")}


def test_naive_peak_holds_its_predicted_temporaries(records):
    naive = records["naive"]
    assert naive.predicted_bytes == 2 * SIZES["n"] ** 2 * 8  # scores and probs, float64
    assert naive.extra_bytes > 0.9 * naive.predicted_bytes


@pytest.mark.parametrize("variant, scratch_per_row", [("dnf", 0), ("online", 64)])
def test_row_wise_variants_need_no_n_by_n_scratch(records, variant, scratch_per_row):
    """dnf holds nothing; online a row of one block of 64 keys' scores per query row."""
    assert records[variant].predicted_bytes == scratch_per_row * SIZES["n"] * 8
    assert records[variant].extra_bytes < 0.1 * records["naive"].extra_bytes


def test_bench_memory_command(capsys, tmp_path):
    """Kernels with other sizes (rmsnorm has no heads) and single variants; JSON records."""
    out = tmp_path / "memory.json"
    code = main(["bench", "memory", "--n", "64", "--d", "8", "--json", str(out),
                 "--kernels", "attention_fwd:naive", "rmsnorm_fwd:dnf"])
    table = capsys.readouterr().out
    assert code == 0
    rows = json.loads(out.read_text())
    assert [(r["kernel"], r["variant"]) for r in rows] == [("attention_fwd", "naive"),
                                                          ("rmsnorm_fwd", "dnf")]
    assert rows[1]["sizes"] == dict(batch=1, n=64, d=8)
    lines = [line.split() for line in table.splitlines()]
    for r in rows:
        assert r["extra_bytes"] == (r["peak_kib"] - r["rss_before_kib"]) * 1024
        assert [r["kernel"], r["variant"]] in [line[:2] for line in lines]


def test_bench_memory_checks_every_name_before_running_any(capsys):
    assert main(["bench", "memory", "--kernels", "attention_fwd:dnf", "attention_fwd:tiled"]) == 2
    err = capsys.readouterr().err
    assert "no variant 'tiled'" in err and "measuring" not in err


def test_a_kernel_with_a_bool_mask_is_measured():
    """Its mask made of the mask's element type (bool), not the kernel's float."""
    sizes = dict(batch=1, kv_heads=2, group=2, n_q=64, n=256, d=16)
    record = memory.measure("attention_cross_fwd_bool2d", "flash", sizes)
    assert record.peak_kib > 0 and record.seconds > 0
