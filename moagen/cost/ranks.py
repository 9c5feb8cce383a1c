"""Time and memory per rank of a distributed kernel (moagen.ranks) on P ranks: the rank-local
kernels' flops from their ONFs (moagen.cost.model), a measured single-rank rate R (flop/s of
the local kernel on one rank), and a stated network (bandwidth BW per link, latency L).

ring (ring_attention_fwd, sequence n, block n_l = n / P rows a rank): P steps; each computes
one block pair and merges it, F_step = F_local(n_l) + F_merge(n_l), while its K and V blocks
move one rank on, b_step = (K + V elements of a block) x itemsize sent and as many received:

    t_step = max(F_step / R, L + b_step / BW)   (steps 0 .. P-2; the last sends nothing)

The transfer hides behind the compute when F_step / R >= L + b_step / BW. For attention the
leading terms are 4 B H n_l^2 d flops against 2 B H n_l d elements, so (L aside) it hides
for n_l >= R x itemsize / (2 BW): batch, heads and d cancel.

owner (ring_attention_bwd): the local backward a step, K and V overlapped with it as in the
ring, the sums dK, dV sent after it (they are what it computed) and once more to go home:
    t = (P - 1) (max(F_step / R, L + b_KV / BW) + L + b_sums / BW) + F_step / R + L + b_sums / BW

gather (attention_decode_sharded, a cache of n rows, n_l = n / P a rank): each rank's decode
over its rows, then MPI_Allgather of its partial (O, lse), modelled as the ring allgather:
P - 1 steps of L + B Hq (d + 1) x itemsize / BW, then the merge over P parts. The
allgather's P - 1 latencies grow with P where the compute shrinks: at thousands of ranks a
tree of merges (log2 P steps) is what keeps decode short; moagen prints the allgather.

Memory per rank is the driver's arrays (moagen.ranks.library.driver_signature) at the
block's sizes: this rank's inputs and outputs, the ring's two slots of K and V, the merge's
parts, the local kernel's scratch.

Assumptions, printed with every table: F / R for the compute (R measured at one size: cache
effects across sizes are not modelled), every link at BW with latency L, one rank per link,
no contention; the oversubscribed runs of this machine share its cores, so their measured R
per rank is cores / P of one rank's."""
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np
import sympy

from moagen.bench.timing import wall_clock
from moagen.cost.flops import count_ops
from moagen.cost.model import SizeError, predict, value
from moagen.cost.view import counting_view
from moagen.ranks.library import driver_signature
from moagen.ranks.local_kernel import local_kernel
from moagen.ranks.mapping import get_rank_kernel
from moagen.ranks.merge import merge_onf

ASSUMPTIONS = ("compute time = flops / R, R measured on one rank at one size",
               "each message: latency + bytes / bandwidth; links uncontended",
               "ring: a step's transfer overlaps its compute (posted before it)")


@dataclass(frozen=True)
class RankCost:
    kernel: str
    ranks: int
    block: Dict[str, int]  # the local kernel's sizes on one rank
    steps: int  # message steps
    bytes_step: int  # sent by one rank in one step (as many received)
    compute_step_s: float
    transfer_step_s: float
    time_s: float
    memory_bytes: int  # per rank

    @property
    def hidden(self) -> bool:
        return self.compute_step_s >= self.transfer_step_s


