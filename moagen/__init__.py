"""moagen: Mathematics of Arrays specifications of transformer kernels, turned into
verified C (OpenMP), Fortran (OpenMP) and CUDA."""

__version__ = "0.1.0"
