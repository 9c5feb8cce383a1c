"""Paper V, result 2: deployment is part of the ONF. The decode kernel over thread counts
from 1 to 4x the cores (oversubscription), with and without OMP_PROC_BIND / OMP_PLACES,
inputs first touched serially or by the OpenMP threads, and one call (one parallel region
per nest) or one call per batch entry (a region per entry) per decode step. Each setting
runs in a process of its own (OpenMP reads its environment once). The penalty of a setting
is its time over the best setting's."""
import os
import sys
from itertools import product

from moagen.bench import calls, sweep
from moagen.bench.machine import summary as machine_summary, topology as machine_topology
from moagen.bench.suite import thread_counts

KERNEL, VARIANTS = "attention_decode", ("online", "split")
PLACEMENTS = ((None, None), ("close", "cores"), ("spread", "cores"))
BATCH = 4  # several sequences, so that a call per sequence means several regions


def settings(max_threads):
    return [sweep.Setting(t, bind, places, touch, calls)
            for t, (bind, places), touch, calls in product(
                thread_counts(max_threads), PLACEMENTS, ("serial", "parallel"), ("one", "per-batch"))]


def plan(ns, max_threads, repeats):
    groups = [dict(kernel=KERNEL, dtype="float64", sizes=dict(calls.sizes(KERNEL, n), batch=BATCH),
                   impls=[["c", v] for v in VARIANTS]) for n in ns]
    return [sweep.Job(s, groups, repeats=repeats) for s in settings(max_threads)]


def penalties(records):
    """{(variant, n): [(penalty, setting label, seconds), ...] best first}."""
    by = {}
    for r in records:
        if r["record"] == "result":
            label = sweep.Setting(**r["setting"]).label()
            by.setdefault((r["variant"], r["sizes"]["n"]), []).append((r["median_s"], label))
    return {key: sorted((t / min(t for t, _ in rows), label, t) for t, label in rows)
            for key, rows in by.items()}


def recommend(topo) -> str:
    """A deployment for this machine from its topology."""
    numa = len(topo["numa_nodes"])
    bind = "spread" if numa > 1 else "close"
    lines = [f"OMP_NUM_THREADS={topo['cores']} (one thread per physical core)",
             f"OMP_PLACES=cores OMP_PROC_BIND={bind}"]
    if numa > 1:
        lines.append(f"{numa} NUMA nodes: first-touch every input in parallel with the same "
                     "static schedule as the kernel, so each thread's pages are local")
    lines.append("one parallel region per call, no allocation inside the call (scratch from the caller)")
    return "\n".join(lines)


def format_table(table) -> str:
    """Per kernel variant and n: for each thread count, the best and the worst setting's
    penalty (binding, first touch and calls per step make the spread within a count)."""
    lines = []
    for (variant, n), rows in sorted(table.items()):
        lines.append(f"{KERNEL} {variant}, n={n}, batch={BATCH}: best {rows[0][2] * 1e3:.3f} ms "
                     f"with {rows[0][1]}")
        by_threads = {}
        for penalty, label, _ in rows:  # best first
            by_threads.setdefault(int(label.split()[0][2:]), []).append((penalty, label))
        for threads, mine in sorted(by_threads.items()):
            (best, _), (worst, worst_label) = mine[0], mine[-1]
            lines.append(f"  {threads:>4} threads: penalty {best:6.2f} best, {worst:6.2f} worst "
                         f"({worst_label.split(' ', 1)[1]})")
    return "\n".join(lines)


def figure(records, path):
    from moagen.bench.report import pyplot, save
    plt = pyplot()
    table = penalties(records)
    (variant, n) = max(table, key=lambda k: (k[1], k[0]))
    series = {}
    for r in records:
        if r["record"] == "result" and r["variant"] == variant and r["sizes"]["n"] == n:
            s = r["setting"]
            name = f"bind={s['bind'] or '-'} touch={s['touch']} calls={s['calls']}"
            series.setdefault(name, []).append((s["threads"], r["median_s"]))
    best = min(t for points in series.values() for _, t in points)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in sorted(series.items()):
        points = sorted(points)
        ax.plot([t for t, _ in points], [s / best for _, s in points], marker="o", label=name)
    ax.axvline(os.cpu_count(), color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="OpenMP threads (line: the cores)",
           ylabel="time / best", title=f"{KERNEL} {variant}, n={n}")
    ax.legend(fontsize=6)
    return save(fig, path)


def main(args):
    max_threads = args.max_threads or 4 * os.cpu_count()
    results = sweep.Results(args.out, ["moagen", *sys.argv[1:]])
    records = sweep.run(plan(args.n, max_threads, args.repeats), results)
    topo = machine_topology()
    print(f"machine: {machine_summary(results.machine)}")
    print(f"topology: {topo['sockets']} socket(s), {topo['cores']} cores, "
          f"{len(topo['numa_nodes'])} NUMA node(s), caches "
          + ", ".join(f"L{c['level']}{c['type'][0]} {c['size']}" for c in topo["caches"]))
    print(format_table(penalties(records)))
    print("recommended deployment:\n  " + recommend(topo).replace("\n", "\n  "))
    print(f"figure: {figure(records, args.out.with_suffix('.png'))}")
