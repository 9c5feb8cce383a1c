"""The distributed kernels (moagen.ranks) run for real under mpirun on loopback
(oversubscribed where the machine has fewer cores), against numpy and the single-process
kernels; a rank with other sizes, a stuck rank and a dead one end the job with an error,
never a hang. The whole sweep (P = 1..4, C and Fortran, both dtypes) is `make verify-ranks`."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moagen.targets.c.printer import emit_c
from moagen.onf.signature import signature
from moagen.ranks.merge import merge_onf
from moagen.targets import get_target

ROOT = Path(__file__).resolve().parent.parent
MPI_ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _mpi_missing():
    if shutil.which("mpirun") is None or shutil.which("mpicc") is None:
        return "OpenMPI is not installed (tools/system-packages.sh installs openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pinned in setup.cfg)"
    return None


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))


def mpirun(ranks, *args, timeout=240):
    return subprocess.run(["mpirun", "--oversubscribe", "-np", str(ranks), sys.executable, *args],
                          cwd=ROOT, env=MPI_ENV, capture_output=True, text=True, timeout=timeout)


def test_merge_is_the_logsumexp_rule():
    """The merge kernel (C) against numpy's logaddexp, a part with no keys included."""
    onf = merge_onf()
    target = get_target("c")
    kernel = target.bind(target.library(emit_c([("float64", onf)], ["test"]), "lse_merge_test"),
                         signature(onf, "float64"))
    rng = np.random.default_rng(1)
    parts, batch, heads, n, d = 3, 2, 3, 5, 7
    O_part = rng.standard_normal((parts, batch, heads, n, d))
    lse_part = rng.standard_normal((parts, batch, heads, n)) * 4
    lse_part[1, 0, 1] = -np.inf  # an empty part: weighs nothing
    O_part[1, 0, 1] = 0
    O, lse = kernel(O_part, lse_part)
    expected_lse = np.logaddexp.reduce(lse_part, axis=0)
    expected_O = np.sum(np.exp(lse_part - expected_lse)[..., None] * O_part, axis=0)
    assert np.max(np.abs(lse - expected_lse)) < 1e-13
    assert np.max(np.abs(O - expected_O)) < 1e-13


@needs_mpi
def test_causal_ring_and_owner_backward_on_three_ranks():
    """An odd number of ranks: the zigzag's chunk pairs and the slot the owner's sums come
    home in depend on it. C here; every kernel in both languages on 2 ranks runs in the
    Slurm job (tests/test_slurm_real.py), and P = 1..4 in `make verify-ranks`."""
    done = mpirun(3, "-m", "moagen.cli", "verify", "--ranks", "ring_attention_fwd_causal",
                  "ring_attention_bwd", "--lang", "c", "--dtype", "float64")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 passed, 0 failed on 3 ranks" in done.stdout, done.stdout


@needs_mpi
def test_other_sizes_on_one_rank_refused_on_every_rank():
    done = mpirun(2, "tests/mpi_scenarios.py", "mismatch", "fortran", timeout=120)
    assert done.returncode != 0
    for rank in (0, 1):
        assert (f"rank {rank} refused: ring_attention_fwd_online_f64: the ranks were given "
                f"different sizes") in done.stdout, done.stdout
    assert "rank 1: batch=1 heads=2 n=5 d=8 scale=0.5" in done.stdout


@needs_mpi
def test_stuck_rank_aborts_the_job_at_the_deadline():
    done = mpirun(2, "tests/mpi_scenarios.py", "stuck", "c", timeout=120)
    assert done.returncode == 124, done.stdout + done.stderr
    assert ("rank 0 of 2: ring_attention_fwd_online_f64 did not finish within 5 s"
            in done.stderr), done.stderr


@needs_mpi
def test_dead_rank_ends_the_job():
    done = mpirun(2, "tests/mpi_scenarios.py", "dies", "c", timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "rank 0 finished" not in done.stdout
    assert "exited with non-zero status" in done.stderr, done.stderr
