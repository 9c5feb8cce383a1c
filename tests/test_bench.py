"""The benchmark harness: what it measures, records and refuses. No test asserts a time;
these check the records' contents, the arithmetic on them and the error paths."""
import json

import numpy as np
import pytest

from moagen.bench import atomics, calls, languages, machine, report, slurm, suite, sweep, topology
from moagen.bench.timing import ratio_rounds, time_calls
from moagen.bench.worker import _call
from moagen.cli import main
from moagen.emit import emit
from moagen.errors import DeviceUnavailable, MoagenError

QUICK = ["bench", "--quick", "--kernels", "rmsnorm_fwd", "--lang", "c", "--n", "64", "--threads", "1",
         "--untuned"]  # a tuning file of this machine must not change what runs


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.jsonl"
    code = main(QUICK + ["--out", str(out)])
    return code, out


def test_quick_sweep_records_kernels_baselines_roof_and_machine(quick_run):
    code, out = quick_run
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["record"] == "run" and records[0]["machine"]["cores"] >= 1
    assert {"c", "fortran"} <= set(records[0]["machine"]["toolchain"])
    results = [r for r in records if r["record"] == "result"]
    assert sorted((r["lang"], r["variant"]) for r in results) == [
        ("c", "dnf"), ("c", "naive"), ("numpy", None), ("torch", None)]
    assert all(r["run"] == records[0]["run"] and r["threads"] == 1 for r in records[1:])
    for r in results:
        assert 0 < r["min_s"] <= r["q1_s"] <= r["median_s"] <= r["q3_s"]
    ours = next(r for r in results if r["variant"] == "dnf")
    # F and M from the cost model: x*x, the sum, the scale per element; x read, z written
    assert ours["flops"] >= 3 * 64 * 1024 and ours["bytes"] >= 2 * 64 * 1024 * 8
    assert ours["gflops"] == pytest.approx(ours["flops"] / ours["median_s"] / 1e9)
    roof = next(r for r in records if r["record"] == "roof")
    assert roof["triad_gbs"] > 0 and roof["gemm_gflops"] > 0
    assert roof["gemm_gflops_by_dtype"]["float64"] == roof["gemm_gflops"]
    assert roof["gemm_gflops_by_dtype"]["float32"] > 0
    assert all(roof["peak_gflops_by_dtype"][dtype] > 0 for dtype in ("float64", "float32"))
    # a triad in the same rounds as our kernels, recorded with each of them, not the baselines
    alongside = [r.get("triad_gbs_alongside") for r in results]
    assert [bool(a) for a in alongside] == [r["variant"] is not None for r in results]
    assert len({a for a in alongside if a}) == 1 and alongside[0] > 0


def test_summary_has_ratios_and_plots(quick_run):
    _, out = quick_run
    folder = out.with_suffix("")
    text = (folder / "summary.md").read_text()
    assert "numpy/this" in text and "| rmsnorm_fwd | dnf c (rows=1) | 64 | 1 |" in text
    # what each baseline computes, from the kernel's declaration
    assert "- rmsnorm_fwd, torch: z and inv_rms" in text and "- rmsnorm_fwd, numpy: every" in text
    dnf = next(line.split(" | ") for line in text.splitlines() if "| dnf c" in line)
    header = next(line.split(" | ") for line in text.splitlines() if line.startswith("| kernel"))
    record = next(json.loads(line) for line in out.read_text().splitlines()
                  if '"variant": "dnf"' in line)
    share = 100 * record["gbs"] / record["triad_gbs_alongside"]
    assert dnf[header.index("% triad")] == f"{share:.0f}"
    roof = next(json.loads(line) for line in out.read_text().splitlines()
                if '"record": "roof"' in line)
    gemm_share = 100 * record["gflops"] / roof["gemm_gflops_by_dtype"]["float64"]
    assert dnf[header.index("% GEMM")] == f"{gemm_share:.0f}"
    peak_share = 100 * record["gflops"] / roof["peak_gflops_by_dtype"]["float64"]
    assert dnf[header.index("% peak")] == f"{peak_share:.0f}"
    assert (folder / "rmsnorm_fwd.png").stat().st_size > 0 and (folder / "roofline.png").exists()


