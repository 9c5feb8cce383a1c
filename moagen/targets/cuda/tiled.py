"""A tiled CUDA kernel (moagen.steps.gpu): a thread block per iteration of the grid loops,
its threads a 2-D grid along the thread loops, each thread a register tile.

A thread loop is printed as no loop at all: each statement inside runs on every thread,
once for each iteration of the thread loops around it that the thread takes (unrolled
loops over a compile-time count of slots, so that a thread's locals are registers); a
loop of a thread's own inside (the sum over d of a score) is printed around those unrolled
statements, so a register tile's products are jammed: each shared value loaded once for
the tile. So every statement list is uniform (all threads of the block reach it, the same
number of times) and may hold a barrier: the printer puts one where a statement touches a
shared array that an earlier one since the last barrier wrote (or writes one it read)
through other threads' elements, at a loop's top for what the previous iteration left. A
local a thread loop accumulates and a statement outside it reads (a row's max over the keys
its lanes took) is combined across the lanes by `__shfl_xor_sync`. Statements that could
touch elements past the loops' ranges are guarded, never the whole list (a guard around a
barrier or a shuffle would leave threads out of it)."""
from dataclasses import replace

import sympy

from moagen.moa import scalar as S
from moagen.onf.loops import (Let, Loop, Store, Unrolled, Update, bound_symbol, is_block_copy,
                              is_grid, is_thread_loop, max_extent, most_iterations, walk)
from moagen.targets.cuda.shared_memory import allocate, loop_key, shared_accesses
from moagen.targets.printer import arrays_in, names_used

AXES = "xyz"


def grid_chain(nest):
    """The nest's grid loops, outermost first, and the statements inside them."""
    chain, body = [], nest.body
    while len(body) == 1 and is_grid(body[0]):
        chain.append(body[0])
        body = body[0].body
    return chain, body


def is_tiled(nest) -> bool:
    return bool(grid_chain(nest)[0])


