"""Paper V, result 3, its GPU half: the same ONF as OpenACC C, OpenACC C without `restrict`
and OpenACC Fortran (moagen.targets.openacc), offloaded by gcc 12 to NVIDIA GPUs.

--ptx, no GPU needed: the device code side by side, per kernel variant. In the PTX gcc
makes: loads and stores of global memory (gcc's nvptx back end addresses it generically,
`ld.f64`, or as `ld.global`), the read-only `ld.global.nc` among the loads, the integer
loads (the arrays' addresses and the sizes, which an outlined region reads from the block
of arguments gcc hands it), local memory. In ptxas' report on it (sm_80): the most
registers a region takes, spill bytes. In the SASS ptxas makes of it: loads and stores, and
the read-only path (LDG.E.CONSTANT) among the loads, which ptxas may take where it proves
an array read-only. All static counts: instructions in the code, not executed ones.

Without --ptx, on a GPU: the three timed next to the CUDA kernel of the same variant (each
call moves its arrays to the device and back, the OpenACC data region as the CUDA binding
does for numpy arrays)."""
import hashlib
import os
import re
import sys

from moagen.bench import calls, sweep
from moagen.bench.c_vs_fortran_plan import DEFAULT_KERNELS, median_times, plan
from moagen.targets.openacc.build import offload_ptx
from moagen.targets.toolchain import PTX_ARCH
from moagen.bench.machine import summary as machine_summary
from moagen.emit import emit, stem
from moagen.cost import sass
from moagen.kernels import KERNELS
from moagen.targets import get_target
from moagen.targets.openacc.target import devices

LANGS = ("openacc-c", "openacc-c-norestrict", "openacc-fortran")
LABELS = {"openacc-c": "C", "openacc-c-norestrict": "C norestrict",
          "openacc-fortran": "Fortran", "cuda": "CUDA"}
TIMED = LANGS + ("cuda",)
# the kernels timed by default: the CPU comparison's, and the MLP whose backward was the
# paper's largest gap
TIMED_KERNELS = DEFAULT_KERNELS + ("mlp_fwd", "mlp_bwd")

PTX_MEMORY = re.compile(r"^\s*(?:@\s*!?\s*%\w+\s+)?(ld|st)((?:\.\w+)+)\s", re.MULTILINE)
SPACES = ("global", "local", "shared", "param", "const")
SASS_MEMORY = re.compile(r"\b(LDG|LD|LDL|STG|ST|STL)\b((?:\.\w+)*)")


def ptx_memory(ptx: str) -> dict:
    """Memory instructions in PTX, by what they touch."""
    out = dict(ld=0, ld_nc=0, st=0, ld_int=0, st_int=0, local=0)
    for op, qualifiers in PTX_MEMORY.findall(ptx):
        words = qualifiers.split(".")[1:]
        space = next((w for w in words if w in SPACES), "generic")
        if space == "local":
            out["local"] += 1
        if space not in ("global", "generic"):
            continue
        data = words[-1] in ("f32", "f64")  # the kernels' arrays hold reals only
        out[op if data else f"{op}_int"] += 1
        out["ld_nc"] += op == "ld" and data and "nc" in words
    return out


def sass_memory(code: str) -> dict:
    out = dict(sass_ld=0, sass_ld_constant=0, sass_st=0)
    for op, qualifiers in SASS_MEMORY.findall(code):
        if op in ("LD", "LDG"):
            out["sass_ld"] += 1
            out["sass_ld_constant"] += ".CONSTANT" in qualifiers
        elif op in ("ST", "STG"):
            out["sass_st"] += 1
    return out


def inspect(kernel, variant, lang, dtype="float64") -> dict:
    """The device code of one kernel variant in one OpenACC language: a bench record."""
    result = offload_ptx(emit(kernel, variant, lang, (dtype,)), stem(kernel, variant),
                               get_target(lang).extension)
    ptx = result.ptx.read_text()
    regions = sass.ptxas_resources(result.ptxas_report)
    machine_code = "".join(sass.sass_by_function(result.cubin).values())
    return dict(record="ptx", kernel=kernel, variant=variant, lang=lang, dtype=dtype,
                regions=len(regions), **ptx_memory(ptx),
                registers=max((r["registers"] for r in regions.values()), default=0),
                spill_bytes=sum(r["spill_stores"] + r["spill_loads"] for r in regions.values()),
                **sass_memory(machine_code),
                ptx_sha256=hashlib.sha256(ptx.encode()).hexdigest())


