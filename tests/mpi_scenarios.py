"""Run under mpirun by tests/test_ranks.py: ring_attention_fwd on 2 ranks where one rank
misbehaves. argv: scenario (mismatch, dtype, dies, stuck), language."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from moagen.ranks.run import RankKernel

scenario, lang = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
# a stuck rank is waited for 5 s; elsewhere the deadline only has to outlast a loaded machine
kernel = RankKernel("ring_attention_fwd", lang, "float64", comm,
                    timeout=5 if scenario == "stuck" else 120)
rows = 4 + (scenario == "mismatch" and rank == 1)  # rank 1 holds a longer block
dtype = np.float32 if scenario == "dtype" and rank == 1 else np.float64
Q, K, V = (np.ones((1, 2, rows, 8), dtype) for _ in range(3))
if rank == 1 and scenario == "dies":
    os._exit(3)
if rank == 1 and scenario == "stuck":
    time.sleep(60)
try:
    kernel(Q, K, V, scale=0.5)
except ValueError as error:
    print(f"rank {rank} refused: {error}", flush=True)
    sys.exit(2)
print(f"rank {rank} finished", flush=True)
