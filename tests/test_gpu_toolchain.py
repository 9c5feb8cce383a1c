"""The gcc 12 with nvptx offloading that bench/gpu.sh carries to the GPU machine
(tools/openacc-toolchain.sh): its MANIFEST, what it holds, that it builds and runs an
OpenACC program in C and in Fortran from wherever it is unpacked (on the host here: no GPU),
and that it fits the 64 MiB that may travel with the working tree.

The archive is `bench/gpu.sh prepare`'s where it is there; otherwise the script makes one
from Debian's packages at xz level 1 (apt-get download, then xz, most of the time; level 6,
prepare's, took 3.8 minutes on a busy 2-core VM). Level 1's archive is the larger, so the
budget holds for prepare's where it holds for the test's."""
import fcntl
import os
import re
import shutil
import subprocess

import pytest

from moagen.targets.toolchain import OFFLOAD, PROJECT_ROOT

SCRIPT = PROJECT_ROOT / "tools" / "openacc-toolchain.sh"
PREPARED = PROJECT_ROOT / "wheelhouse" / "toolchain" / "gcc12-openacc.tar.xz"
BUDGET = 64 * 2**20  # what travels with the working tree to the device machine, at most


def packages():
    """The script's PACKAGES, comments dropped."""
    body = re.search(r"^PACKAGES=\((.*?)^\)", SCRIPT.read_text(), re.MULTILINE | re.DOTALL)[1]
    return [word for line in body.splitlines() for word in line.split("#")[0].split()]


@pytest.fixture(scope="module")
def archive(run_folder):
    if PREPARED.exists():
        return PREPARED
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb") and shutil.which("xz")):
        pytest.skip("no archive from bench/gpu.sh prepare, and no apt-get, dpkg or xz to make one")
    # one archive a run, which takes most of this file's time: the first worker of
    # pytest-xdist to ask makes it, the others wait on the lock and take it
    folder = run_folder / "toolchain"
    folder.mkdir(exist_ok=True)
    made = folder / "gcc12-openacc.tar.xz"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            try:
                # at the script's own level, so that the budget check weighs what
                # bench/gpu.sh carries (xz -1 is faster but about 5 MiB larger, which no
                # longer fits beside generated/)
                subprocess.run([str(SCRIPT), str(made)], check=True, capture_output=True,
                               timeout=600)
            except BaseException:
                made.unlink(missing_ok=True)  # no half-written archive for the next worker
                raise
    return made


@pytest.fixture(scope="module")
def prefix(archive, tmp_path_factory):
    """The archive unpacked in a fresh folder."""
    folder = tmp_path_factory.mktemp("unpacked")
    subprocess.run(["tar", "-xJf", str(archive), "-C", str(folder)], check=True, timeout=120)
    return folder / "gcc12-openacc"


def manifest(path):
    """package -> (version, deb bytes), and the other `name bytes` lines."""
    table, sizes = {}, {}
    for line in path.read_text().splitlines():
        words = line.split()
        if len(words) == 4 and words[2].isdigit():
            table[words[0]] = (words[1], int(words[2]))
        elif len(words) == 2 and words[1].isdigit():
            sizes[words[0]] = int(words[1])
    return table, sizes


def test_manifest_lists_every_package_and_the_archive_size(archive, prefix):
    table, sizes = manifest(archive.parent / "MANIFEST")
    assert sorted(table) == sorted(packages())
    assert all(re.match(r"\d", version) and deb > 0 for version, deb in table.values())
    assert sizes["archive_bytes"] == archive.stat().st_size
    inside = (prefix / "MANIFEST").read_text()
    assert (archive.parent / "MANIFEST").read_text() == inside + f"archive_bytes {sizes['archive_bytes']}\n"


def test_holds_what_offloading_needs_and_not_what_was_pruned(prefix):
    lib = prefix / "usr/lib/gcc/x86_64-linux-gnu/12"
    accel = lib / "accel/nvptx-none"
    needed = [prefix / "env.sh", prefix / "usr/bin/gcc-12", prefix / "usr/bin/gfortran-12",
              lib / "cc1", lib / "f951", lib / "libgomp.spec", lib / "libgfortran.spec",
              accel / "mkoffload", accel / "lto1", accel / "libm.a", accel / "libgfortran.a",
              accel / "as", accel / "ld",
              prefix / "usr/bin/x86_64-linux-gnu-accel-nvptx-none-gcc-12",
              prefix / "usr/lib/x86_64-linux-gnu/libgomp.so.1",
              prefix / "usr/lib/x86_64-linux-gnu/libgomp-plugin-nvptx.so.1",
              prefix / "usr/lib/x86_64-linux-gnu/libgfortran.so.5"]
    assert [str(p.relative_to(prefix)) for p in needed if not p.exists()] == []
    pruned = [prefix / "usr/share", accel / "mgomp", lib / "lto1", lib / "libasan.a"]
    assert [str(p.relative_to(prefix)) for p in pruned if os.path.lexists(p)] == []
    dangling = [str(p) for p in prefix.rglob("*") if p.is_symlink() and not p.exists()]
    assert dangling == []


def run_with(prefix, command, cwd):
    """`command` (a shell line) with the unpacked toolchain's env.sh sourced."""
    return subprocess.run(["bash", "-c", f"source {prefix}/env.sh && {command}"], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


FORTRAN = """program probe
  implicit none
  integer :: i
  real(8) :: s
  s = 0
  !$acc parallel loop reduction(+:s)
  do i = 1, 1000
    s = s + i
  end do
  print '(a, f0.1)', 'sum ', s
end program
"""


def test_builds_and_runs_openacc_c_and_fortran_where_unpacked(prefix, tmp_path):
    (tmp_path / "probe.f90").write_text(FORTRAN)
    flags = " ".join(OFFLOAD)
    probe = PROJECT_ROOT / "bench" / "openacc_probe.c"
    built = run_with(prefix, f"$CC -O2 -no-pie {flags} {probe} -o c-probe && "
                             f"$FC -O2 -no-pie {flags} probe.f90 -o f-probe && "
                             "ldd c-probe f-probe | grep -E 'libgomp|libgfortran'", tmp_path)
    assert built.returncode == 0, built.stderr
    # both runtimes the unpacked ones (the nvptx plugin must load with its own libgomp)
    assert all(str(prefix) in line for line in built.stdout.splitlines() if "=>" in line)
    ran = run_with(prefix, "ACC_DEVICE_TYPE=host ./c-probe && ACC_DEVICE_TYPE=host ./f-probe",
                   tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "the region ran on the host; sum 499500" in ran.stdout
    assert "sum 500500.0" in ran.stdout
    # the device code is there, for the arch CUDA 13 takes
    assert b".target sm_80" in (tmp_path / "c-probe").read_bytes()


def test_what_travels_fits_the_budget(archive):
    """The tracked files, wheelhouse/ and this archive in it (bench/gpu.sh's header)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT_ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    total = sum((PROJECT_ROOT / name).stat().st_size for name in tracked
                if name and (PROJECT_ROOT / name).is_file())
    wheelhouse = PROJECT_ROOT / "wheelhouse"
    if wheelhouse.is_dir():
        total += sum(p.stat().st_size for p in wheelhouse.rglob("*")
                     if p.is_file() and p != PREPARED)
    total += archive.stat().st_size
    assert total <= BUDGET, f"{total / 2**20:.1f} MiB travel, over {BUDGET / 2**20:.0f} MiB"
