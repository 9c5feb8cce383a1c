"""C built into a shared library that cffi opens."""
from moagen.targets.toolchain import INSTALL_C, Toolchain, require, shared_library


def build_c(source, stem, toolchain=None):
    """Build C source into a shared library (for cffi dlopen); returns its path."""
    tc = toolchain or Toolchain()

    def command(src, library):
        cc = require(tc.cc, "C compiler", INSTALL_C)
        return [cc, *tc.cflags, "-o", str(library), str(src), *tc.cldflags]

    return shared_library(source, stem, "c", ("c", source, tc.cc, tc.cflags, tc.cldflags), command)
