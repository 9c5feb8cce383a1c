"""Fortran with OpenMP: the printer, the build (gfortran, f90wrap and f2py, an extension
module), the loader and the module skeleton; target.py registers them."""