def block_sizes(mapping, sizes: Dict[str, int], ranks: int) -> Dict[str, int]:
    """The local kernel's sizes on the busiest rank: the lifted size cut into ranks blocks
    (rounded up); the sharded decode's valid rows are its whole block."""
    if mapping.lifted not in sizes:
        raise SizeError(f"{mapping.name}: give the whole {mapping.lifted} (-D {mapping.lifted}=...)")
    block = dict(sizes, **{mapping.lifted: -(-sizes[mapping.lifted] // (ranks * mapping.chunks))})
    if mapping.empty_when_zero:
        block[mapping.empty_when_zero] = block[mapping.lifted]
    return block


def merge_flops(mapping, block, ranks) -> float:
    """The merge's flops and specials (one exp and a few flops per part and row)."""
    onf = merge_onf()
    ops = count_ops(counting_view(onf).nests)
    env = {}
    for name, given in mapping.merge_args().items():
        env[name] = ranks if given == "ranks" else int(given) if given.isdigit() else block[given]
    env = {s: env[s.name] for s in onf.sizes}
    return sum(value(n, env) for n in ops.values())


def local_flops(mapping, block, dtype) -> float:
    cost = predict(mapping.local, mapping.variant, dtype)
    env = cost.sizes_from({s.name: block[s.name] for s in cost.sizes})
    return sum(value(n, env) for n in cost.ops.values())


def memory_per_rank(mapping, block, ranks, dtype) -> int:
    sig = driver_signature(mapping, dtype, ranks)
    env = {s: block[s.name] for s in sig.sizes}
    return sum(int(sympy.prod(a.shape).xreplace(env)) for a in sig.arrays) * np.dtype(dtype).itemsize


def rank_cost(name, sizes, ranks, rate, bandwidth, latency, dtype="float64") -> RankCost:
    """One prediction: sizes are the whole problem's (the ring's n, the decode's cap)."""
    mapping = get_rank_kernel(name)
    block = block_sizes(mapping, sizes, ranks)
    itemsize = np.dtype(dtype).itemsize
    message = sum(mapping.message_elements(block).values()) * itemsize
    transfer = latency + message / bandwidth if ranks > 1 else 0.0
    steps = ranks - 1
    if mapping.pattern == "owner":  # the sums move after the compute: never hidden
        elements = mapping.message_elements(block)
        sums = latency + sum(elements[x] for x in mapping.carried) * itemsize / bandwidth \
            if ranks > 1 else 0.0
        transfer -= sums - latency if ranks > 1 else 0.0  # what overlaps: K and V
        compute = local_flops(mapping, block, dtype) / rate
        time = steps * (max(compute, transfer) + sums) + compute + sums
    elif mapping.pattern != "gather":  # zigzag: two chunk pairs a step (step 0: two causal
        # halves and one whole, as much)
        compute = mapping.chunks * (local_flops(mapping, block, dtype)
                                    + merge_flops(mapping, block, 2)) / rate
        time = steps * max(compute, transfer) + compute
    else:
        compute = local_flops(mapping, block, dtype) / rate
        time = compute + steps * transfer + merge_flops(mapping, block, ranks) / rate
    return RankCost(name, ranks, block, steps, message if ranks > 1 else 0, compute, transfer,
                    time, memory_per_rank(mapping, block, ranks, dtype))


def hiding_block(name, sizes, rate, bandwidth, latency, dtype="float64") -> int:
    """The ring's smallest block (rows a rank) whose compute hides its transfer (bisection
    on the exact counts; the bound grows where even the largest block does not)."""
    mapping = get_rank_kernel(name)
    itemsize = np.dtype(dtype).itemsize

    def hides(rows):
        block = dict(sizes, **{mapping.lifted: rows})
        merging = merge_flops(mapping, block, 2) if mapping.merged else 0
        flops = mapping.chunks * (local_flops(mapping, block, dtype) + merging)
        message = sum(n for x, n in mapping.message_elements(block).items()
                      if x not in mapping.carried) * itemsize
        return flops / rate >= latency + message / bandwidth

    high = 1
    while not hides(high):
        high *= 2
        if high > 2 ** 40:
            raise SizeError(f"{name}: no block hides its transfer at these rates")
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if hides(middle) else (middle, high)
    return high


def measured_rate(name, sizes, dtype="float64", lang="c", repeats=3) -> Tuple[float, Dict]:
    """The local kernel's flop rate on one rank of this machine at a representative block
    (the ring's 1024 rows, the decode's 65536 cache rows; smaller where the block is)."""
    mapping = get_rank_kernel(name)
    block = dict(sizes, **{mapping.lifted: min(sizes[mapping.lifted],
                                               1024 if mapping.pattern != "gather" else 65536)})
    if mapping.empty_when_zero:
        block[mapping.empty_when_zero] = block[mapping.lifted]
    local = {s.name: block[s.name] for s in mapping.local_signature(dtype).sizes}
    fn, inputs, scalars = local_kernel(mapping, local, lang, dtype, np.random.default_rng(0))
    call = lambda: fn(*inputs, **scalars)
    call()
    times = [wall_clock(call) for _ in range(repeats)]
    return local_flops(mapping, local, dtype) / float(np.median(times)), local


def format_table(costs, rate, bandwidth, latency, threshold=None) -> str:
    first = costs[0]
    lines = [f"{first.kernel}: per rank, R = {rate / 1e9:.3g} GFLOP/s a rank, link "
             f"{bandwidth / 1e9:.3g} GB/s, latency {latency * 1e6:.3g} us",
             f"{'ranks':>7} {'block':>9} {'steps':>6} {'MB/step':>9} {'compute/step':>13} "
             f"{'transfer/step':>14} {'hidden':>6} {'time s':>11} {'memory MB':>11}"]
    for c in costs:
        rows = c.block[get_rank_kernel(c.kernel).lifted]
        lines.append(f"{c.ranks:>7} {rows:>9} {c.steps:>6} {c.bytes_step / 1e6:>9.3f} "
                     f"{c.compute_step_s:>13.3e} {c.transfer_step_s:>14.3e} "
                     f"{_overlap(c):>6} {c.time_s:>11.4e} "
                     f"{c.memory_bytes / 1e6:>11.1f}")
    if threshold is not None:
        lines.append(f"a step's compute hides its transfer from a block of {threshold} rows a rank")
    lines += [f"assumes: {a}" for a in ASSUMPTIONS]
    return "\n".join(lines)


def _overlap(cost) -> str:
    """Whether the step's transfer hides behind its compute: only the ring overlaps them."""
    if cost.steps == 0 or get_rank_kernel(cost.kernel).pattern == "gather":
        return "-"
    return "yes" if cost.hidden else "no"


def plot(costs, path):
    from moagen.bench.report import pyplot, save
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ranks = [c.ranks for c in costs]
    left.loglog(ranks, [c.time_s for c in costs], "o-", label="time per call")
    left.loglog(ranks, [c.time_s - c.steps * max(c.transfer_step_s - c.compute_step_s, 0)
                        for c in costs], "--", label="if every transfer were hidden")
    left.set_xlabel("ranks")
    left.set_ylabel("seconds")
    left.legend()
    right.loglog(ranks, [c.memory_bytes / 2 ** 30 for c in costs], "o-")
    right.set_xlabel("ranks")
    right.set_ylabel("GiB per rank")
    lifted = get_rank_kernel(costs[0].kernel).lifted
    fig.suptitle(f"{costs[0].kernel}: " + " ".join(f"{k}={v}" for k, v in costs[0].block.items()
                                                    if k != lifted))
    save(fig, path)
    return path
