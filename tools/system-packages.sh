#!/usr/bin/env bash
# The system packages moagen needs on a fresh Debian or Ubuntu machine, each group with what
# needs it. Python's own dependencies are pinned in setup.cfg and installed into .venv by make.
# Run as root (or with sudo); `make system-packages` runs it.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
install() { $SUDO apt-get install -y -qq "$@"; }

$SUDO apt-get update -qq
# the compilers: C (gcc, cffi), Fortran (gfortran, f90wrap), C++ (the CUDA emulation on the host)
install gfortran g++
# OpenACC C and Fortran: gcc's nvptx offloading (make build-openacc, docs/OPENACC.md)
install gcc-12-offload-nvptx
# MPI and a single-node Slurm: the distributed kernels and the Slurm test
# (make verify-ranks, tests/test_ranks.py, tests/test_slurm_real.py)
install openmpi-bin libopenmpi-dev slurmctld slurmd slurm-client munge
# valgrind: the cost model's cachegrind checks (moagen cost --measure, tests/test_cost.py)
install valgrind
