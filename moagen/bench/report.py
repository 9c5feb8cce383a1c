"""`moagen report RESULTS`: a markdown summary and plots of one run of a JSON-lines results
file (the latest by default): time against n per variant and language, thread scaling,
and a roofline under this machine's measured roofs (triad bandwidth, GEMM peak; on a GPU
also the device's copy bandwidth, the memory roof of the kernels measured there)."""
import json
from collections import defaultdict
from pathlib import Path

from moagen.bench import calls
from moagen.bench.machine import summary as machine_summary
from moagen.errors import MoagenError


def load(path, run=None):
    """The run record and the records of one run (the latest one when run is None)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise MoagenError(f"cannot read results {path}: {error.strerror}") from error
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as error:
        raise MoagenError(f"{path} is not a JSON-lines results file: {error}") from error
    runs = [r for r in records if r.get("record") == "run"]
    if not runs:
        raise MoagenError(f"{path} holds no benchmark run")
    head = runs[-1] if run is None else next((r for r in runs if r["run"] == run), None)
    if head is None:
        raise MoagenError(f"{path} holds no run {run!r}; runs: {', '.join(r['run'] for r in runs)}")
    return head, [r for r in records if r.get("run") == head["run"] and r is not head]


def _key(r):
    return r["kernel"], r["dtype"], json.dumps(r["sizes"], sort_keys=True), r["threads"], \
        json.dumps(r["setting"], sort_keys=True)


def with_ratios(results):
    """Each result with baseline time / its time for every baseline measured next to it
    (above 1: ours is faster)."""
    base = {(_key(r), r["lang"]): r["median_s"] for r in results if r["lang"] in calls.BASELINES}
    return [dict(r, ratios={b: base[(_key(r), b)] / r["median_s"]
                            for b in calls.BASELINES if (_key(r), b) in base})
            for r in results]


def _impl(r):
    if r["lang"] in calls.BASELINES:
        return r["lang"]
    params = " ".join(f"{k}={v}" for k, v in r.get("params", {}).items())
    chosen = f" ({params}{', tuned' if r.get('tuned') else ''})" if params else ""
    return f"{r['variant']} {r['lang']}{chosen}"


def gemm_share(result, roofs):
    """The result's GFLOP/s as a percentage of the GEMM in its dtype measured by the run's
    roof at its thread count, or None (no roof, no flop count, a result run on a device, or a
    roof of an older run that measured float64 only)."""
    return _share(result, roofs, "gemm_gflops_by_dtype")


def peak_share(result, roofs):
    """The same over the cores' multiply-add peak in its dtype (None where the roof has
    none: runs before it was measured)."""
    return _share(result, roofs, "peak_gflops_by_dtype")


def _share(result, roofs, measured):
    rate = next((r.get(measured, {}).get(result["dtype"]) for r in roofs
                 if r["threads"] == result["threads"]), None)
    return 100 * result["gflops"] / rate if rate and result.get("gflops") is not None else None


def table(results, device_gbs=None, roofs=()) -> str:
    """device_gbs: the copy bandwidth of the device the results ran on, None on the host;
    roofs: the host's, for % GEMM."""
    ratios = [f"{b}/this" for b in calls.BASELINES]
    roof = "% copy" if device_gbs else "% triad"
    lines = ["| " + " | ".join(["kernel", "impl", "n", "threads", "median ms", "IQR %", "GFLOP/s",
                                "% GEMM", "% peak", "GB/s", roof] + ratios) + " |",
             "| --- " * (11 + len(ratios)) + "|"]
    fmt = lambda x, f: "-" if x is None else format(x, f)
    for r in with_ratios(results):
        spread = 100 * (r["q3_s"] - r["q1_s"]) / r["median_s"]
        # on a device: the bytes the call must move, against the copy's (moagen.bench.rates)
        moved = r.get("min_gbs") if device_gbs else r.get("gbs")
        bandwidth = device_gbs or r.get("triad_gbs_alongside")
        share = 100 * moved / bandwidth if bandwidth and moved is not None else None
        lines.append(f"| {r['kernel']} | {_impl(r)} | {r['sizes']['n']} | {r['threads']} | "
                     f"{r['median_s'] * 1e3:.3f} | {spread:.0f} | {fmt(r.get('gflops'), '.2f')} | "
                     f"{fmt(gemm_share(r, roofs), '.0f')} | {fmt(peak_share(r, roofs), '.0f')} | "
                     f"{fmt(r.get('gbs'), '.2f')} | {fmt(share, '.0f')} | " +
                     " | ".join(fmt(r["ratios"].get(b), ".2f") for b in calls.BASELINES) + " |")
    return "\n".join(lines)


