"""Key blocks for a loop that adds into arrays through scalars computed per key (the
attention backward: per key two dot products, the probability and its gradient from them,
then dQ[i, :] += ds * K[j, :]). The loop's body is three kinds of statements,

    sums:  a local set to a start value, then loops that accumulate into it (a dot product)
    lets:  scalar locals computed from them (an exponential)
    adds:  loops that add into arrays the loop does not index

and KeyBlocks(nest, j, B) runs each kind over a block of B keys before the next starts:

    for j in [s, e): sums(j); lets(j); adds(j)
 -> for j_blk:  for j in block: sums(j); keep what later steps read
                for j in block: lets(j); keep what the adds read
                for j in block: adds(j)

Every local a later step reads is kept in a scratch row per iteration of the loops around
(min(n, B) values, in L1; moagen.onf.loops.scratch_row says why min), as the online
softmax keeps its scores. The lets of a block are then one loop of scalar code, which the
compiler vectorizes, exponentials included (one library call per key before), and the adds
one loop that UnrollSum can take f keys at a time.

Legal as a reordering within each key: the sums read no local of the lets, and statements
of different keys touch different elements (UnrollSum's condition: the summed arrays are
not read in the loop, every other array stored is indexed by j). The values are the same
bit for bit: every key's arithmetic is unchanged, only the order of keys' steps moves.
"""
from dataclasses import dataclass, replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.loops import (Let, Loop, ONF, Store, Update, loop_vars, names_read,
                              scratch_row, walk)
from moagen.onf.names import claim_loop, kernel_names, loop_role
from moagen.steps.loop.reductions import require_lowered
from moagen.steps.loop.unroll import check_sum_only, summed_arrays
from moagen.steps.step import Step


@dataclass(frozen=True)
class KeyBlocks(Step):
    nest: str
    loop: str
    block: int

    @property
    def blocks(self) -> str:
        """The loop over blocks of keys it creates (i_blk)."""
        return loop_role(self.loop, "blk")

    def __call__(self, onf: ONF) -> ONF:
        if self.block < 2:
            raise ScheduleError(f"{self}: a block holds at least two keys")
        nest = self.nest_called(onf)
        require_lowered(nest, self)  # the dot products as loops, to be steps of their own
        names, temps, found = kernel_names(onf), [], []
        body = self._rewrite(nest.body, (), names, temps, found)
        if not found:
            raise ScheduleError(f"{self}: nest {self.nest} has no loop over {self.loop} that "
                                "adds into array elements it does not index")
        nests = [replace(n, body=body) if n is nest else n for n in onf.nests]
        return replace(onf.with_nests(nests, str(self)), temps=onf.temps + tuple(temps))

    def _rewrite(self, stmts, loops, names, temps, found):
        out = []
        for s in stmts:
            summed = summed_arrays(s) if isinstance(s, Loop) and s.var.name == self.loop \
                else set()
            if summed:
                check_sum_only(self, s, summed)
                out.append(self._blocks(s, loops, names, temps))
                found.append(s)
            elif isinstance(s, Loop):
                out.append(replace(s, body=self._rewrite(s.body, loops + (s,), names, temps,
                                                         found)))
            else:
                out.append(s)
        return tuple(out)

    def _blocks(self, loop, loops, names, temps):
        sums, lets, adds = self._steps(loop.body)
        size, j, row = self.block, loop.var, tuple(lp.var for lp in loops)
        scope = {lp.var.name for lp in loops} | loop_vars((loop,))
        block = claim_loop(names, self.blocks, scope, self)
        first = loop.start + size * block
        key = row + (j - first,)

        def kept(step, later):
            """The locals step declares that the later steps read, each with a scratch row."""
            read = names_read(later)
            return {s.name: scratch_row(self, f"{s.name}_block", loops, loop, size, names,
                                        temps)[0]
                    for s in step if isinstance(s, Let) and s.name in read}

        from_sums, from_lets = kept(sums, lets + adds), kept(lets, adds)
        keep = lambda scratch: tuple(Store(a, key, S.Local(x)) for x, a in scratch.items())
        reload = lambda scratch, step: tuple(Let(x, S.Access(a, key))
                                             for x, a in scratch.items() if x in names_read(step))
        each_key = lambda *stmts: Loop(j, first, sympy.Min(loop.stop, first + size), stmts)
        steps = (each_key(*sums, *keep(from_sums)),
                 each_key(*reload(from_sums, lets), *lets, *keep(from_lets)),
                 each_key(*reload({**from_sums, **from_lets}, adds), *adds))
        count = idiv(loop.stop - loop.start + size - 1, size)
        return Loop(block, sympy.Integer(0), count, steps)

    def _steps(self, body):
        """(sums, lets, adds) of a key's statements, each in its order."""
        sums, lets, adds = [], [], []
        pos = 0
        while pos < len(body):
            s = body[pos]
            own = _accumulating_loops(body, pos)
            if isinstance(s, Let) and own:
                sums += [s, *own]
                pos += 1 + len(own)
                continue
            if isinstance(s, Let):
                lets.append(s)
            elif isinstance(s, Loop) and any(isinstance(x, Store) for x in walk(s.body)):
                adds.append(s)
            else:
                raise ScheduleError(f"{self}: a statement per key is none of a dot product, a "
                                    "scalar or a loop adding into arrays")
            pos += 1
        if {s.name for s in lets} & names_read(sums):
            raise ScheduleError(f"{self}: a dot product reads a scalar computed before it: "
                                "they cannot run in a step of their own")
        return tuple(sums), tuple(lets), tuple(adds)


def _accumulating_loops(body, pos):
    """The loops right after body[pos] that only accumulate into the local it declares."""
    if not isinstance(body[pos], Let):
        return []
    name, own = body[pos].name, []
    for s in body[pos + 1:]:
        leaves = [x for x in walk(s.body) if not isinstance(x, Loop)] \
            if isinstance(s, Loop) else None
        if not leaves or any(not (isinstance(x, Update) and x.name == name and x.op != "=")
                             for x in leaves):
            break
        own.append(s)
    return own