def format_ptx_table(records) -> str:
    by = {}
    for r in records:
        by.setdefault((r["kernel"], r["variant"]), {})[r["lang"]] = r
    head = (f"{'kernel:variant':<30} {'lang':<13} {'ld':>5} {'ld.nc':>5} {'st':>5} {'ld int':>6} "
            f"{'st int':>6} {'local':>5} | {'regs':>4} {'spill B':>7} | {'SASS ld':>7} "
            f"{'LDG.CONST':>9} {'SASS st':>7}")
    lines = [f"device code of the OpenACC regions: gcc 12 nvptx, {PTX_ARCH}, "
             f"{records[0]['dtype'] if records else ''}; static instruction counts per kernel "
             "variant (regs: the most of any region)", head, "-" * len(head)]
    changed = []
    for (kernel, variant), per_lang in by.items():
        for k, lang in enumerate(LANGS):
            r = per_lang[lang]
            name = f"{kernel}:{variant}" if k == 0 else ""
            lines.append(f"{name:<30} {LABELS[lang]:<13} {r['ld']:>5} {r['ld_nc']:>5} "
                         f"{r['st']:>5} {r['ld_int']:>6} {r['st_int']:>6} {r['local']:>5} | "
                         f"{r['registers']:>4} {r['spill_bytes']:>7} | {r['sass_ld']:>7} "
                         f"{r['sass_ld_constant']:>9} {r['sass_st']:>7}")
        if per_lang["openacc-c"]["ptx_sha256"] != per_lang["openacc-c-norestrict"]["ptx_sha256"]:
            changed.append(f"{kernel}:{variant}")
    lines += ["", summary(by, changed)]
    return "\n".join(lines)


def summary(by, changed) -> str:
    """What the table says about restrict, in two lines."""
    total = lambda lang, column: sum(p[lang][column] for p in by.values())
    nc = {LABELS[lang]: (total(lang, "ld_nc"), total(lang, "sass_ld_constant")) for lang in LANGS}
    return (f"restrict changes the PTX of {len(changed)} of {len(by)} kernel variants"
            f"{': ' + ', '.join(changed) if changed else ''}\n"
            "read-only loads (ld.global.nc in PTX, LDG.E.CONSTANT in SASS): "
            + "; ".join(f"{label} {a}, {b}" for label, (a, b) in nc.items()))


def figure(records, path):
    """Per kernel variant, Fortran's and C-without-restrict's loads, stores and registers
    over C's (SASS counts)."""
    import numpy as np

    from moagen.bench.report import pyplot, save
    plt = pyplot()
    by = {}
    for r in records:
        by.setdefault(f"{r['kernel']}\n{r['variant']}", {})[r["lang"]] = r
    names = list(by)
    fig, axes = plt.subplots(3, 1, figsize=(max(8, len(names) * 0.45), 9), sharex=True)
    x = np.arange(len(names))
    for ax, (column, title) in zip(axes, (("sass_ld", "loads (SASS)"), ("sass_st", "stores (SASS)"),
                                          ("registers", "registers (most of a region)"))):
        for k, lang in enumerate(LANGS[1:]):
            ratio = [by[n][lang][column] / max(by[n]["openacc-c"][column], 1) for n in names]
            ax.bar(x + (k - 0.5) * 0.4, ratio, 0.4, label=LABELS[lang])
        ax.axhline(1, color="grey", lw=0.8)
        ax.set(ylabel="/ C", title=f"OpenACC device code: {title}, over C's")
    axes[0].legend(fontsize=8)
    axes[-1].set_xticks(x, names, fontsize=6, rotation=90)
    return save(fig, path)


def ptx_main(args):
    pairs = calls.targets(args.kernels or KERNELS, LANGS)
    results = sweep.Results(args.out, ["moagen", *sys.argv[1:]])
    records = []
    for kernel, variant in pairs:
        for lang in LANGS:
            print(f"ptx: {kernel} {variant} {lang} ...", file=sys.stderr, flush=True)
            records.append(inspect(kernel, variant, lang))
            results.append(records[-1])
    print(format_ptx_table(records))
    print(f"figure: {figure(records, args.out.with_suffix('.png'))}")


def timed_main(args):
    for lang in TIMED:  # refused up front without a GPU: the host fallback says nothing
        calls.check_impl(lang)
    pairs = calls.targets(args.kernels or TIMED_KERNELS, TIMED)
    results = sweep.Results(args.out, ["moagen", *sys.argv[1:]])
    records = sweep.run(plan(pairs, args.n, args.repeats, TIMED), results)
    print(f"machine: {machine_summary(results.machine)}; {devices()} OpenACC device(s); "
          f"{os.cpu_count()} host threads")
    print(format_times(records))


def format_times(records) -> str:
    """Median times per kernel variant and length, with the ratios the paper reports."""
    by = median_times(records, TIMED)
    lines = [f"{'kernel':<18} {'variant':<7} {'n':>6}" + "".join(f" {LABELS[lang] + ' ms':>15}"
                                                             for lang in TIMED)
             + f" {'F/C':>6} {'C-nor/C':>8} {'C/CUDA':>7}"]
    for (kernel, variant, n), t in by.items():
        lines.append(f"{kernel:<18} {variant:<7} {n:>6}"
                     + "".join(f" {t[lang] * 1e3:>15.3f}" for lang in TIMED)
                     + f" {t['openacc-fortran'] / t['openacc-c']:>6.2f}"
                     f" {t['openacc-c-norestrict'] / t['openacc-c']:>8.2f}"
                     f" {t['openacc-c'] / t['cuda']:>7.2f}")
    lines.append("F/C > 1: C is faster (the paper: Fortran 3.17x faster in the MLP backward); "
                 "C-nor/C > 1: restrict helps")
    return "\n".join(lines)


def main(args):
    """The GPU half of `moagen bench c-vs-fortran` (--target openacc)."""
    return ptx_main(args) if args.ptx else timed_main(args)
