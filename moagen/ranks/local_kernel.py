"""A distributed kernel's rank-local kernel, loaded on one process with inputs at a rank's
block: what the cost model's measured rate (moagen.cost.ranks) and the measurement on the
ranks of an MPI job (moagen.ranks.bench) time."""
from moagen import runtime
from moagen.kernels import get_kernel
from moagen.verify import call_scalars, make_inputs


def local_kernel(mapping, sizes, lang, dtype, rng):
    """(the loaded kernel, random inputs at `sizes`, its scalars), a call being
    kernel(*inputs, **scalars)."""
    scalars = call_scalars(mapping.local, sizes)
    inputs = make_inputs(mapping.local_signature(dtype), sizes, scalars,
                         get_kernel(mapping.local).check, rng)
    return runtime.load(mapping.local, mapping.variant, lang, dtype, tuned=False), inputs, scalars
