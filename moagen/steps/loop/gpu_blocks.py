"""A thread block per iteration: the CUDA mapping where a block's threads cooperate on one
iteration of the parallel loops (RMSNorm: a block per row), rather than a thread each.

GpuBlocks(vars, across="c") gives each iteration of the perfectly nested loops `vars` a
thread block of `threads` threads, and deals the iterations of every loop over `across` in
it among them (thread t takes t, t + threads, ...). What the block's threads then do:

- statements outside those loops run on every thread with the same values (uniform: they
  read what every thread reads); a store there is made by thread 0 alone;
- a loop over `across` runs its iterations on their threads: its stores must be indexed by
  the loop (each element written by one thread), and a local it accumulates (`+` or `max`)
  is each thread's partial, combined after the loop by a block-wide reduction that gives
  every thread the total: each warp's by shuffles, then the warps' totals through
  `__shared__` memory (moagen.targets.cuda.printer, the template's moagen_block_reduce);
- the printer puts a `__syncthreads()` between two statements of the block where the
  second touches an array the first wrote (thread 0's store, read by all; one thread's
  elements, read by another), so that each sees the other's writes; not for an array each
  of whose elements only one thread touches (moagen.targets.cuda.printer.thread_owned).

Sequentially (the ONF interpreter) the mapping changes nothing: one thread takes every
iteration and its partial is the total. The checks below make the concurrent form mean
the same; the CUDA emulation runs it concurrently."""
from dataclasses import dataclass, replace

import sympy

from moagen.cuda_archs import WARP
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Let, Loop, Store, Update, names_read, parallel_chain, walk
from moagen.steps.loop.parallel import GpuThreads
from moagen.steps.step import NotApplicable, hidden, shown

# a block reduction's shuffles take whole warps, and its warps' totals one a lane of a warp
MAX_THREADS = 1024
# the accumulations a block reduction combines (the printer's helpers)
REDUCIBLE = ("+", "max")


@dataclass(frozen=True)
class GpuBlocks(GpuThreads):
    block: int = shown("{block} threads sharing {across}", 128)
    across: str = hidden("c")

    def rewrite_nest(self, nest, names):
        if not WARP <= self.block <= MAX_THREADS or self.block & (self.block - 1):
            raise ScheduleError(f"{self}: a block's threads must be a power of two from {WARP} "
                                f"to {MAX_THREADS} (its reductions shuffle whole warps), got "
                                f"{self.block}")
        (head,) = super().rewrite_nest(nest, names)  # the chain's legality, as for a thread each
        chain = parallel_chain(head)
        shared = []
        inner = tuple(self._share(s, shared) for s in chain[-1].body)
        if not shared:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop over {self.across} "
                                "inside its parallel loops for a block's threads to share")
        body = inner
        for lp in reversed(chain[1:]):
            body = (replace(lp, body=body),)
        return (replace(head, body=body, per_block=True),)

    def _share(self, s, shared):
        """s with its outermost loops over `across` marked shared, each checked."""
        if not isinstance(s, Loop):
            return s
        if s.var.name != self.across:
            return replace(s, body=tuple(self._share(b, shared) for b in s.body))
        self._check_shared(s)
        shared.append(s)
        return replace(s, across_threads=True)

    def _check_shared(self, loop):
        own = {s.name for s in walk(loop.body) if isinstance(s, Let)}
        for s in walk(loop.body):
            if isinstance(s, Store) and not s.atomic and not any(
                    loop.var in sympy.sympify(i).free_symbols for i in s.index):
                raise ScheduleError(f"{self}: the store to {s.array} inside the loop over "
                                    f"{loop.var} is not indexed by it: the block's threads "
                                    "would write the same element")
            if isinstance(s, Update) and s.name not in own:
                if s.op not in REDUCIBLE or s.name in S.free_names(s.value):
                    assign = "=" if s.op == "=" else f"{s.op}="
                    raise ScheduleError(f"{self}: {s.name} {assign} ... inside the loop over "
                                        f"{loop.var} is no sum or max the block's threads can "
                                        "each take a part of")
        accumulated = {s.name for s in walk(loop.body) if isinstance(s, Update)} - own
        read = names_read(loop.body)
        if accumulated & read:
            raise ScheduleError(f"{self}: {', '.join(sorted(accumulated & read))} is read inside "
                                f"the loop over {loop.var} that accumulates it: a thread would "
                                "see its own part, not the total")
