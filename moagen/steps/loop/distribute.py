"""Distribute: one loop per array a loop adds into."""
from dataclasses import dataclass, replace
from typing import Optional

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Let, Loop, Store, rewrite_loops, stmt_exprs, walk
from moagen.steps.loop.fusion import independent
from moagen.steps.step import NotApplicable, Step


@dataclass(frozen=True)
class Distribute(Step):
    """Loop distribution: a loop over `var` whose body only adds into several arrays (the
    owner's key rows' pass: dK[j, c] += .., dV[j, c] += .., dQ[i, c] += .. in one loop over c)
    becomes one loop per array, each with that array's additions in their order. Each loop
    keeps fewer values live: the jammed key rows' pass weighed its rows by 32 scalars and
    read 12 rows in one loop, with 16 vector registers; the compiler spilled the scalars and
    reloaded one for each use. The body may begin with locals (the weights of the rows a
    step sums); each loop takes those its additions read, so a loop over query rows holding
    one loop over c per array becomes loops over the query rows that ColumnTiles can tile.
    The values are the same bit for bit: every element gets the same additions in the same
    order. Legal when no array's additions read an array another's store, and the locals
    read no array the loop stores."""
    var: str
    nest: Optional[str] = None

    def rewrite_nest(self, nest, names):
        body, count = rewrite_loops(nest.body, self._selects, lambda loop, scope: self._split(loop))
        if not count:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop over {self.var} that "
                                "only adds into several arrays")
        return body

    def _selects(self, loop):
        """A loop over `var` whose body, after its locals, only adds into several arrays."""
        if loop.var.name != self.var:
            return False
        lets = sum(isinstance(s, Let) for s in loop.body)
        arrays = [_added_into(s) for s in loop.body[lets:]]
        return bool(arrays) and None not in arrays and len(set(arrays)) > 1

    def _split(self, loop):
        lets = [s for s in loop.body if isinstance(s, Let)]
        adds = loop.body[len(lets):]
        arrays = [_added_into(s) for s in adds]
        groups = [[s for s, a in zip(adds, arrays) if a == array]
                  for array in dict.fromkeys(arrays)]
        alone = [replace(loop, body=tuple(group)) for group in groups]
        if not all(independent(a, b) for pos, a in enumerate(alone) for b in alone[pos + 1:]):
            raise ScheduleError(f"{self}: the additions into {', '.join(dict.fromkeys(arrays))} "
                                f"in one loop over {loop.var} read each other's arrays")
        stored = {"@" + array for array in arrays}
        if any(S.free_names(let.value) & stored for let in lets):
            raise ScheduleError(f"{self}: a local of the loop over {loop.var} reads an array "
                                "the loop adds into")
        return tuple(replace(loop, body=tuple(_lets_read(lets, group)) + tuple(group))
                     for group in groups)


def _added_into(stmt):
    """The one array a statement only adds into (a store, or a loop of them), or None."""
    stores = [s for s in walk([stmt]) if not isinstance(s, Loop)]
    if not all(isinstance(s, Store) and s.accumulate for s in stores):
        return None
    arrays = {s.array for s in stores}
    return arrays.pop() if len(arrays) == 1 else None


def _lets_read(lets, stmts):
    """The lets, in their order, that stmts read (directly or through later lets)."""
    wanted = set().union(*(S.free_names(x) for s in walk(stmts) for x in stmt_exprs(s)))
    kept = []
    for let in reversed(lets):
        if let.name in wanted:
            kept.append(let)
            wanted |= S.free_names(let.value)
    return reversed(kept)