def test_ratios_pair_each_result_with_baselines_of_its_own_setting():
    setting = dict(threads=2)
    base = dict(record="result", kernel="k", dtype="float64", sizes={"n": 8}, threads=2,
                setting=setting)
    rows = report.with_ratios([dict(base, lang="c", variant="v", median_s=2.0),
                               dict(base, lang="numpy", variant=None, median_s=6.0),
                               dict(base, lang="torch", variant=None, median_s=1.0),
                               dict(base, lang="compiled", variant=None, median_s=4.0),
                               dict(base, lang="c", variant="v", median_s=3.0, threads=1)])
    assert rows[0]["ratios"] == {"numpy": 3.0, "torch": 0.5, "compiled": 2.0}
    assert rows[4]["ratios"] == {}  # no baseline measured at 1 thread


def test_gemm_share_takes_the_roof_of_the_results_dtype_and_threads():
    roofs = [dict(threads=1, gemm_gflops_by_dtype={"float64": 10.0, "float32": 20.0}),
             dict(threads=2, gemm_gflops_by_dtype={"float64": 40.0, "float32": 80.0})]
    result = dict(dtype="float32", threads=2, gflops=60.0)
    assert report.gemm_share(result, roofs) == 75.0
    assert report.gemm_share(dict(result, threads=4), roofs) is None  # no roof at 4 threads
    assert report.gemm_share(dict(result, gflops=None), roofs) is None  # no flop count


def test_peak_share_is_over_the_multiply_add_peak_of_the_results_dtype():
    roofs = [dict(threads=2, gemm_gflops_by_dtype={"float32": 80.0},
                  peak_gflops_by_dtype={"float64": 100.0, "float32": 200.0})]
    result = dict(dtype="float32", threads=2, gflops=150.0)
    assert report.peak_share(result, roofs) == 75.0
    assert report.gemm_share(result, roofs) == 187.5  # a register-tiled kernel may pass a GEMM
    assert report.peak_share(result, [dict(threads=2, gemm_gflops_by_dtype={})]) is None


def test_time_calls_round_robin_after_warmup():
    order = []
    stats = time_calls([lambda: order.append("a"), lambda: order.append("b")], warmup=2, repeats=3,
                       batch_s=0)
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert [s["repeats"] for s in stats] == [3, 3]


def test_short_calls_are_timed_in_batches():
    seconds = {"short": 1e-5, "long": 2e-3}
    counts = dict.fromkeys(seconds, 0)

    def clock(fn):  # a clock that reads the calls' counts: no sleeping, no timing noise
        before = sum(counts.values())
        fn()
        return seconds["short"] * (sum(counts.values()) - before) if fn.__name__ == "batch" \
            else seconds[fn.__name__]

    def call(name):
        def fn():
            counts[name] += 1
        fn.__name__ = name
        return fn
    stats = time_calls([call("short"), call("long")], warmup=1, repeats=3, clock=clock)
    assert [s["calls_per_sample"] for s in stats] == [100, 1]  # 1 ms of 10 us calls
    # warm-up, probe, then each sample after an untimed call
    assert counts == {"short": 1 + 1 + 3 * (1 + 100), "long": 1 + 1 + 3 * (1 + 1)}
    assert stats[0]["median_s"] == pytest.approx(1e-5)


