"""f90wrap's Fortran wrappers and f2py's C glue for one kernel, written by one interpreter.

build.py runs this file as a script in the kernel's build folder:
`python wrap.py STEM MODULE SOURCE`. It does what the console scripts `f90wrap -m STEM
SOURCE` and `f2py-f90wrap -m MODULE --lower f90wrap_STEM.f90` do, in turn, so that a build
starts Python and imports numpy once rather than twice. A fresh process still, not the
caller's: f2py-f90wrap patches numpy.f2py's code templates and f2py's crackfortran keeps
module-level state between runs. f90wrap only reads f2py's table of renamed names
(crackfortran.badnames), so f2py starts here as it would in an interpreter of its own.
"""
import sys


def main(stem, module, source):
    """Write f90wrap_<stem>.f90 (and f90wrap's Python module) from `source`, then f2py's
    <module>module.c and its Fortran wrappers from f90wrap's; returns the exit status."""
    from f90wrap.scripts import f2py_f90wrap, main as f90wrap

    sys.argv = ["f90wrap", "-m", stem, source]
    status = f90wrap.main()
    if status:
        return status
    sys.argv = ["f2py-f90wrap", "-m", module, "--lower", f"f90wrap_{stem}.f90"]
    return f2py_f90wrap.main()


if __name__ == "__main__":
    # Run by path, this file's folder heads sys.path: drop it, so that its neighbours
    # (build.py, target.py, ...) cannot shadow a module f90wrap or numpy imports.
    del sys.path[0]
    sys.exit(main(*sys.argv[1:]))
