"""Paper V, result 1: atomic contention. The fused forward+backward parallel over query rows
(`attention_fwdbwd` atomic: atomic dK and dV) against the owner split (dK, dV parallel over
key rows, no atomics) and against a separate forward and backward (`attention_fwd`, then
`attention_bwd` atomic, atomic dK only), with the atomic updates each performs, counted
from its ONF. The separate forward is dnf on a CPU and flash on CUDA: there the fused
kernels' forward pass is the flash forward's block tiles, so that the three differ in how
the backward's sums are made, not in how the forward is mapped."""
import os
import sys
from dataclasses import replace

import sympy

from moagen.bench import calls, sweep
from moagen.bench.machine import summary as machine_summary

FUSED = ("attention_fwdbwd", ("atomic", "owner"))


def separate(lang):
    """The separate kernels' (kernel, variant) in the language (cuda, cuda-emulated: flash)."""
    forward = "flash" if lang.startswith("cuda") else "dnf"
    return (("attention_fwd", forward), ("attention_bwd", "atomic"))


def atomic_count(kernel, variant, sizes, lang="c") -> int:
    """The atomic updates of the variant's ONF in the language (on CUDA a block's share of
    dK and dV at a time: BlockPartials) at these sizes."""
    from moagen.pipeline import onf_of
    from moagen.onf.count import atomic_updates
    from moagen.onf.loops import subs_stmts
    from moagen.targets import get_target
    onf = onf_of(kernel, variant, target=get_target(lang).kind, dtype="float64")
    env = {s: sizes[s.name] for s in onf.sizes}
    # the sizes in the loops' bounds first: sums over numbers, not sympy's symbolic sums over
    # the causal and block bounds (10 s a kernel)
    nests = [replace(nest, body=subs_stmts(nest.body, env)) for nest in onf.nests]
    return sum(int(sympy.sympify(c).subs(env)) for c in atomic_updates(nests).values())


def plan(ns, langs, repeats, dry_run=False):
    """A job per language: CUDA's on the GPU's arrays, timed by its clock."""
    jobs = []
    for lang in langs:
        groups = []
        for n in ns:
            groups.append(dict(kernel=FUSED[0], dtype="float64", sizes=calls.sizes(FUSED[0], n),
                               impls=[[lang, v] for v in FUSED[1]]))
            groups += [dict(kernel=k, dtype="float64", sizes=calls.sizes(k, n), impls=[[lang, v]])
                       for k, v in separate(lang)]
        jobs.append(sweep.Job(sweep.Setting(os.cpu_count()), groups, warmup=0 if dry_run else 1,
                              repeats=1 if dry_run else repeats, device=calls.device_of([lang])))
    return jobs


def rows(records):
    """Per language and n: the three times and the three atomic counts."""
    time = {(r["kernel"], r["variant"], r["lang"], r["sizes"]["n"]): r["median_s"] for r in records
            if r["record"] == "result"}
    out = []
    for (kernel, variant, lang, n) in time:
        if kernel != FUSED[0] or variant != "atomic":
            continue
        sizes = calls.sizes(kernel, n)
        separate_s = sum(time[(k, v, lang, n)] for k, v in separate(lang))
        out.append(dict(lang=lang, n=n, atomic_s=time[(kernel, "atomic", lang, n)],
                        owner_s=time[(kernel, "owner", lang, n)], separate_s=separate_s,
                        atomic_updates=atomic_count(kernel, "atomic", sizes, lang),
                        owner_updates=atomic_count(kernel, "owner", sizes, lang),
                        separate_updates=sum(atomic_count(k, v, calls.sizes(k, n), lang)
                                             for k, v in separate(lang))))
    return out


def format_table(table) -> str:
    lines = [f"{'lang':<8} {'n':>6} {'atomic ms':>10} {'owner ms':>10} {'separate ms':>12} "
             f"{'atomic/sep':>10} {'owner/sep':>10} {'atomic/owner':>12} "
             f"{'atomics: fused':>15} {'separate':>12} {'ratio':>6}"]
    for r in table:
        ratio = r["atomic_updates"] / r["separate_updates"] if r["separate_updates"] else float("nan")
        lines.append(f"{r['lang']:<8} {r['n']:>6} {r['atomic_s'] * 1e3:>10.2f} {r['owner_s'] * 1e3:>10.2f} "
                     f"{r['separate_s'] * 1e3:>12.2f} {r['atomic_s'] / r['separate_s']:>10.3f} "
                     f"{r['owner_s'] / r['separate_s']:>10.3f} {r['atomic_s'] / r['owner_s']:>12.2f} "
                     f"{r['atomic_updates']:>15,} {r['separate_updates']:>12,} {ratio:>6.2f}")
    lines.append(f"owner: {table[0]['owner_updates'] if table else 0} atomics; separate = "
                 f"{' + '.join(f'{k} {v}' for k, v in separate('c'))} (CUDA: attention_fwd "
                 f"{separate('cuda')[0][1]}); time ratios are fused/separate "
                 f"(paper V: 0.920 atomic, 0.401 owner on an H200)")
    return "\n".join(lines)


def figure(table, path):
    from moagen.bench.report import pyplot, save
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for lang in sorted({r["lang"] for r in table}):
        mine = sorted((r for r in table if r["lang"] == lang), key=lambda r: r["n"])
        for key, style in (("atomic", "o-"), ("owner", "s-")):
            ax.plot([r["n"] for r in mine], [r[f"{key}_s"] / r["separate_s"] for r in mine], style,
                    label=f"fused {key} / separate ({lang})")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="n", ylabel="time, fused / separate", title="atomics vs owner")
    ax.legend(fontsize=8)
    return save(fig, path)


def main(args):
    from moagen.targets import get_target
    langs = [calls.check_impl(lang, args.dry_run) for lang in args.lang or
             [lang for lang in ("c", "cuda") if get_target(lang).runs_here()]]
    results = sweep.Results(args.out, ["moagen", *sys.argv[1:]])
    records = sweep.run(plan(args.n, langs, args.repeats, args.dry_run), results)
    table = rows(records)
    print(f"machine: {machine_summary(results.machine)}; {os.cpu_count()} threads")
    print(format_table(table))
    print(f"figure: {figure(table, args.out.with_suffix('.png'))}")