def test_bad_input_messages(capsys):
    for argv, message in ((["--kernels", "attention_nope"], "attention_nope"),
                          (["--lang", "cobol"], "unknown language 'cobol'"),
                          (["--out", "/proc/no/such/results.jsonl"], "cannot write results")):
        assert main(["bench", "--quick", "--untuned", "--threads", "1"] + argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("moagen: error: ") and message in err


def test_an_emulation_is_not_measured(capsys):
    with pytest.raises(MoagenError, match="cuda-emulated is for verification"):
        calls.check_impl("cuda-emulated")
    assert main(["bench", "--kernels", "rmsnorm_apply", "--lang", "cuda-emulated", "--n", "8"]) == 2
    assert "measure cuda there" in capsys.readouterr().err


def test_gpu_requested_where_none_exists(capsys):
    from moagen.targets.cuda import loader as cuda
    if cuda.available():
        pytest.skip("a GPU is here")
    with pytest.raises(DeviceUnavailable):
        calls.check_impl("cuda")
    assert main(["bench", "atomics", "--lang", "cuda", "--n", "8"]) == 2
    assert "no GPU" in capsys.readouterr().err


def test_a_failing_worker_keeps_what_was_measured(tmp_path):
    good = dict(kernel="rmsnorm_fwd", dtype="float64", sizes=calls.sizes("rmsnorm_fwd", 8),
                impls=[["c", "dnf"]])
    # a cache with 4 valid rows out of 2: the kernel's own validation refuses it
    bad = dict(kernel="attention_decode", dtype="float64",
               sizes=dict(batch=1, q_heads=2, kv_heads=1, cap=2, d=4, n=4), impls=[["c", "online"]])
    results = sweep.Results(tmp_path / "r.jsonl", ["test"])
    with pytest.raises(MoagenError, match="worker failed"):
        sweep.run([sweep.Job(sweep.Setting(1), [good, bad], warmup=0, repeats=1)], results)
    kept = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["record"] for r in kept] == ["run", "result"] and kept[1]["kernel"] == "rmsnorm_fwd"


def test_the_cost_model_runs_before_the_worker_times(tmp_path, monkeypatch):
    """Seconds of sympy in this process while the worker times calls take a core from them:
    every variant's cost is computed before the worker starts, none while it runs."""
    from moagen.cost.model import _predict
    _predict.cache_clear()
    computed_at_start, real_popen = [], sweep.subprocess.Popen

    def popen(command, *args, **kwargs):
        if "moagen.bench.worker" in command:
            computed_at_start.append(_predict.cache_info().misses)
        return real_popen(command, *args, **kwargs)
    monkeypatch.setattr(sweep.subprocess, "Popen", popen)
    groups = [dict(kernel=kernel, dtype="float64", sizes=calls.sizes(kernel, 8),
                   impls=[["c", "dnf", None], ["numpy", None]])
              for kernel in ("rmsnorm_fwd", "rmsnorm_bwd")]
    records = sweep.run([sweep.Job(sweep.Setting(1), groups, warmup=0, repeats=1)],
                        sweep.Results(tmp_path / "r.jsonl", ["test"]))
    assert computed_at_start == [2] == [_predict.cache_info().misses]
    assert all(r["gflops"] > 0 for r in records if r["variant"])


def test_a_call_per_batch_entry_computes_the_same():
    sizes = dict(batch=3, q_heads=4, kv_heads=2, cap=9, d=5, n=7)
    fn = calls.kernel_callable("attention_decode", "split", "c", "float64")
    args, scalars = calls.inputs("attention_decode", sizes, "float64"), calls.scalars("attention_decode", sizes)
    whole, parts = calls.outputs(fn, sizes), calls.outputs(fn, sizes)
    _call(fn, args, whole, scalars, "one")()
    _call(fn, args, parts, scalars, "per-batch")()
    for a, b in zip(whole, parts):
        np.testing.assert_array_equal(a, b)


def test_c_without_restrict_computes_the_same():
    source = emit("attention_fwd", "dnf", "c-norestrict")
    assert "restrict" not in source.split("*/", 1)[1]  # past the banner
    sizes = dict(batch=1, heads=2, n=9, d=5)
    args, scalars = calls.inputs("attention_fwd", sizes, "float64"), calls.scalars("attention_fwd", sizes)
    plain = calls.kernel_callable("attention_fwd", "dnf", "c-norestrict", "float64")(*args, **scalars)
    ref = calls.kernel_callable("attention_fwd", None, "numpy", "float64")(*args, **scalars)
    for ours, theirs in zip(plain, ref):
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


