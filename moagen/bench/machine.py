"""What machine a benchmark ran on, read from /proc and /sys (Linux): CPU model, cores,
NUMA nodes and caches, plus compilers and flags (moagen.targets.toolchain.Toolchain) and library
versions. Stored with every run, so results from two machines are never mixed up."""
import os
import platform
from pathlib import Path

from moagen.tuning import cpu_model

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")


def _read(path, default=""):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


def cpus_of(listing: str):
    """'0-3,8' -> [0, 1, 2, 3, 8] (the kernel's cpulist format)."""
    cpus = []
    for part in filter(None, listing.split(",")):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def topology() -> dict:
    """Sockets, physical cores, logical CPUs, NUMA nodes (with their CPUs) and caches."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = {(_read(SYS_CPU / f"cpu{c}/topology/physical_package_id", "0"),
              _read(SYS_CPU / f"cpu{c}/topology/core_id", str(c))) for c in cpus}
    nodes = {p.name: cpus_of(_read(p / "cpulist")) for p in sorted(SYS_NODE.glob("node[0-9]*"))}
    caches = []
    for index in sorted((SYS_CPU / "cpu0/cache").glob("index*")):
        caches.append(dict(level=int(_read(index / "level", "0")), type=_read(index / "type"),
                           size=_read(index / "size"),
                           shared_by=len(cpus_of(_read(index / "shared_cpu_list", "0")))))
    return dict(logical_cpus=len(cpus), cores=len(cores), sockets=len({s for s, _ in cores}),
                numa_nodes=nodes or {"node0": cpus}, caches=caches)


def describe() -> dict:
    import numpy
    import torch

    from moagen.targets.toolchain import Toolchain
    return dict(host=platform.node(), cpu=cpu_model(), **topology(), os=platform.platform(),
                python=platform.python_version(), numpy=numpy.__version__,
                torch=torch.__version__, toolchain=Toolchain().describe())


def summary(machine: dict) -> str:
    """One line: the CPU, its cores and NUMA nodes, and the CPU languages' compilers (C and
    Fortran)."""
    from moagen.targets import get_target, of_kind
    records = [machine["toolchain"][get_target(lang).toolchain] for lang in of_kind("cpu")]
    return (f"{machine['cpu']}, {machine['cores']} cores ({machine['logical_cpus']} CPUs), "
            f"{len(machine['numa_nodes'])} NUMA node(s); "
            + "; ".join(f"{r['version']} {' '.join(r['flags'])}" for r in records))
