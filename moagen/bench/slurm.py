"""`moagen slurm`: a Slurm batch script that runs the topology sweep on one whole node
(templates/bench/slurm.sh.j2), with the placement options a NUMA machine needs."""
from moagen.errors import MoagenError


def script(cores, numa_nodes=1, time="01:00:00", partition=None) -> str:
    from moagen.codegen.printer import render
    if cores < 1 or numa_nodes < 1:
        raise MoagenError("--cores and --numa-nodes must be at least 1")
    return render("bench/slurm.sh.j2", cores=cores, numa_nodes=numa_nodes, time=time,
                  partition=partition)


def main(args):
    from moagen.files import write_text
    text = script(args.cores, args.numa_nodes, args.time, args.partition)
    if args.output:
        write_text(args.output, text)
        args.output.chmod(0o755)
    else:
        print(text, end="")
