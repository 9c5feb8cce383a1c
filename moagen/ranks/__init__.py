"""Kernels beyond one node: a dimension lifted over MPI ranks (moagen.ranks.mapping), the
rank layer printed in C and Fortran with MPI's calls (drivers), built and bound (library),
called from Python on every rank (run) and verified against numpy and the single-process
kernels under mpirun (verify)."""
