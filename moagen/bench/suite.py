"""`moagen bench`: kernels x variants x languages x sizes x thread counts, next to the numpy
and PyTorch baselines on the same inputs, then the summary and plots (moagen.bench.report).
CUDA is measured on the GPU's arrays by the GPU's clock, next to PyTorch on the same GPU."""
import os
import sys
from pathlib import Path

from moagen.bench import calls, sweep

DEFAULT_OUT = Path("bench-results/results.jsonl")
# under a minute even when every kernel must be built first (~1.5 s a Fortran build)
QUICK_KERNELS = ("attention_fwd", "attention_fwdbwd", "attention_decode", "rmsnorm_fwd")


def thread_counts(cores: int):
    """1, 2, 4, ... up to the cores, and the cores themselves."""
    counts, t = [], 1
    while t < cores:
        counts.append(t)
        t *= 2
    return counts + [cores]


def plan(kernels, langs, threads, dtype="float64", quick=False, lengths=None,
         baselines=None, choices=None, sizes=None, dry_run=False):
    """The jobs, every name checked before anything runs. choices: this machine's tuned
    schedule parameters (moagen.bench.tune); a variant without one runs its defaults.
    sizes: sizes other than n set for every kernel that has them (heads=8, d=128).
    baselines: which of calls.BASELINES run next to ours (at long lengths numpy's attention
    takes minutes a call; torch.compile tens of seconds per kernel and shape); None: numpy
    and torch on the host, torch on a device. dry_run: every call once, emulated targets
    allowed, to check a sweep end to end (its times mean nothing)."""
    from moagen.tuning import chosen
    from moagen.kernels import KERNELS

    variants = {}  # kernel -> its variants to run, in the order given
    for kernel, variant in calls.targets(kernels or (QUICK_KERNELS if quick else KERNELS), langs):
        variants.setdefault(kernel, []).append(variant)
    langs = [calls.check_impl(lang, dry_run) for lang in langs]
    device = calls.device_of(langs)
    if baselines is None:
        baselines = ("torch",) if device else calls.DEFAULT_BASELINES
    baselines = calls.check_baselines(baselines, device)
    ours, theirs = [], []
    for kernel, names in variants.items():
        for n in lengths or calls.lengths(kernel, quick):
            group = dict(kernel=kernel, dtype=dtype, sizes=calls.sizes(kernel, n, sizes))
            ours.append(dict(group, impls=[[lang, v, chosen(choices or {}, kernel, v, lang, dtype,
                                                            sizes)]
                                           for lang in langs for v in names]))
            theirs.append(dict(group, impls=[[b, None] for b in baselines]))
    warmup, repeats = (0, 1) if dry_run else (1, 3 if quick else 5)
    if device:
        # On a GPU no host thread pools contend: our kernels and the baselines in the same
        # rounds, on the same arrays, each group's records written as soon as it is timed.
        groups = [dict(o, impls=o["impls"] + t["impls"]) for o, t in zip(ours, theirs)]
        return [job for t in threads for job in (
            sweep.Job(sweep.Setting(t), [], roof=True, quick=quick or dry_run, device=device),
            sweep.Job(sweep.Setting(t), groups, warmup=warmup, repeats=repeats, device=device))]
    # The roof, our kernels and the baselines each in a process of their own: OpenMP, BLAS
    # and PyTorch keep thread pools of their own whose idle threads spin for a while, and
    # two spinning pools on the same cores stall each other. The inputs are the same (seeded).
    return [job for t in threads for job in (
        sweep.Job(sweep.Setting(t), [], roof=True, quick=quick or dry_run),
        sweep.Job(sweep.Setting(t), ours, warmup=warmup, repeats=repeats, quick=quick,
                  triad_in_rounds=True),
        *([sweep.Job(sweep.Setting(t), theirs, warmup=warmup, repeats=repeats)]
          if baselines else []))]


def main(args):
    from moagen.bench import report

    cores = os.cpu_count()
    threads = args.threads or ([cores] if args.quick else thread_counts(cores))
    from moagen.tuning import load_choices
    from moagen.targets import of_kind
    jobs = plan(args.kernels, args.lang or of_kind("cpu"), threads, args.dtype, args.quick, args.n,
                baselines=args.baselines, choices={} if args.untuned else load_choices(args.tuning),
                sizes=dict(args.size), dry_run=args.dry_run)
    results = sweep.Results(args.out, ["moagen", *sys.argv[1:]])
    records = sweep.run(jobs, results)
    summary = report.write(args.out, run=results.run_id)
    print(Path(summary).read_text())
    return 0 if records else 1
