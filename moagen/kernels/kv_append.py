"""Append one row per (batch, KV head) to a preallocated KV cache: the new K and V rows go to
row n of the caches (n rows are valid before the call), in place, in O(d) per head."""
from moagen import reference
from moagen.kernels.cases import Bench, Check, references
from moagen.kernels.layers import Layers
from moagen.moa.expr import BinOp, array, dim, iota, lift, psi, where
from moagen.moa.spec import KernelSpec, Output
from moagen.steps.loop.inplace import InPlace
from moagen.steps.loop.parallel import GpuThreads

K_CACHE = array("K", "batch", "kv_heads", "cap", "d")
V_CACHE = array("V", "batch", "kv_heads", "cap", "d")
K_NEW = array("k_new", "batch", "kv_heads", "d")
V_NEW = array("v_new", "batch", "kv_heads", "d")


def _appended(cache, row):
    """The cache with `row` as its row n: as a value, a whole new cache."""
    is_row_n = BinOp("==", psi(("r",), iota("cap")), dim("n"))
    return lift(("b", "g", "r"), ("batch", "kv_heads", "cap"),
                where(is_row_n, psi(("b", "g"), row), psi(("b", "g", "r"), cache)))


SPEC = KernelSpec(
    name="kv_append",
    inputs=(K_CACHE, V_CACHE, K_NEW, V_NEW),
    scalars=(),
    given=("n",),
    outputs=(Output("K_out", _appended(K_CACHE, K_NEW), ("b", "g", "r", "c")),
             Output("V_out", _appended(V_CACHE, V_NEW), ("b", "g", "r", "c"))),
)


def validate(sizes, scalars):
    """Row n must exist: nothing is written outside the cache."""
    if sizes["n"] >= sizes["cap"]:
        raise ValueError(f"kv_append: the cache is full: row n = {sizes['n']} is beyond its "
                         f"capacity of {sizes['cap']} rows")


# On a CPU one thread: copying a row per head is less work than starting the threads
# (docs/PERFORMANCE.md, "Small calls"). On a GPU a thread per head.
ON_A_GPU = (GpuThreads(("b", "g")),)
VARIANTS = {
    # only row n of each cache is written, into the caches themselves
    "dnf": (frozenset(), Layers(algorithm=(InPlace("K_out", "K"), InPlace("V_out", "V")),
                                mapping={"cpu": (), "cuda": ON_A_GPU, "openacc": ON_A_GPU})),
}

KERNELS = [(SPEC, VARIANTS, validate)]

# What verification and the benchmarks run this kernel on (moagen.kernels.cases): into an
# empty cache, the middle, the last row; the bench appends row n to a cache of n + 1 rows.
CHECKS = {"kv_append": Check(
    references(reference.kv_append_numpy, reference.kv_append_torch),
    (dict(batch=1, kv_heads=1, cap=1, d=3, n=0), dict(batch=2, kv_heads=3, cap=7, d=5, n=4),
     dict(batch=1, kv_heads=2, cap=257, d=80, n=256)))}
BENCH = {"kv_append": Bench(lambda n: dict(batch=1, kv_heads=8, cap=n + 1, d=128, n=n),
                            quick=(4096,), full=(1024, 32768)).measured_against(
    "kv_append", "row n of both caches written in place by indexing")}
