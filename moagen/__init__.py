"""moagen: Mathematics of Arrays specifications of transformer kernels, turned into
verified C (OpenMP), Fortran (OpenMP) and CUDA."""

__version__ = "0.1.0"


def __getattr__(name):
    # `moagen.load` without importing the whole pipeline on `import moagen`
    if name == "load":
        from moagen.runtime import load
        return load
    raise AttributeError(f"module 'moagen' has no attribute {name!r}")
