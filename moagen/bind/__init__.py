"""Loaders: one module per way a built kernel is loaded (c: cffi, fortran: the f2py
extension, cuda: cffi, on a GPU's memory through cuda-python (cuda_driver), cuda_emulated:
the same for CUDA built to run on the host), each wrapping every exported function in the one KernelCallable interface (abi.py). Which
language loads how is registered in moagen.targets:

    target = moagen.targets.get_target("c")
    scale_rows = target.bind(target.library(source, "scale_rows"), signature, validate)
"""