def test_atomic_counts_are_read_off_the_onf():
    sizes = dict(batch=2, heads=1, n=2048, d=64)  # paper V's B=2, N=2048, D=64
    assert atomics.atomic_count("attention_fwdbwd", "atomic", sizes) == 1_073_741_824
    assert atomics.atomic_count("attention_bwd", "atomic", sizes) == 536_870_912
    assert atomics.atomic_count("attention_fwdbwd", "owner", sizes) == 0


def test_atomic_counts_on_cuda_are_its_onf_s():
    """On CUDA each block adds its share of dK and dV once (BlockPartials): fewer atomic
    updates than a CPU's, the fused kernel still twice the separate backward's."""
    sizes = dict(batch=2, heads=1, n=2048, d=64)
    fused, separate = (atomics.atomic_count(k, "atomic", sizes, "cuda")
                       for k in ("attention_fwdbwd", "attention_bwd"))
    assert fused == 2 * separate
    assert 0 < separate < atomics.atomic_count("attention_bwd", "atomic", sizes)


def test_atomics_table_from_records():
    def rec(kernel, variant, t):
        return dict(record="result", kernel=kernel, variant=variant, lang="c", sizes=dict(n=64),
                    median_s=t)
    table = atomics.rows([rec("attention_fwdbwd", "atomic", 4.0), rec("attention_fwdbwd", "owner", 1.0),
                          rec("attention_fwd", "dnf", 1.0), rec("attention_bwd", "atomic", 1.0)])
    assert table[0]["separate_s"] == 2.0
    assert table[0]["atomic_updates"] == 2 * table[0]["separate_updates"] > 0
    assert "2.00" in atomics.format_table(table)


def test_atomics_separate_forward_on_cuda_is_the_fused_kernels_flash_forward():
    """On CUDA the fused kernels' forward pass is the flash forward's block tiles; the
    separate forward is that kernel there, so that the ratios compare the backwards."""
    def rec(kernel, variant, lang, t):
        return dict(record="result", kernel=kernel, variant=variant, lang=lang, sizes=dict(n=64),
                    median_s=t)
    records = [rec("attention_fwdbwd", "atomic", "cuda", 4.0),
               rec("attention_fwdbwd", "owner", "cuda", 1.0),
               rec("attention_fwd", "dnf", "cuda", 100.0),
               rec("attention_fwd", "flash", "cuda", 1.0),
               rec("attention_bwd", "atomic", "cuda", 1.0)]
    (row,) = atomics.rows(records)
    assert row["separate_s"] == 2.0
    assert row["atomic_updates"] == atomics.atomic_count(
        "attention_fwdbwd", "atomic", calls.sizes("attention_fwdbwd", 64), "cuda")
    assert [k for job in atomics.plan([64], ["cuda-emulated"], 1, dry_run=True)
            for g in job.groups for k in g["impls"]] == \
        [["cuda-emulated", "atomic"], ["cuda-emulated", "owner"], ["cuda-emulated", "flash"],
         ["cuda-emulated", "atomic"]]


def test_parse_callgrind():
    text = "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nfn=x\n0 1\nsummary: 10 4 2 0 3 1 0 1 0\n"
    assert languages.parse_callgrind(text) == dict(Ir=10, Dr=4, Dw=2, D1mr=3, D1mw=1, DLmr=1, DLmw=0)


def test_topology_settings_and_penalties():
    settings = topology.settings(8)
    assert {s.threads for s in settings} == {1, 2, 4, 8}
    assert len(settings) == 4 * len(topology.PLACEMENTS) * 2 * 2
    env = sweep.Setting(4, "spread", "cores").env()
    assert env["OMP_NUM_THREADS"] == "4" and env["OMP_PROC_BIND"] == "spread"
    assert "OMP_PLACES" not in sweep.Setting(4).env()
    recs = [dict(record="result", variant="online", sizes=dict(n=8), median_s=t,
                 setting=sweep.Setting(k).__dict__) for k, t in ((1, 3.0), (2, 1.5))]
    (penalty, label, _), (worst, _, _) = topology.penalties(recs)[("online", 8)]
    assert (penalty, worst) == (1.0, 2.0) and label.startswith("t=2 ")
    text = topology.format_table(topology.penalties(recs))
    assert "1 threads: penalty   2.00 best" in text and "2 threads: penalty   1.00 best" in text


