"""`mpirun -np P moagen verify --ranks`: every distributed kernel on the ranks of the job,
compared with numpy on the whole problem and with the single-process kernel it lifts (the
same variant, one process, the whole sequence or cache), at sizes that divide nothing; the
owner-form backward also run twice, and failed unless bitwise the same.

Every rank makes the same global inputs (one seed), takes its block and runs; the errors are
normwise over the whole output (the largest difference over all ranks over the largest
reference entry, moagen.verify.normwise_error's rule) and every rank reports the same rows.
"""
from functools import partial

import numpy as np

from moagen import reference, runtime
from moagen.kernels import get_kernel
from moagen.ranks.library import LANGS
from moagen.ranks.mapping import RANK_KERNELS, get_rank_kernel
from moagen.ranks.run import RankKernel
from moagen.verify import TOLERANCE, Row

# per rank: ring_attention_fwd's n are its rows (the sequence is ranks x n); the sharded
# decode's cap are its cache rows, n the valid rows of the whole cache (a rank past them
# holds none, one with part of them some)
SIZES = {
    "ring_attention_fwd": (dict(batch=1, heads=1, n=1, d=3),
                           dict(batch=2, heads=3, n=5, d=7),
                           dict(batch=1, heads=2, n=67, d=16)),
    "ring_attention_bwd": (dict(batch=1, heads=1, n=1, d=3),
                           dict(batch=2, heads=3, n=5, d=7),
                           dict(batch=1, heads=2, n=37, d=16)),
    # per rank: two chunks of n rows (the sequence is 2 x ranks x n)
    "ring_attention_fwd_causal": (dict(batch=1, heads=1, n=1, d=3),
                                  dict(batch=2, heads=3, n=5, d=7),
                                  dict(batch=1, heads=2, n=37, d=16)),
    "attention_decode_sharded": (dict(batch=1, q_heads=1, kv_heads=1, cap=1, d=3, n=1),
                                 dict(batch=2, q_heads=6, kv_heads=2, cap=11, d=5, n=13),
                                 dict(batch=1, q_heads=8, kv_heads=1, cap=40, d=16, n="all")),
}


def _ring_case(mapping, sizes, ranks, rank, rng):
    """This rank's arguments, and the whole problem's (for the references)."""
    whole = dict(sizes, n=sizes["n"] * ranks)
    shape = (whole["batch"], whole["heads"], whole["n"], whole["d"])
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    rows = slice(rank * sizes["n"], (rank + 1) * sizes["n"])
    mine = [np.ascontiguousarray(a[:, :, rows]) for a in (q, k, v)]
    return mine, {}, (q, k, v), {}, lambda outputs: tuple(o[:, :, rows] for o in outputs)


def _owner_case(mapping, sizes, ranks, rank, rng):
    """The ring's rows, with the whole forward's O and lse and a random dO."""
    mine, given, (q, k, v), whole_given, my_part = _ring_case(mapping, sizes, ranks, rank, rng)
    scale = get_kernel(mapping.local).check.scalars(sizes)["scale"]
    o, lse = reference.attention_fwd_numpy(q, k, v, scale)
    do = rng.standard_normal(q.shape)
    rows = slice(rank * sizes["n"], (rank + 1) * sizes["n"])
    mine += [np.ascontiguousarray(a[:, :, rows]) for a in (o, do, lse)]
    return mine, given, (q, k, v, o, do, lse), whole_given, my_part


def _zigzag_case(mapping, sizes, ranks, rank, rng):
    """The sequence in 2 x ranks chunks of n rows; this rank's: chunk rank and chunk
    2 ranks - 1 - rank, stacked (its low and high rows)."""
    chunk = sizes["n"]
    shape = (sizes["batch"], sizes["heads"], 2 * ranks * chunk, sizes["d"])
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    rows = [slice(c * chunk, (c + 1) * chunk) for c in (rank, 2 * ranks - 1 - rank)]
    mine = [np.ascontiguousarray(np.stack([a[:, :, r] for r in rows])) for a in (q, k, v)]
    return mine, {}, (q, k, v), {}, lambda outputs: tuple(np.stack([o[:, :, r] for r in rows])
                                                          for o in outputs)


