"""VectorLoads: a thread's tile of an input row read by 16-byte vector loads."""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import ONF, Let, Loop, is_thread_loop, map_stmt_exprs, stmt_exprs, walk
from moagen.onf.names import kernel_names
from moagen.steps.step import Step

# the elements of a thread's tile one vector load path takes: one float4 in float32, two
# double2 in float64 (16 bytes a load, the widest a thread's global load has)
VECTOR_TILE = 4


@dataclass(frozen=True)
class VectorLoads(Step):
    """Each thread's tile of `arrays` (inputs, row major) along the thread loop over `loop`
    read into its registers once per row, VECTOR_TILE consecutive elements at a time by
    vector loads (TVM's cache_read into registers, then vectorize): in every statement list,
    the thread loops over `loop` that read the same row of an array share one loop of loads
    put before the first of them (`<array>_row = <array>[..., loop]`, marked vector), their
    reads that local. Preconditions (what makes a vector load aligned): each read's last
    index is the loop's variable, the loop runs over [0, the array's last dimension) in
    tiles of VECTOR_TILE, and no other index reads the variable. A tile's first element is
    then a multiple of VECTOR_TILE into the row, and the row's first a multiple of the last
    dimension into the array: the loads are aligned where that dimension is a multiple of
    VECTOR_TILE and the arrays start 16-byte aligned, which the launch checks, running the
    kernel's scalar-load instance otherwise (moagen.targets.cuda.tiled)."""
    arrays: Tuple[str, ...]
    loop: str
    nest: Optional[str] = None
    layer = "mapping"

    def __call__(self, onf: ONF) -> ONF:
        inputs = {b.name: b for b in onf.inputs}
        missing = [a for a in self.arrays if a not in inputs]
        if missing or onf.layout != "row":
            raise ScheduleError(f"{self}: vector loads read row-major inputs; "
                                f"{', '.join(missing) or onf.layout + ' layout'} is not one")
        rows = {a: inputs[a].shape[-1] for a in self.arrays}
        nest = self.nest_called(onf)
        names, count = kernel_names(onf), [0]
        body = self._stage(nest.body, rows, names, count)
        if not count[0]:
            raise ScheduleError(f"{self}: nest {nest.label} has no thread loop over {self.loop} "
                                f"reading {', '.join(self.arrays)}")
        return onf.with_nests([replace(n, body=body) if n is nest else n for n in onf.nests],
                              str(self))

    def _reads(self, loop, rows):
        """The reads of `arrays` in the thread loop, each checked against the preconditions."""
        reads = [x for s in walk(loop.body) for e in stmt_exprs(s) for x in S.subexpressions(e)
                 if isinstance(x, S.Access) and x.array in self.arrays]
        for x in reads:
            row = rows[x.array]
            if loop.gpu.tile != VECTOR_TILE or loop.gpu.fragment or loop.start != 0 \
                    or sympy.simplify(loop.stop - row) != 0:
                raise ScheduleError(f"{self}: the thread loop over {self.loop} in [{loop.start}, "
                                    f"{loop.stop}) takes tiles of {loop.gpu.tile}; vector loads "
                                    f"of {x.array} need [0, {row}) in tiles of {VECTOR_TILE}")
            if x.index[-1] != loop.var or any(loop.var in sympy.sympify(i).free_symbols
                                              for i in x.index[:-1]):
                raise ScheduleError(f"{self}: {x.array}[{', '.join(map(str, x.index))}] is not "
                                    f"a row read along {self.loop}")
        return reads

    def _stage(self, stmts, rows, names, count):
        out, local = [], {}  # (array, index) -> its local
        for s in stmts:
            if not isinstance(s, Loop):
                out.append(s)
                continue
            if not (is_thread_loop(s) and s.var.name == self.loop):
                out.append(replace(s, body=self._stage(s.body, rows, names, count)))
                continue
            for x in self._reads(s, rows):
                key = (x.array, x.index)
                if key not in local:
                    local[key] = names.claim(names.new(f"{x.array}_row"))
                    out.append(replace(s, body=(Let(local[key], x),),
                                       gpu=replace(s.gpu, vector=True)))
                    count[0] += 1

            def read(e):
                if isinstance(e, S.Access) and (e.array, e.index) in local:
                    return S.Local(local[e.array, e.index])
                return S.map_children(e, read)

            out.append(map_stmt_exprs(s, read))
        return tuple(out)
