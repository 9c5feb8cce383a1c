"""The bench on a device (CUDA): kernels and the torch baseline on the device's arrays,
every call timed by the device's clock, the device's copy bandwidth as its roof. Run here
through the emulation (--dry-run lets an emulated target through: its times mean nothing),
so that the path bench/gpu.sh takes on a GPU has run before a GPU is at hand. No test
asserts a time."""
import json

import numpy as np
import pytest

from moagen.bench import calls, report, suite, sweep
from moagen.bench.worker import run as run_worker
from moagen.targets.cuda.arrays import DeviceArray
from moagen.targets.cuda.emulated import DEVICE
from moagen.errors import MoagenError


def test_a_device_sweep_times_kernels_and_torch_in_the_same_rounds():
    roof, timed = suite.plan(["attention_decode:split"], ["cuda-emulated"], [2], lengths=[8, 16],
                             dry_run=True)
    assert roof.device == timed.device == "cuda-emulated"
    assert [[impl[0] for impl in g["impls"]] for g in timed.groups] == \
        [["cuda-emulated", "torch"]] * 2
    assert not timed.triad_in_rounds and (timed.warmup, timed.repeats) == (0, 1)
    assert roof.measurements == 2  # the host's roofs and the device's copy


def test_a_device_sweep_refuses_what_cannot_run_there():
    with pytest.raises(MoagenError, match="numpy baseline runs on the host only"):
        suite.plan(["rmsnorm_fwd:dnf"], ["cuda-emulated"], [1], lengths=[8], dry_run=True,
                   baselines=("numpy", "torch"))
    with pytest.raises(MoagenError, match="cuda-emulated run on a device and c on the host"):
        suite.plan(["rmsnorm_fwd:dnf"], ["cuda-emulated", "c"], [1], lengths=[8], dry_run=True)
    with pytest.raises(MoagenError, match="is for verification"):  # no dry run: not measured
        suite.plan(["rmsnorm_fwd:dnf"], ["cuda-emulated"], [1], lengths=[8])


def test_the_worker_times_device_arrays_by_the_device_clock(capsys, monkeypatch):
    clocked, made = [], []
    elapsed = DEVICE.elapsed
    monkeypatch.setattr(DEVICE, "elapsed", lambda fn: clocked.append(fn) or elapsed(fn))
    monkeypatch.setattr(calls, "outputs", _spy(calls.outputs, made))
    sizes = dict(batch=1, q_heads=2, kv_heads=1, cap=9, d=4, n=7)
    run_worker(dict(groups=[dict(kernel="attention_decode", dtype="float64", sizes=sizes,
                                 impls=[["cuda-emulated", "split"], ["torch", None]])],
                    warmup=1, repeats=2, roof=True, quick=True, device="cuda-emulated"))
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["record"] for r in records] == ["roof", "device_roof", "result", "result"]
    assert records[1]["device"] == DEVICE.name and records[1]["copy_gbs"] > 0
    assert [r["lang"] for r in records[2:]] == ["cuda-emulated", "torch"]
    assert records[2]["params"] == {"heads": 1}  # the GPU's defaults, not the CPU's 4
    # warm-up and repeats of both calls, and the roof's copies, all on the device's clock
    assert len(clocked) >= 2 * (1 + 2)
    outs = made[0]  # our kernel's outputs: in the device's memory
    assert all(isinstance(o, DeviceArray) and o.device is DEVICE for o in outs)
    assert all(np.isfinite(o.get()).all() for o in outs)


def _spy(function, seen):
    def spied(*args, **kwargs):
        value = function(*args, **kwargs)
        if value is not None:
            seen.append(value)
        return value
    return spied


@pytest.mark.parametrize("name, report_dir", [("r.jsonl", "r"), ("r", "r-report")])
def test_the_report_relates_device_results_to_the_copy_bandwidth(tmp_path, name, report_dir):
    """(And writes itself beside the results, named after them.)"""
    out = tmp_path / name
    results = sweep.Results(out, ["test"])
    group = dict(kernel="attention_decode", dtype="float64", sizes=dict(n=8), threads=1,
                 setting={}, repeats=1, warmup=0, q1_s=1.0, q3_s=1.0, min_s=1.0)
    results.append(dict(record="device_roof", device="GPU", copy_gbs=100.0, copy_bytes=1 << 30))
    results.append(dict(group, record="result", variant="split", lang="cuda", median_s=1.0,
                        gbs=280.0, min_gbs=70.0))
    results.append(dict(group, record="result", variant=None, lang="torch", median_s=2.0))
    summary = report.write(out)
    assert summary.parent == tmp_path / report_dir
    text = summary.read_text()
    assert "- GPU: copy 100.0 GB/s" in text and "% copy" in text
    row = next(line for line in text.splitlines() if "| split cuda |" in line).split(" | ")
    assert row[10] == "70" and row[12] == "2.00"  # 70 of 100 GB/s; torch took twice as long
    assert row[7] == row[8] == "-"  # % GEMM, % peak: a host roof's, not a GPU's
