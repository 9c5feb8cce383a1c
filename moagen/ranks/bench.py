"""Measure a distributed kernel on the ranks of an MPI job, next to the cost model's
prediction (moagen.cost.ranks) made from rates measured in the same job:

    mpirun -np P python -m moagen.ranks.bench ring_attention_fwd -D batch=1 -D heads=4 \\
        -D n=4096 -D d=64 [--lang c] [--repeats 5]

R: every rank times the rank-local kernel on its block at the same moment (so ranks that
share a core each get their share, as in the real run); BW: every rank sends one step's
message to its ring neighbour at the same moment (latency included, so the model's latency
is 0). The call is timed as the slowest rank sees it, median over the repeats. Rank 0
prints one line (and --json, a record)."""
import argparse
import json

import numpy as np

from moagen.bench.timing import wall_clock
from moagen.cost.model import SizeError
from moagen.cost.ranks import block_sizes, local_flops, rank_cost
from moagen.ranks.local_kernel import local_kernel
from moagen.ranks.mapping import get_rank_kernel
from moagen.ranks.run import RankKernel


def _slowest(comm, fn, repeats):
    """The median over repeats of the slowest rank's time, every rank starting together."""
    from mpi4py import MPI
    times = []
    for _ in range(repeats):
        comm.Barrier()
        times.append(comm.allreduce(wall_clock(fn), op=MPI.MAX))
    return float(np.median(times))


def measure(comm, name, sizes, lang="c", dtype="float64", repeats=5) -> dict:
    mapping = get_rank_kernel(name)
    ranks = comm.Get_size()
    if mapping.pattern != "ring":
        raise SizeError(f"{name}: only the ring is measured here")
    if sizes[mapping.lifted] % ranks:
        raise SizeError(f"{name}: {mapping.lifted} = {sizes[mapping.lifted]} is not a multiple of "
                        f"{ranks} ranks")
    block = block_sizes(mapping, sizes, ranks)
    local, inputs, scalars = local_kernel(mapping, block, lang, dtype,
                                          np.random.default_rng(comm.Get_rank()))
    distributed = RankKernel(name, lang, dtype, comm)
    local(*inputs, **scalars)
    distributed(*inputs, **scalars)  # builds, loads and warms both before timing

    compute = _slowest(comm, lambda: local(*inputs, **scalars), repeats)
    rate = local_flops(mapping, block, dtype) / compute
    message = np.zeros(sum(mapping.message_elements(block).values()), dtype)
    received = np.empty_like(message)
    rank = comm.Get_rank()
    send = lambda: comm.Sendrecv(message, (rank + 1) % ranks, 0, received, (rank - 1) % ranks, 0)
    bandwidth = message.nbytes / _slowest(comm, send, repeats) if ranks > 1 else float("inf")
    measured = _slowest(comm, lambda: distributed(*inputs, **scalars), repeats)
    predicted = rank_cost(name, sizes, ranks, rate, bandwidth, 0.0, dtype)
    return {"kernel": name, "lang": lang, "dtype": dtype, "ranks": ranks, "sizes": sizes,
            "block": block, "bytes_sent_per_rank": distributed.bytes_sent(block),
            "rate_flops": rate, "bandwidth": bandwidth, "predicted_s": predicted.time_s,
            "measured_s": measured, "memory_per_rank_bytes": predicted.memory_bytes,
            "hidden": predicted.hidden}


def main(argv=None):
    from mpi4py import MPI

    from moagen.commands.cost import size_assignment
    p = argparse.ArgumentParser(prog="python -m moagen.ranks.bench")
    p.add_argument("kernel")
    p.add_argument("-D", dest="define", action="append", default=[], metavar="SIZE=N")
    p.add_argument("--lang", default="c", choices=("c", "fortran"))
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    record = measure(comm, args.kernel, dict(size_assignment(d) for d in args.define), args.lang,
                     args.dtype, args.repeats)
    if comm.Get_rank() == 0:
        if args.json:
            print(json.dumps(record))
        else:
            print(f"{record['kernel']} {record['lang']} ranks={record['ranks']} "
                  f"block={record['block']}: sent {record['bytes_sent_per_rank'] / 1e6:.2f} MB a "
                  f"rank; R {record['rate_flops'] / 1e9:.2f} GFLOP/s a rank, link "
                  f"{record['bandwidth'] / 1e9:.2f} GB/s; predicted {record['predicted_s']:.4f} s, "
                  f"measured {record['measured_s']:.4f} s")


if __name__ == "__main__":
    main()