def _decode_case(mapping, sizes, ranks, rank, rng):
    cap = sizes["cap"] * ranks
    valid = cap if sizes["n"] == "all" else min(sizes["n"], cap)
    q = rng.standard_normal((sizes["batch"], sizes["q_heads"], sizes["d"]))
    k, v = (rng.standard_normal((sizes["batch"], sizes["kv_heads"], cap, sizes["d"]))
            for _ in range(2))
    rows = slice(rank * sizes["cap"], (rank + 1) * sizes["cap"])
    here = min(max(valid - rank * sizes["cap"], 0), sizes["cap"])
    mine = [q] + [np.ascontiguousarray(a[:, :, rows]) for a in (k, v)]
    return mine, {"n": here}, (q, k, v), {"n": valid}, lambda outputs: outputs


CASES = {"ring": _ring_case, "zigzag": _zigzag_case, "owner": _owner_case,
         "gather": _decode_case}
REFERENCES = {"attention_fwd": reference.attention_fwd_numpy,
              "attention_fwd_causal": partial(reference.attention_fwd_numpy, causal=True),
              "attention_bwd": reference.attention_bwd_numpy,
              "attention_decode": reference.attention_decode_numpy}


def check_case(comm, name, lang, dtype, sizes, seed=0, load=partial(runtime.load, tuned=False)):
    mapping = get_rank_kernel(name)
    ranks, rank = comm.Get_size(), comm.Get_rank()
    label = f"ranks={ranks} " + " ".join(f"{k}={v}" for k, v in sizes.items())
    mine, given, whole, whole_given, my_part = CASES[mapping.pattern](
        mapping, sizes, ranks, rank, np.random.default_rng(seed))
    mine = [a.astype(dtype) for a in mine]
    whole = [a.astype(dtype) for a in whole]
    scalars = get_kernel(mapping.local).check.scalars(sizes)
    kernel = RankKernel(name, lang, dtype, comm)
    outputs = kernel(*mine, **scalars, **given)
    # the owner form adds in one order for a given number of ranks: the same bits again
    repeatable = mapping.pattern != "owner" or all(comm.allgather(all(
        np.array_equal(a, b) for a, b in zip(outputs, kernel(*mine, **scalars, **given)))))
    wide = [a.astype(np.float64) for a in whole]
    references = {
        "numpy": REFERENCES[mapping.whole](*wide, **scalars, **whole_given),
        "single": load(mapping.whole, mapping.variant, lang, dtype)(*whole, **scalars,
                                                                    **whole_given)}
    errors = {}
    for what, expected in references.items():
        expected = my_part(expected)
        diff = max(float(np.max(np.abs(o - e))) for o, e in zip(outputs, expected))
        size = max(float(np.max(np.abs(e))) for e in expected)
        errors[what] = comm.allreduce(diff, op=_max()) / max(comm.allreduce(size, op=_max()), 1.0)
    ok = repeatable and all(e <= TOLERANCE[dtype] for e in errors.values())
    return Row(name, mapping.variant, f"{lang}-mpi", dtype, label, errors, "pass" if ok else "FAIL")


def _max():
    from mpi4py import MPI
    return MPI.MAX


def run(comm, kernels=None, langs=LANGS, dtypes=("float64", "float32")):
    for name in kernels or RANK_KERNELS:
        get_rank_kernel(name)
        for lang in langs:
            for dtype in dtypes:
                for sizes in SIZES[name]:
                    yield check_case(comm, name, lang, dtype, sizes)


def main(kernels, langs, dtypes) -> int:
    """The rows on rank 0, the same exit status on every rank."""
    from mpi4py import MPI

    from moagen.verify import HEADER, format_row
    comm = MPI.COMM_WORLD
    speaker = comm.Get_rank() == 0
    if speaker:
        print(HEADER, flush=True)
    failures = total = 0
    for row in run(comm, kernels, langs, dtypes):
        if speaker:
            print(format_row(row), flush=True)
        total += 1
        failures += row.failed
    if speaker:
        print(f"{total - failures} passed, {failures} failed on {comm.Get_size()} ranks")
    return 1 if failures else 0
