"""Paper V, result 3: the same ONF in C and in Fortran, same compiler family and flags, per
kernel, with the ablation that prints the C without `restrict` (Fortran dummy arrays may
not alias; C pointers may, unless declared restrict). With --valgrind, each language also
runs once under callgrind (one thread, -march=x86-64-v3, which valgrind can decode),
counting the kernel's instructions, data reads and writes and cache misses: the stall
proxy where no hardware counters are readable. The Fortran is called through its bind(C)
entry point, as the C is: no wrapper is counted."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from moagen.bench import calls, sweep
from moagen.bench.c_vs_fortran_plan import DEFAULT_KERNELS, default_length, median_times, plan
from moagen.bench.machine import summary as machine_summary
from moagen.cost.valgrind import FLAGS, event_totals, valgrind
from moagen.errors import UnknownNameError

LANGS = ("c", "c-norestrict", "fortran")  # the targets compared (moagen.targets)
VALGRIND_FLAGS = " ".join(FLAGS)
EVENTS = ("Ir", "Dr", "Dw", "D1mr", "D1mw", "DLmr", "DLmw")


def callgrind(kernel, variant, lang, sizes) -> dict:
    """The kernel's own event counts (callees included) from one call under callgrind."""
    import sympy

    from moagen.targets.toolchain import Toolchain
    from moagen.emit import emit, stem
    from moagen.onf.signature import signature
    from moagen.pipeline import onf_of
    from moagen.steps.algebra.given import with_chosen
    from moagen.targets import get_target

    found = valgrind()
    toolchain = Toolchain(cflags=FLAGS + ("-std=c99",), fflags=FLAGS)
    # Fortran's bind(C) routine is exported under the same name as C's function
    library = get_target(lang).build(emit(kernel, variant, lang), stem(kernel, variant), toolchain)
    sig = signature(onf_of(kernel, variant), "float64")
    sizes = with_chosen(sig.chosen, sizes)  # on this CPU, as a call leaving them out
    env = {s: sizes[s.name] for s in sig.sizes}
    scalars = calls.scalars(kernel, sizes)
    job = dict(library=str(library), symbol=sig.name, sizes=[sizes[s.name] for s in sig.sizes],
               arrays=[int(sympy.Mul(*a.shape).subs(env)) for a in sig.arrays],
               scalars=[scalars[s] for s in sig.scalars])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        # the parallel regions' outlined bodies (gcc names them SYMBOL._omp_fn.K), where the
        # kernel's loops run; the entry point itself only hands them to libgomp
        subprocess.run([found, "--tool=callgrind", "--cache-sim=yes",
                        f"--toggle-collect={sig.name}._omp_fn.*", f"--callgrind-out-file={out}",
                        sys.executable, "-m", "moagen.bench.call_once", json.dumps(job)],
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"),
                       check=True, capture_output=True)
        return parse_callgrind(out.read_text())


def restrict_changes_code(kernel, variant) -> bool:
    """Whether gcc, with the kernels' flags, emits other instructions for the C printed
    without restrict: if not, restrict cannot explain any gap."""
    from moagen.emit import emit, stem
    from moagen.targets import get_target

    def code(lang):
        built = get_target(lang).build(emit(kernel, variant, lang), stem(kernel, variant))
        return _disassembly(built)
    return code("c") != code("c-norestrict")


def _disassembly(library):
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True,
                          text=True, check=True).stdout
    return text.split("\n", 2)[2]  # past the line naming the file


def parse_callgrind(text: str) -> dict:
    counts = event_totals(text)
    return {e: counts.get(e, 0) for e in EVENTS}


def table(records) -> list:
    return [dict(kernel=k, variant=v, n=n, restrict_changes_code=restrict_changes_code(k, v),
                 **{lang: t[lang] for lang in LANGS})
            for (k, v, n), t in median_times(records, LANGS).items()]


def format_table(rows, counts=None) -> str:
    lines = [f"{'kernel':<18} {'variant':<7} {'n':>6} {'C ms':>9} {'C-norestr ms':>12} "
             f"{'Fortran ms':>10} {'F/C':>6} {'C-nor/C':>8} {'restrict changes code':>22}"]
    for r in rows:
        lines.append(f"{r['kernel']:<18} {r['variant']:<7} {r['n']:>6} {r['c'] * 1e3:>9.2f} "
                     f"{r['c-norestrict'] * 1e3:>12.2f} {r['fortran'] * 1e3:>10.2f} "
                     f"{r['fortran'] / r['c']:>6.2f} {r['c-norestrict'] / r['c']:>8.2f} "
                     f"{'yes' if r['restrict_changes_code'] else 'no':>22}")
    lines.append("F/C > 1: C is faster; C-nor/C > 1: restrict helps")
    for (kernel, variant, n), per_lang in (counts or {}).items():
        lines.append(f"callgrind, {kernel} {variant} n={n}, 1 thread, {VALGRIND_FLAGS}:")
        lines.append(f"  {'lang':<13}" + "".join(f"{e:>15}" for e in EVENTS))
        for lang, c in per_lang.items():
            lines.append(f"  {lang:<13}" + "".join(f"{c[e]:>15,}" for e in EVENTS))
    return "\n".join(lines)


def figure(rows, path):
    from moagen.bench.report import pyplot, save
    plt = pyplot()
    import numpy as np
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4.5))
    x = np.arange(len(rows))
    for k, lang in enumerate(LANGS):
        ax.bar(x + (k - 1) * 0.27, [r[lang] / r["c"] for r in rows], 0.27, label=lang)
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xticks(x, [f"{r['kernel']}\n{r['variant']}" for r in rows], fontsize=7, rotation=30)
    ax.set(ylabel="time / C time", title="C vs Fortran, same ONF")
    ax.legend(fontsize=8)
    return save(fig, path)


def main(args):
    """The CPU half of `moagen bench c-vs-fortran` (--target cpu)."""
    if args.ptx:
        raise UnknownNameError("--ptx is the device code of OpenACC: give --target openacc")
    pairs = calls.targets(args.kernels or DEFAULT_KERNELS, LANGS)
    results = sweep.Results(args.out, ["moagen", *sys.argv[1:]])
    rows = table(sweep.run(plan(pairs, args.n, args.repeats, LANGS), results))
    counts = {}
    if args.valgrind:
        for kernel, variant in pairs:
            sizes = calls.sizes(kernel, min(args.n or default_length(kernel), 256))
            counts[(kernel, variant, sizes["n"])] = per_lang = {}
            for lang in LANGS:
                print(f"callgrind: {kernel} {variant} {lang} ...", file=sys.stderr, flush=True)
                per_lang[lang] = callgrind(kernel, variant, lang, sizes)
                results.append(dict(record="callgrind", kernel=kernel, variant=variant, lang=lang,
                                    sizes=sizes, flags=VALGRIND_FLAGS, **per_lang[lang]))
    print(f"machine: {machine_summary(results.machine)}; {os.cpu_count()} threads")
    print(format_table(rows, counts))
    print(f"figure: {figure(rows, args.out.with_suffix('.png'))}")