class TiledKernel:
    """Prints one tiled nest with a CudaPrinter's expressions."""

    def __init__(self, printer, nest):
        self.p, self.nest = printer, nest
        self.grid, body = grid_chain(nest)
        self.body = _distinct_locals(body)
        self.bounds = dict(self.grid[-1].gpu.bounds)
        # BlockTiles' and ThreadTiles' preconditions: at most 3 grid loops, bounds for one
        # size, one count of threads an axis
        self.threads = {lp.gpu.axis: lp.gpu.threads for lp in walk(self.body)
                        if is_thread_loop(lp)}
        self.block_dims = (self.threads.get("x", 1), self.threads.get("y", 1), 1)
        self.locals = {s.name: dims for s, dims in _definitions(self.body)}
        self.ctx = []  # the thread loops around the statement being printed
        self.pending = []  # shared accesses since the last barrier: (array, write, owner)
        self.shared = [b for b in printer.onf.shared if b.name in arrays_in(self.body)]
        # each shared array's place, the bytes in all, and the arrays whose bytes meet each
        self.layout, self.shared_bytes, self.meets = allocate(
            self.shared, self.body, 8 if printer.dtype == "float64" else 4,
            self.bound_values())

    # ---- the kernel's parts -----------------------------------------------------------
    def template(self):
        return [bound_symbol(name).name for name in self.bounds]

    def instances(self):
        """(the sizes' condition for it, the template arguments, its shared bytes) of each
        compiled bound, as sympy expressions."""
        _, shared = self.shared_layout()
        if not self.bounds:
            return [(sympy.true, "", shared)]
        (name, values), = self.bounds.items()
        size = next(s for s in self.p.onf.sizes if s.name == name)
        return [(sympy.Le(size, v), f"<{v}>", shared.xreplace({bound_symbol(name): v}))
                for v in values]

    def specializations(self):
        """instances() as the launcher's text: condition ("" for none), template
        arguments, shared bytes."""
        return [("" if condition is sympy.true else self.p.index(condition), arguments,
                 self.p.index(shared)) for condition, arguments, shared in self.instances()]

    def grid_dims(self):
        dims = [lp.stop - lp.start for lp in reversed(self.grid)]
        return tuple(dims) + (sympy.Integer(1),) * (3 - len(dims))

    def shared_layout(self):
        """(name, byte offset, element count) of each shared array, and the bytes in all
        (moagen.targets.cuda.shared_memory)."""
        return self.layout, self.shared_bytes

    def bound_values(self):
        """Each compiled bound as a substitution of its MAX_ symbol."""
        return [{bound_symbol(name): v}
                for name, values in self.bounds.items() for v in values] or [{}]

    def prologue(self):
        pad = self.p.indent
        lines = []
        for axis, lp in zip(AXES, reversed(self.grid)):
            start = "" if lp.start == 0 else f"{self.p.index(lp.start)} + "
            lines.append(f"{pad}const int {lp.var} = {start}blockIdx.{axis};")
        lines.append(f"{pad}const int tx = threadIdx.x, ty = threadIdx.y;")
        layout, _ = self.shared_layout()
        for name, offset, count in layout:
            lines.append(f"{pad}MOAGEN_SHARED_AT({self.p.real}, {name}, {self.p.index(offset)}, "
                         f"{self.p.index(count)});")
        for name, dims in self.locals.items():
            lines.append(f"{pad}{self.p.real} {name}{''.join(f'[{self.slots(lp)}]' for lp in dims)};")
        return lines

    # ---- slots: the iterations of a thread loop one thread takes ----------------------
    def tiles(self, loop):
        """How many tiles of the loop one thread takes, as C text (a compile-time count)."""
        span = loop.gpu.threads * loop.gpu.tile
        most = most_iterations(loop, self.bounds.items())  # ThreadTiles' precondition
        if most.is_Integer:
            return str(-(-int(most) // span))
        return f"(({self.p.index(most)} + {span - 1}) / {span})"

    def slots(self, loop):
        tiles = self.tiles(loop)
        if tiles.isdigit():
            return str(int(tiles) * loop.gpu.tile)
        return tiles if loop.gpu.tile == 1 else f"{tiles} * {loop.gpu.tile}"

    def exact(self, loop) -> bool:
        most = max_extent(loop)
        return most is not None and most % (loop.gpu.threads * loop.gpu.tile) == 0 and \
            sympy.simplify(loop.stop - loop.start - most) == 0

    # ---- statements -------------------------------------------------------------------
    def lines(self):
        return self.block(self.body, 1)

    def block(self, stmts, depth):
        lines = []
        for s in stmts:
            accesses = list(self.accesses(s))
            if any(self.conflicts(a) for a in accesses):
                lines.append(self.p.indent * depth + "__syncthreads();")
                self.pending = []
            if is_thread_loop(s):
                self.ctx.append(s)
                lines += self.block(s.body, depth)
                self.ctx.pop()
                lines += self.lane_reductions(s, depth)
            elif is_block_copy(s):
                lines += self.copy(s, depth)
            elif isinstance(s, Loop):
                lines += self.loop(s, depth)
            else:
                lines += self.leaf(s, depth)
            self.pending += accesses
        return lines

    def loop(self, loop, depth):
        # uniform across the block's threads (check_block_form)
        pad, v = self.p.indent * depth, loop.var
        # the previous iteration's accesses, for the barrier at the top of this one
        self.pending = self.pending + list(self.accesses(loop))
        body = self.block(loop.body, depth + 1)
        self.pending = self.pending + list(self.accesses(loop))
        # a tile's loops count within a head: int, as the offsets into shared memory
        start, stop = self.p.index(loop.start), self.p.index(loop.stop)
        if isinstance(loop.gpu, Unrolled):
            # the stop an int once: compared with an int64 size each time, nvcc unrolls
            # with an exit test after every copy instead of a remainder loop
            return [f"{pad}#pragma unroll {loop.gpu.factor}",
                    f"{pad}for (int {v} = {start}, {v}_stop = (int)({stop}); {v} < {v}_stop; "
                    f"++{v}) {{", *body, pad + "}"]
        return [f"{pad}for (int {v} = {start}; {v} < {stop}; ++{v}) {{", *body, pad + "}"]

    def copy(self, loop, depth):
        """A block's copy: its last loop over the x threads (consecutive threads on
        consecutive elements), the one before over the y threads, any other a loop of
        every thread; a 1-D copy's one loop over all the block's threads (axis xy)."""
        pad, v = self.p.indent * depth, loop.var
        first, step = {"x": ("tx", self.block_dims[0]),
                       "y": ("ty", self.block_dims[1]),
                       "xy": (f"ty * {self.block_dims[0]} + tx",
                              self.block_dims[0] * self.block_dims[1])}.get(
            loop.gpu.axis if is_block_copy(loop) else "", (self.p.index(loop.start), 1))
        saved, self.ctx = self.ctx, []
        inner = []
        for s in loop.body:
            inner += self.copy(s, depth + 1) if isinstance(s, Loop) else self.p.block((s,), depth + 1)
        self.ctx = saved
        advance = f"++{v}" if step == 1 else f"{v} += {step}"
        return [f"{pad}for (int {v} = {first}; {v} < {self.p.index(loop.stop)}; {advance}) {{",
                *inner, pad + "}"]

    def leaf(self, s, depth):
        pad = self.p.indent  # inside a thread loop (check_block_form)
        guarded = self.guarded(s)
        guard = " && ".join(f"{lp.var} < {self.p.index(lp.stop)}" for lp in guarded)
        used = self.coordinates_used(s, guarded)
        lines, level = [], depth
        for lp in self.ctx:
            slot = f"s_{lp.var}"
            lines.append(pad * level + "#pragma unroll")
            lines.append(pad * level + f"for (int {slot} = 0; {slot} < {self.slots(lp)}; ++{slot}) {{")
            level += 1
            if lp.var in used:
                lines.append(pad * level + f"const int {lp.var} = {self.position(lp)};")
        text = self.p.block((s,), 0)
        if guard:
            lines.append(pad * level + f"if ({guard}) {text[0].strip()}")
            lines += [pad * level + t for t in text[1:]]
        else:
            lines += [pad * level + t for t in text]
        for level in range(level - 1, depth - 1, -1):
            lines.append(pad * level + "}")
        return lines

    def position(self, loop):
        """The iteration of slot s_<var> of this thread."""
        lane = "t" + loop.gpu.axis
        slot, threads, tile = f"s_{loop.var}", loop.gpu.threads, loop.gpu.tile
        start = "" if loop.start == 0 else f"{self.p.index(loop.start)} + "
        if tile == 1:
            return f"{start}{slot} * {threads} + {lane}"
        return f"{start}({slot} / {tile} * {threads} + {lane}) * {tile} + {slot} % {tile}"

    def guarded(self, s):
        """The thread loops whose range s must check, where a slot can fall past it; none
        for a statement on a thread's own registers from shared tiles (its value outside
        the ranges is never used)."""
        own = isinstance(s, (Let, Update)) and \
            set(map(loop_key, self.locals.get(s.name, ()))) >= set(map(loop_key, self.ctx)) and \
            not (set(arrays_in((s,))) - {b.name for b in self.shared})
        if own:  # the shared tiles hold every slot (Stage lays them out to the bounds)
            return []
        return [lp for lp in self.ctx if not self.exact(lp)]

    def coordinates_used(self, s, guarded):
        """The thread loops' variables that s, its guard or the position of one of them
        reads: the coordinates a slot declares (an unread one is nvcc's warning #177)."""
        names = names_used((s,))
        for lp in guarded:  # `var < stop`
            names |= {lp.var.name} | {x.name for x in lp.stop.free_symbols}
        for lp in reversed(self.ctx):  # an inner loop's start may read an outer coordinate
            if lp.var.name in names:
                names |= {x.name for x in lp.start.free_symbols}
        return {lp.var for lp in self.ctx if lp.var.name in names}

    def local(self, name):
        """A local's text: indexed by the slots of the thread loops it is defined in."""
        dims = self.locals.get(name)
        if dims is None:
            return name
        # read inside the thread loops it is defined in: a local the mapping steps keep
        # across a thread loop is a register array declared outside it (RegisterScratch)
        keys = {loop_key(lp) for lp in self.ctx}
        assert all(loop_key(lp) in keys for lp in dims), f"{name} read outside its loops"
        return name + "".join(f"[s_{lp.var}]" for lp in dims)

    def lane_reductions(self, loop, depth):
        """After a thread loop along x: the locals it accumulated that are defined outside it,
        combined across the threads that took its iterations (consecutive lanes of a warp)."""
        if loop.gpu.axis != "x":
            return []
        updates = {s.name: s.op for s in walk(loop.body) if isinstance(s, Update)
                   and s.name in self.locals
                   and loop_key(loop) not in set(map(loop_key, self.locals[s.name]))}
        lines = []
        for name, op in updates.items():
            shuffle = Update(name, op, S.Local(f"__shfl_xor_sync(0xffffffffu, {self.local(name)}, o)"))
            body = self.leaf_lines(shuffle, depth + 1)
            lines += [f"{self.p.indent * depth}for (int o = {loop.gpu.threads // 2}; o > 0; o /= 2) {{",
                      *body, self.p.indent * depth + "}"]
        return lines

    def leaf_lines(self, s, depth):
        """s unrolled over the thread loops its local is defined in (all threads run it)."""
        saved = self.ctx
        defined_in = set(map(loop_key, self.locals.get(s.name, ())))
        self.ctx = [lp for lp in saved if loop_key(lp) in defined_in]
        if not self.ctx:
            lines = [self.p.indent * depth + t for t in self.p.block((s,), 0)]
        else:
            lines = self.leaf(s, depth)
        self.ctx = saved
        return lines

    # ---- barriers ---------------------------------------------------------------------
    def accesses(self, s):
        """(shared array, whether written, owner) of every shared access inside s; owner: the
        thread loops around it and its index (two accesses with one owner are one thread's
        element), None for a block's copy."""
        yield from shared_accesses(s, {b.name for b in self.shared},
                                   tuple(loop_key(lp) for lp in self.ctx))

    def conflicts(self, access):
        """Whether an access since the last barrier, by another thread, touched bytes of
        this one's array (its own or another's placed on them), one of the two a write."""
        array, write, owner = access
        return any(a in self.meets[array] and (w or write) and (o is None or o != owner)
                   for a, w, o in self.pending)


def _distinct_locals(stmts):
    """stmts with a local defined inside different thread loops (dQ's `t`: one per query
    row and key of a block's scores, then one per query row in dQ += dS K) one local per
    set of loops, `<name>_<k>` after the first: each a thread's register array of its own
    slots. A read is of the latest definition before it, in the order of the statements."""
    names = {}  # (name, the thread loops around its definition) -> its name here
    taken = {s.name for s in walk(stmts) if isinstance(s, Let)}
    env = {}

    def expr(e):
        if isinstance(e, S.Local) and e.name in env:
            return S.Local(env[e.name])
        return S.map_children(e, expr)

    def block(stmts, around):
        out = []
        for s in stmts:
            if isinstance(s, Loop):
                thread = is_thread_loop(s)
                inner = around + ((loop_key(s),) if thread else ())
                out.append(replace(s, body=block(s.body, inner)))
                continue
            value = expr(s.value)
            if isinstance(s, Let):
                key = (s.name, frozenset(around))
                if key not in names:
                    new, k = s.name, 0
                    if any(n == s.name for n, _ in names):
                        while new in taken:
                            k += 1
                            new = f"{s.name}_{k}"
                    taken.add(new)
                    names[key] = new
                env[s.name] = names[key]
                out.append(Let(names[key], value))
            elif isinstance(s, Update):
                out.append(Update(env.get(s.name, s.name), s.op, value))
            else:
                out.append(replace(s, value=value))
        return tuple(out)

    return block(stmts, ())


def _definitions(stmts, around=()):
    """(Let, the thread loops around it) for every local defined inside thread loops."""
    for s in stmts:
        if isinstance(s, Loop):
            inner = around + ((s,) if is_thread_loop(s) else ())
            yield from _definitions(s.body, inner)
        elif isinstance(s, Let):
            yield s, around