def baselines(results) -> str:
    """Per kernel, what each baseline measured computes (and leaves out), and how long its
    first call took where that call compiled (torch.compile)."""
    what, compiling = {}, defaultdict(list)
    for r in results:
        if r["lang"] in calls.BASELINES:
            key = r["kernel"], r["lang"]
            what[key] = r.get("computes") or calls.computes(*key)
            if r.get("compile_s") is not None:
                compiling[key].append(f"{r['compile_s']:.1f} s at n {r['sizes']['n']}")
    return "\n".join(f"- {kernel}, {lang}: {text}" +
                     (f" (first call, compiling: {', '.join(compiling[kernel, lang])})"
                      if compiling[kernel, lang] else "")
                     for (kernel, lang), text in what.items())


def default_report_dir(path) -> Path:
    """results.jsonl -> results/; a results file named without a suffix, results ->
    results-report/ (its own name is taken)."""
    path = Path(path)
    return path.with_suffix("") if path.suffix else path.with_name(path.name + "-report")


def write(path, run=None, out_dir=None) -> Path:
    """The summary (markdown) and plots of one run; returns the summary's path."""
    head, records = load(path, run)
    out_dir = Path(out_dir or default_report_dir(path))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MoagenError(f"cannot write the report to {out_dir}: {error.strerror}") from error
    results = [r for r in records if r["record"] == "result"]
    roofs = [r for r in records if r["record"] == "roof"]
    device_roofs = [r for r in records if r["record"] == "device_roof"]
    device_gbs = max((r["copy_gbs"] for r in device_roofs), default=None)
    figures = _plots(results, roofs, out_dir)
    text = [f"# Benchmark run {head['run']}", "", f"Machine: {machine_summary(head['machine'])}",
            "", f"Command: `{' '.join(head['command'])}`", "", "## Measured roofs", ""]
    text += [f"- {r['threads']} thread(s): STREAM triad {r['triad_gbs']:.1f} GB/s, GEMM "
             + _by_dtype(r.get("gemm_gflops_by_dtype", {"float64": r["gemm_gflops"]}))
             + (f", multiply-add peak {_by_dtype(r['peak_gflops_by_dtype'])}"
                if "peak_gflops_by_dtype" in r else "") + " GFLOP/s" for r in roofs]
    text += [f"- {r['device']}: copy {r['copy_gbs']:.1f} GB/s (bytes read and written, "
             f"{r['copy_bytes'] >> 20} MiB copied within the device)" for r in device_roofs]
    text += ["", "## Results", "", "Median of the repeats after warm-up; IQR: interquartile range "
             "over the median; % triad: GB/s over the bandwidth of a STREAM triad timed in the same "
             "rounds as the kernel (a bandwidth-bound kernel's share of the memory roof); % GEMM: "
             "GFLOP/s over the roof's GEMM in the kernel's dtype (host kernels; a register-tiled "
             "kernel may pass a library's GEMM); % peak: the same over the cores' multiply-add "
             "peak (a compute-bound kernel's share of the flop roof); % copy, "
             "for kernels run on a GPU (timed by CUDA events, their arrays on the GPU): the "
             "bytes the call must move (each element read or written once) per second, over "
             "the device's copy bandwidth; "
             "numpy/this, torch/this and compiled/this: the baseline's time over ours on the same "
             "inputs, measured in a process of their own (on a GPU in the same rounds; above 1: ours "
             "is faster).", "",
             table(results, device_gbs, [] if device_gbs else roofs), ""]
    listed = baselines(results)
    text += ["## What each baseline computes", "", listed, ""] if listed else []
    text += [f"![{f.stem}]({f.name})" for f in figures]
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(text) + "\n")
    return summary


