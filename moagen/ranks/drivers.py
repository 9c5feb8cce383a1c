"""The rank layer printed in C (c_driver.py) and in Fortran (fortran_driver.py): one driver
function per distributed kernel and dtype, with the ABI of moagen.onf.signature plus a leading
communicator (its Fortran handle, MPI_Comm_c2f, as an int64: what mpi4py's Comm.py2f gives
and what both languages take). It calls the rank-local kernels printed beside it and moves
blocks with MPI's own calls. Its steps are written once (driver_steps.py) in the statements
of dialect.py, which each language prints. Here: the names and numbers the steps use (names,
element counts, the ring's slots, which blocks a zigzag step computes, the comment above
each driver)."""
import sympy

from moagen.onf.signature import DTYPE_SUFFIX


def driver_name(mapping, dtype) -> str:
    return f"{mapping.function}_{DTYPE_SUFFIX[dtype]}"


def _element_count(shape) -> str:
    return str(sympy.prod(shape)).replace("**", "^")


def block_counts(mapping, dtype) -> dict:
    """Elements of each block that travels or is merged (zigzag: of each chunk of the
    rank's own arrays), by array name."""
    local = mapping.local_signature(dtype)
    shape = {a.name: a.shape for a in local.arrays}
    names = mapping.travel + mapping.merged
    if mapping.pattern == "owner":
        names = tuple(dict.fromkeys(names + tuple(a.name for a in local.outputs)))
    if mapping.chunks == 2:
        names = tuple(a.name for a in local.inputs + local.outputs)
    return {x: _element_count(shape[x]) for x in names}


def travelling(mapping, x):
    """The elements of x's block that travel (zigzag: both its chunks)."""
    return f"{mapping.chunks} * {x}_count" if mapping.chunks > 1 else f"{x}_count"


def slot(mapping, x, which):
    """The element offset of a slot of the ring's buffer of x."""
    return f"{which} * {travelling(mapping, x)}"


def zigzag_blocks(mapping):
    """Which blocks a zigzag step computes: (kernel role, query chunk, key chunk, merged),
    for step 0, then for blocks from a lower rank, then from a higher one."""
    return {"step == 0": (("diagonal", 0, 0, False), ("diagonal", 1, 1, False), ("local", 1, 0, True)),
            "source < rank": (("local", 0, 0, True), ("local", 1, 0, True)),
            "": (("local", 1, 0, True), ("local", 1, 1, True))}


def comment_lines(mapping):
    if mapping.pattern == "owner":
        return [f"{mapping.name}: {mapping.local} ({mapping.variant}) over MPI ranks in owner "
                f"form, {mapping.lifted} rows a rank.",
                f"Rank r keeps its query rows; {', '.join(mapping.travel)} of one key block travel "
                "together: each step adds the block's dQ into the rank's and its "
                f"{', '.join(mapping.carried)} into the travelling sums, which go on to rank "
                "r + 1 after the step; one more pass brings them home."]
    if mapping.pattern == "zigzag":
        return [f"{mapping.name}: causal attention over MPI ranks, the sequence cut into "
                f"2 x ranks chunks of {mapping.lifted} rows; rank r holds chunks r (low) and "
                "2 ranks - 1 - r (high).",
                "At step t it holds the K, V chunks of rank s = (r - t) mod ranks (they go to "
                f"rank r + 1 while the step computes): s = r, {mapping.diagonal} on low x low "
                f"and high x high, {mapping.local} on high x low; s < r, {mapping.local} on "
                f"low and high x s's low; s > r, {mapping.local} on high x both of s's. Each "
                "block's (O, lse) is merged into its query chunk's by the logsumexp rule."]
    if mapping.pattern == "ring":
        return [f"{mapping.name}: {mapping.local} ({mapping.variant}) over MPI ranks, "
                f"{mapping.lifted} = ranks x {mapping.lifted} per rank.",
                f"Rank r holds its query rows; at step t it uses key block (r - t) mod ranks; "
                f"{', '.join(mapping.travel)} go to rank r + 1 while the step computes, and each "
                f"step's (O, lse) is merged into the running one by the logsumexp rule."]
    return [f"{mapping.name}: {mapping.local} ({mapping.variant}) over MPI ranks, the cache's "
            f"rows cut over them ({mapping.lifted} rows per rank, {mapping.empty_when_zero} of "
            f"them valid).",
            "Each rank's partial (O, lse) goes to every rank (MPI_Allgather); the parts are "
            "merged by the logsumexp rule."]
