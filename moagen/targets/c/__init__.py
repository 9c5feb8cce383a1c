"""C99 with OpenMP: the printer, the build (gcc, a shared library), the loader (cffi) and the
file skeleton; target.py registers them."""
