"""The warp reductions of a tiled CUDA nest as IR statements (LaneReduce): after a thread
loop along x, each local its body accumulates and that is defined outside it (a row's max
over the keys its lanes took) is combined across the lanes that took its iterations, so
that every lane holds the total; the printer prints each as its shuffles."""
from dataclasses import replace

from moagen.onf.loops import (ONF, LaneReduce, Let, Loop, Update, enclose, grid_chain,
                              is_block_copy, is_thread_loop, loop_key)


def insert_lane_reductions(onf: ONF) -> ONF:
    """onf with a LaneReduce after each thread loop along x of a tiled nest for each local
    it accumulates across its lanes."""
    nests = []
    for nest in onf.nests:
        grid, body = grid_chain(nest)
        if grid:
            nest = replace(nest, body=enclose(grid, _block(body, {}, ())[0]))
        nests.append(nest)
    return replace(onf, nests=tuple(nests))


def _block(stmts, defined, around):
    """(stmts with their lane reductions; (local, op, the thread loops of its definition)
    of each update inside). defined: each local's thread loops (keys) at its latest
    definition so far, in the order the statements run."""
    out, updates = [], []
    for s in stmts:
        if isinstance(s, Let):
            defined[s.name] = around
        elif isinstance(s, Update) and s.name in defined:  # a local of the nest's
            updates.append((s.name, s.op, defined[s.name]))
        if not isinstance(s, Loop) or is_block_copy(s):
            out.append(s)
            continue
        inner = around + ((loop_key(s),) if is_thread_loop(s) else ())
        body, inside = _block(s.body, defined, inner)
        out.append(replace(s, body=tuple(body)))
        updates += inside
        if is_thread_loop(s) and s.gpu.axis == "x":
            partial = {name: op for name, op, keys in inside if loop_key(s) not in keys}
            out += [LaneReduce(name, op, s.gpu.threads) for name, op in partial.items()]
    return out, updates