def _by_dtype(gflops):
    return ", ".join(f"{dtype} {rate:.1f}" for dtype, rate in gflops.items())


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def save(fig, path):
    """Write a figure and free it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path


def _plots(results, roofs, out_dir):
    plt = pyplot()
    figures = []
    top = max((r["threads"] for r in results), default=1)
    by_kernel = defaultdict(list)
    for r in results:
        by_kernel[r["kernel"]].append(r)
    for kernel, rows in by_kernel.items():
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        series = defaultdict(list)
        for r in rows:
            if r["threads"] == top:
                series[_impl(r)].append((r["sizes"]["n"], r["median_s"]))
        for name, points in sorted(series.items()):
            left.plot(*zip(*sorted(points)), marker="o", label=name)
        left.set_xscale("log", base=2)
        left.set(yscale="log", xlabel="n", ylabel="seconds",
                 title=f"{kernel}: time vs n ({top} threads)")
        left.legend(fontsize=7)
        largest = max(r["sizes"]["n"] for r in rows)
        scaling = defaultdict(list)
        for r in rows:
            if r["sizes"]["n"] == largest:
                scaling[_impl(r)].append((r["threads"], r["median_s"]))
        for name, points in sorted(scaling.items()):
            points = sorted(points)
            right.plot([t for t, _ in points], [points[0][1] / s for _, s in points], marker="o", label=name)
        right.set(xlabel="threads", ylabel="speed-up over 1 thread",
                  title=f"{kernel}: thread scaling at n={largest}")
        right.legend(fontsize=7)
        figures.append(save(fig, out_dir / f"{kernel}.png"))
    if roofs:
        figures.append(_roofline(results, roofs, out_dir, plt))
    return figures


def _roofline(results, roofs, out_dir, plt):
    """Roofs min(flops, bandwidth x intensity) per thread count, the flops a GEMM's and the
    cores' multiply-add peak in the results' dtype (a run has one); a point per result (at
    the most threads) whose F and M the cost model predicts, coloured by kernel."""
    import numpy as np

    top = max(r["threads"] for r in results) if results else 1
    dtype = results[0]["dtype"] if results else "float64"
    points = [r for r in results if r.get("flops") and r.get("bytes") and r["threads"] == top]
    spots = [r["flops"] / r["bytes"] for r in points] or [1.0]
    intensity = np.logspace(np.log10(min(spots)) - 1, np.log10(max(spots)) + 1, 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    for roof in roofs:
        gemm = roof.get("gemm_gflops_by_dtype", {}).get(dtype, roof["gemm_gflops"])
        ax.plot(intensity, np.minimum(gemm, roof["triad_gbs"] * intensity),
                label=f"roof (GEMM), {roof['threads']} thread(s)")
        peak = roof.get("peak_gflops_by_dtype", {}).get(dtype)
        if peak:
            ax.plot(intensity, np.minimum(peak, roof["triad_gbs"] * intensity), "--",
                    label=f"roof (multiply-add peak), {roof['threads']} thread(s)")
    by_kernel = defaultdict(list)
    for r in points:
        by_kernel[r["kernel"]].append((r["flops"] / r["bytes"], r["gflops"]))
    for kernel, xy in sorted(by_kernel.items()):
        ax.scatter(*zip(*xy), s=14, label=kernel)
    ax.set(xscale="log", yscale="log", xlabel="flops per byte (F / M)", ylabel="GFLOP/s",
           title=f"roofline, {dtype}, {top} thread(s)"
           + ("" if points else " (no F and M: roofs only)"))
    ax.legend(fontsize=7)
    return save(fig, out_dir / "roofline.png")
