"""The rank layer's driver written once (moagen.ranks.drivers): what each pattern does on a
rank, step by step, in the statements of moagen.ranks.dialect, which the C and the Fortran
dialect print."""
from moagen.ranks.dialect import INT, INT64, Ref
from moagen.ranks.drivers import (block_counts, comment_lines, driver_name, slot, travelling,
                                  zigzag_blocks)


def driver_lines(mapping, dtype, dialect) -> list:
    """The driver of mapping for dtype in `dialect` (a Dialect subclass), as lines."""
    out = dialect(dtype)
    _DriverSteps(mapping, dtype, out).write()
    return out.text()


class _DriverSteps:
    def __init__(self, mapping, dtype, out):
        self.mapping, self.dtype, self.out = mapping, dtype, out
        self.local = mapping.local_signature(dtype)

    def write(self):
        m, out = self.mapping, self.out
        out.open_driver(driver_name(m, self.dtype), comment_lines(m), m.driver_arrays(self.dtype),
                        self.local, rings=[f"{x}_ring" for x in m.travel])
        for x, count in block_counts(m, self.dtype).items():
            out.let(INT64, f"{x}_count", count)
        {"ring": self.ring, "zigzag": self.zigzag, "owner": self.owner,
         "gather": self.gather}[m.pattern]()

    def ring_slot(self, x, which):
        return Ref(f"{x}_ring", slot(self.mapping, x, which))

    @staticmethod
    def chunk(x, high):
        """x's low chunk (all of x outside the zigzag) or its high one."""
        return Ref(x, f"{x}_count" if high else None)

    def local_call(self, overrides, sig=None):
        """A rank-local kernel on the step's blocks (the ring's slot `now` of what travels),
        `overrides` by argument name."""
        sig = sig or self.local
        travel = self.mapping.travel
        arrays = [overrides.get(a.name, self.ring_slot(a.name, "now") if a.name in travel
                                else Ref(a.name)) for a in sig.arrays]
        self.out.call(sig.name, *arrays, *(s.name for s in sig.sizes), *sig.scalars)

    def merge_call(self, into):
        """The parts merged into `into` (the running O, lse)."""
        m, out = self.mapping, self.out
        o, lse = m.merged
        out.call(m.merge_signature(self.dtype).name, Ref(f"{o}_part"), Ref(f"{lse}_part"),
                 into[o], into[lse], *(out.int64_arg(v) for v in m.merge_args().values()))

    def merged_call(self, overrides, high=False):
        """The running (O, lse) (its high chunk where `high`) copied to slot 0 of the parts,
        the block's computed into slot 1, both merged into the running one."""
        merged = self.mapping.merged
        running = {x: self.chunk(x, high) for x in merged}
        for x in merged:
            self.out.copy(Ref(f"{x}_part"), running[x], f"{x}_count")
        self.local_call({**overrides, **{x: Ref(f"{x}_part", f"{x}_count") for x in merged}})
        self.merge_call(running)

    def first_blocks(self, names):
        out = self.out
        out.let(INT, "next", out.mod("rank + 1", "ranks"))
        out.let(INT, "prev", out.mod("rank + ranks - 1", "ranks"))
        out.comment("the rank's own blocks are where step 0 finds them")
        for x in names:
            out.copy(Ref(f"{x}_ring"), Ref(x), travelling(self.mapping, x))

    def pass_on(self, names, first_tag):
        """Each block's slot `now` to rank next, the next one's from rank prev into `later`."""
        out = self.out
        for tag, x in enumerate(names, first_tag):
            count = out.mpi_count(travelling(self.mapping, x))
            for function, which, peer in (("MPI_Irecv", "later", "prev"),
                                          ("MPI_Isend", "now", "next")):
                out.post(function, self.ring_slot(x, which), count, out.datatype, peer, tag, out.COMM)

    def open_step(self, ahead):
        """A step of the ring, the blocks `ahead` posted for the next one."""
        out = self.out
        out.steps()
        out.let(INT64, "now", out.mod("step", "2"))
        out.let(INT64, "later", "1 - now")
        out.requests(2 * len(self.mapping.travel))
        out.if_("step + 1 < ranks", "the next blocks arrive while this step computes")
        self.pass_on(ahead, 0)
        out.end_if()

    def close_step(self):
        self.out.mpi("MPI_Waitall", "pending", "requests", "MPI_STATUSES_IGNORE")
        self.out.end_steps()

    def ring(self):
        out, travel = self.out, self.mapping.travel
        self.first_blocks(travel)
        self.open_step(travel)
        out.if_("step == 0")
        self.local_call({})
        out.else_("slot 0: the running result; slot 1: this block's")
        self.merged_call({})
        out.end_if()
        self.close_step()

    def zigzag(self):
        m, out = self.mapping, self.out
        sigs = {"local": self.local, "diagonal": m.diagonal_signature(self.dtype)}
        self.first_blocks(m.travel)
        self.open_step(m.travel)
        out.let(INT, "source", out.mod("rank - step + ranks", "ranks"), "whose chunks")
        for k, (condition, blocks) in enumerate(zigzag_blocks(m).items()):
            if not condition:
                out.else_()
            elif k == 0:
                out.if_(condition)
            else:
                out.else_if(condition)
            for role, q, key, merged in blocks:
                names = ("low", "high")
                out.comment(f"{names[q]} queries x {names[key]} keys")
                over = {x: Ref(f"{x}_ring", slot(m, x, "now") + (f" + {x}_count" if key else ""))
                        for x in m.travel}
                over.update({a.name: self.chunk(a.name, q)
                             for a in self.local.inputs if a.name not in m.travel})
                if merged:
                    self.merged_call(over, high=bool(q))
                else:
                    self.local_call({**over, **{x: self.chunk(x, q) for x in m.merged}},
                                    sigs[role])
        out.end_if()
        self.close_step()

    def owner(self):
        """K and V posted before the compute, the sums after it."""
        m, out = self.mapping, self.out
        carried = m.carried
        blocks = [x for x in m.travel if x not in carried]
        outputs = [a.name for a in self.local.outputs]
        own = {x: self.ring_slot(x, "now") if x in carried else Ref(x) for x in outputs}
        self.first_blocks(blocks)
        self.open_step(blocks)
        out.if_("step == 0", "the first block's gradients start the sums")
        self.local_call(own)
        out.else_()
        self.local_call({x: Ref(f"{x}_block") for x in outputs})
        for x in outputs:
            out.add(own[x], Ref(f"{x}_block"), f"{x}_count")
        out.end_if()
        out.if_("ranks > 1", "the sums go on with their block; after the last step, home")
        self.pass_on(carried, len(blocks))
        out.end_if()
        self.close_step()
        out.let(INT64, "home", out.select("ranks > 1", out.mod("ranks", "2"), "0"),
                "the slot the last pass filled")
        for x in carried:
            out.copy(Ref(x), Ref(f"{x}_ring", f"home * {x}_count"), f"{x}_count")

    def gather(self):
        m, out = self.mapping, self.out
        o, lse = m.merged
        out.if_(f"{m.empty_when_zero} > 0")
        self.local_call({})
        out.else_("no rows here: a part that weighs nothing")
        out.fill(Ref(o), f"{o}_count", "0")
        out.fill(Ref(lse), f"{lse}_count", out.negative_infinity)
        out.end_if()
        for x in m.merged:
            out.mpi("MPI_Allgather", x, out.mpi_count(f"{x}_count"), out.datatype, f"{x}_part",
                    out.mpi_count(f"{x}_count"), out.datatype, out.COMM)
        self.merge_call({x: Ref(x) for x in m.merged})
