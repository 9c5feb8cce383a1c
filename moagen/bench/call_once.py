"""Call one exported kernel function once, by symbol, from a shared library, on random
arrays: the process callgrind runs. It imports numpy and ctypes only, so that valgrind
spends its time in the kernel rather than in imports.

argv[1]: {"library", "symbol", "arrays": [element counts], "sizes": [int], "scalars": [float]}
"""
import ctypes
import json
import sys

import numpy as np


def main(job):
    library = ctypes.CDLL(job["library"])
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(count) for count in job["arrays"]]
    function = getattr(library, job["symbol"])
    function(*(a.ctypes.data_as(ctypes.c_void_p) for a in arrays),
             *(ctypes.c_int64(s) for s in job["sizes"]), *(ctypes.c_double(x) for x in job["scalars"]))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
