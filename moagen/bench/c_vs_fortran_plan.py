"""Paper V, result 3, what both its halves share: the CPU one (moagen.bench.languages) and
the GPU one (moagen.bench.offload) time the same kernels, at the same lengths, in the same
sweep, and read the times back the same way."""
import os

from moagen.bench import calls, sweep

DEFAULT_KERNELS = ("attention_fwd", "attention_bwd", "attention_fwdbwd", "attention_decode",
                   "rmsnorm_fwd")


def default_length(kernel):
    lengths = calls.lengths(kernel, quick=False)
    return lengths[len(lengths) // 2]


def plan(pairs, n, repeats, langs):
    """The sweep: each (kernel, variant) of `pairs` in each of `langs`, at n (default: the
    kernel's middle length), on every core."""
    groups = [dict(kernel=k, dtype="float64", sizes=calls.sizes(k, n or default_length(k)),
                   impls=[[lang, v] for lang in langs]) for k, v in pairs]
    return [sweep.Job(sweep.Setting(os.cpu_count()), groups, repeats=repeats)]


def median_times(records, langs) -> dict:
    """(kernel, variant, n) -> lang -> median seconds, of the languages in `langs`."""
    by = {}
    for r in records:
        if r["record"] == "result" and r["lang"] in langs:
            by.setdefault((r["kernel"], r["variant"], r["sizes"]["n"]), {})[r["lang"]] = r["median_s"]
    return by