def test_slurm_script_places_threads_on_numa_machines(tmp_path):
    text = slurm.script(cores=128, numa_nodes=8, partition="cpu")
    assert "#SBATCH --cpus-per-task=128" in text and "--max-threads 512" in text
    assert "#SBATCH --partition=cpu" in text and "numactl --interleave=all" in text
    assert "numactl --interleave" not in slurm.script(cores=4)
    out = tmp_path / "job.sh"
    assert main(["slurm", "--cores", "4", "-o", str(out)]) == 0 and out.read_text().startswith("#!")


def test_ring_job_verifies_the_kernels_named(tmp_path):
    """--verify narrows the job's verification (the generated header says so); without it
    the job verifies every distributed kernel."""
    out = tmp_path / "ring.sh"
    assert main(["slurm", "--ring", "--cores", "4", "--verify", "ring_attention_bwd",
                 "-o", str(out)]) == 0
    text = out.read_text()
    assert "--ring-n 65536 --verify ring_attention_bwd\n" in text
    assert "moagen.cli verify ring_attention_bwd --ranks --dtype float64" in text
    assert "moagen.cli verify --ranks --dtype float64" in slurm.ring_script(nodes=2, cores=4)
    with pytest.raises(MoagenError, match="--verify: no distributed kernel attention_fwd"):
        slurm.ring_script(nodes=2, cores=4, verify=("attention_fwd",))


def test_machine_topology():
    assert machine.cpus_of("0-3,8") == [0, 1, 2, 3, 8]
    topo = machine.topology()
    assert topo["logical_cpus"] >= topo["cores"] >= 1 and topo["numa_nodes"]
    assert suite.thread_counts(6) == [1, 2, 4, 6]


def test_report_of_a_file_without_runs(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert main(["report", str(path)]) == 2


def test_restrict_ablation_compares_machine_code():
    from moagen.targets.c.build import build_c
    from moagen.emit import emit
    assert languages.restrict_changes_code("rmsnorm_fwd", "dnf") in (False, True)
    # the comparison sees a difference where there is one
    naive, dnf = (languages._disassembly(build_c(emit("rmsnorm_fwd", v, "c"), f"rmsnorm_fwd_{v}"))
                  for v in ("naive", "dnf"))
    assert naive != dnf


def test_the_baselines_that_run_are_chosen():
    """At long lengths numpy's attention takes minutes a call: torch alone, or none; the
    compiled baseline (tens of seconds of compiling) only when asked for."""
    def baselines(names=None):
        jobs = suite.plan(["rmsnorm_fwd:dnf"], ["c"], [1], lengths=[64],
                          **({} if names is None else dict(baselines=names)))
        return [impl[0] for job in jobs for group in job.groups for impl in group["impls"]
                if impl[0] in calls.BASELINES]
    assert baselines() == ["numpy", "torch"]
    assert baselines(calls.BASELINES) == ["numpy", "torch", "compiled"]
    assert baselines(("torch",)) == ["torch"]
    assert baselines(()) == []



def test_ratio_rounds_take_each_ratio_within_a_round():
    """The calls in turn after their warm-ups; under a clock ten times slower each round
    (load from elsewhere) a call twice the baseline's is 2.0, and each call's median is its
    middle round's."""
    calls = []

    def clock(fn):
        fn()
        return {"a": 1.0, "b": 2.0}[calls[-1]] * 10 ** ((len(calls) - 3) // 2)
    seconds, ratios = ratio_rounds([lambda: calls.append("a"), lambda: calls.append("b")],
                                   warmup=1, repeats=5, clock=clock)
    assert calls == ["a", "b"] + ["a", "b"] * 5
    assert ratios == [1.0, 2.0] and seconds == [100.0, 200.0]
