"""The mapping of a nest's outermost loops onto threads: OpenMP's parallel loops on the CPU
(Parallel), a GPU thread per iteration (GpuThreads)."""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import sympy

from moagen.errors import ScheduleError
from moagen.moa.expr import simplified
from moagen.onf.loops import Let, Loop, ONF, Store, Update, perfect_chain, tails, walk
from moagen.onf.names import kernel_names
from moagen.steps.step import Step, flag, shown


@dataclass(frozen=True)
class Parallel(Step):
    """Run the outermost perfectly nested loops `vars` in parallel (an OpenMP `collapse`
    on the CPU). Legal only when every store inside is indexed by all of them and no local
    defined outside them is updated inside. The nest's tails (rows.edge: the rows past the
    last full tile) run in parallel too, over the same loops under their names there (i for
    i_tile), where they start with them; a tail that does not needs a Parallel of its own.
    interleave: the CPU threads take the iterations in turn rather than a block each, so
    that they work on neighbouring iterations at the same time (attention's query row
    groups of one head: the threads share that head's keys in the last-level cache)."""
    vars: Tuple[str, ...]
    nest: Optional[str] = None
    interleave: bool = flag("interleaved")
    layer = "mapping"

    def __call__(self, onf: ONF) -> ONF:
        onf = super().__call__(onf)
        if self.nest is None:
            return onf
        names, inherited = kernel_names(onf), {}
        for tail, renames in tails(onf, self.nest):
            own = replace(self, vars=tuple(renames.get(v, v) for v in self.vars), nest=tail.label)
            chain = perfect_chain(tail.body, len(own.vars))
            if chain and [lp.var.name for lp in chain] == list(own.vars) and \
                    not any(isinstance(s, Loop) and s.parallel for s in walk(tail.body)):
                inherited[tail.label] = own.rewrite_nest(tail, names)
        return replace(onf, nests=tuple(replace(n, body=inherited[n.label])
                                        if n.label in inherited else n for n in onf.nests))

    def rewrite_nest(self, nest, names):
        chain = perfect_chain(nest.body, len(self.vars))
        if not chain or [lp.var.name for lp in chain] != list(self.vars):
            raise ScheduleError(f"{self}: nest {nest.label} does not start with the perfectly "
                                f"nested loops {', '.join(self.vars)}")
        check_rectangular(self, chain)
        inner = chain[-1].body
        lets = {s.name for s in walk(inner) if isinstance(s, Let)}
        blocks = {s.var: _block_owner(s) for s in walk(inner) if isinstance(s, Loop)}
        for s in walk(inner):
            if isinstance(s, Store) and not s.atomic:
                used = set().union(*(sympy.sympify(i).free_symbols for i in s.index))
                used |= {blocks[v] for v in used if blocks.get(v) is not None}
                missing = [lp.var.name for lp in chain if lp.var not in used]
                if missing:
                    raise ScheduleError(f"{self}: store to {s.array} is not indexed by "
                                        f"{', '.join(missing)}: parallel iterations would race")
            if isinstance(s, Update) and s.name not in lets:
                raise ScheduleError(f"{self}: {s.name} is shared by parallel iterations")
        return (self.mark(chain[0], len(chain)),)

    def mark(self, loop: Loop, count: int) -> Loop:
        return replace(loop, parallel=count, interleave=self.interleave)


@dataclass(frozen=True)
class GpuThreads(Parallel):
    """The CUDA mapping of parallel loops: one GPU thread per iteration of `vars`, `block`
    threads a thread block (the iterations in order, the innermost loop fastest, so that
    neighbouring threads touch neighbouring elements). The same legality as Parallel."""
    block: int = shown("{block} a block", 128)

    def mark(self, loop: Loop, count: int) -> Loop:
        if self.interleave or self.block < 1:
            raise ScheduleError(f"{self}: a thread block holds at least one thread, and GPU "
                                "threads are not dealt in turns")
        return replace(loop, parallel=count, threads=self.block)


def _block_owner(loop):
    """The variable v whose iterations own disjoint blocks of this loop, if its range is
    [T*v + a, at most T*v + a + T) with T free of v (a block's rows; T = 0 or less leaves
    the range empty): a store indexed by the loop is then indexed by v as far as races go.
    None otherwise."""
    for v in loop.start.free_symbols:
        step = sympy.diff(loop.start, v)
        if step == 0 or v in step.free_symbols or loop.start.diff(v, 2) != 0:
            continue
        ends = loop.stop.args if isinstance(loop.stop, sympy.Min) else (loop.stop,)
        if any(simplified(end - loop.start - step).is_nonpositive for end in ends):
            return v
    return None


def check_rectangular(transform, chain):
    """ScheduleError unless no loop of a parallel chain has bounds that depend on another of
    its loops."""
    chain_vars = {lp.var for lp in chain}
    for lp in chain:
        if (lp.start.free_symbols | lp.stop.free_symbols) & chain_vars:
            raise ScheduleError(f"{transform}: the bounds of {lp.var} depend on another parallel "
                                f"loop; the parallel iteration space must be rectangular")
