"""`moagen slurm`: a Slurm batch script that runs the topology sweep on one whole node
(templates/bench/slurm.sh.j2), with the placement options a NUMA machine needs; with
--ring, one that verifies the distributed kernels on the ranks of a multi-node allocation
and measures ring attention there (templates/bench/slurm_ring.sh.j2), one rank per NUMA
node."""
from moagen.errors import MoagenError


def script(cores, numa_nodes=1, time="01:00:00", partition=None) -> str:
    from moagen.templates import render
    if cores < 1 or numa_nodes < 1:
        raise MoagenError("--cores and --numa-nodes must be at least 1")
    return render("bench/slurm.sh.j2", cores=cores, numa_nodes=numa_nodes, time=time,
                  partition=partition)


def ring_script(nodes, cores, numa_nodes=1, time="01:00:00", partition=None,
                python=".venv/bin/python", ring_n=65536, ranks_per_numa=1,
                verify=None) -> str:
    """verify: the distributed kernels the job verifies before it measures; None: every
    one (moagen.ranks.mapping.RANK_KERNELS)."""
    from moagen.templates import render
    from moagen.ranks.mapping import RANK_KERNELS
    unknown = sorted(set(verify or ()) - set(RANK_KERNELS))
    if unknown:
        raise MoagenError(f"--verify: no distributed kernel {', '.join(unknown)}; they are "
                          f"{', '.join(RANK_KERNELS)}")
    per_node = numa_nodes * ranks_per_numa
    if min(nodes, cores, numa_nodes, ranks_per_numa) < 1 or cores % per_node:
        raise MoagenError("--nodes, --cores, --numa-nodes and --ranks-per-numa must be at "
                          "least 1, and a node's ranks must share its cores evenly")
    ranks = nodes * per_node
    if ring_n % ranks:
        raise MoagenError(f"--ring-n {ring_n} is not a multiple of the {ranks} ranks")
    return render("bench/slurm_ring.sh.j2", nodes=nodes, cores=cores, numa_nodes=numa_nodes,
                  ranks_per_numa=ranks_per_numa, cores_per_rank=cores // per_node, time=time,
                  partition=partition, python=python, ring_n=ring_n, verify=verify or ())


def main(args):
    from moagen.files import write_text
    if args.ring:
        text = ring_script(args.nodes, args.cores, args.numa_nodes, args.time, args.partition,
                           args.python, args.ring_n, args.ranks_per_numa, args.verify)
    else:
        text = script(args.cores, args.numa_nodes, args.time, args.partition)
    if args.output:
        write_text(args.output, text)
        args.output.chmod(0o755)
    else:
        print(text, end="")
