"""`moagen slurm --ring` submitted to a real Slurm: munged, slurmctld and slurmd started here
(tests/slurm_cluster.py), the generated job run with `sbatch --wait` on 2 ranks (mpirun
under the allocation), its output checked: ring attention verified in C and Fortran, and
measured next to its prediction. The job verifies the kernel it measures, not every
distributed kernel (tests/test_ranks.py verifies each under mpirun; the job generated
without --verify verifies them all)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moagen.bench import slurm
from moagen.ranks.verify import SIZES
from tests.slurm_cluster import missing, single_node_slurm
from tests.test_ranks import MPI_ENV, needs_mpi

ROOT = Path(__file__).resolve().parent.parent


@needs_mpi
@pytest.mark.skipif(bool(missing()), reason=missing() or "")
def test_generated_ring_job_runs_under_slurm(tmp_path):
    work = tmp_path / "submit"
    work.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(work, 0o777)  # the job writes its output and results here
    job = work / "ring.sh"
    job.write_text(slurm.ring_script(nodes=1, cores=os.cpu_count(), numa_nodes=1,
                                     ranks_per_numa=2, time="00:10:00", python=sys.executable,
                                     ring_n=256, verify=("ring_attention_fwd",)))
    with single_node_slurm() as env:
        done = subprocess.run(["sbatch", "--wait", f"--output={work}/job.out", str(job)],
                              cwd=work, env={**MPI_ENV, **env}, capture_output=True, text=True,
                              timeout=300)
    output = (work / "job.out").read_text() if (work / "job.out").exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + output
    checks = 2 * len(SIZES["ring_attention_fwd"])  # C and Fortran, float64
    assert "2 ranks" in output and f"{checks} passed, 0 failed on 2 ranks" in output, output
    (results,) = (work / "bench-results").glob("ring-*.jsonl")
    record = json.loads(results.read_text().splitlines()[-1])
    assert record["ranks"] == 2 and record["block"]["n"] == 128
    assert record["bytes_sent_per_rank"] == 2 * 128 * 8 * 128 * 8  # K and V blocks, once
    assert record["measured_s"] > 0 and record["predicted_s"] > 0
