"""A tiled CUDA kernel (moagen.steps.gpu): a thread block per iteration of the grid loops,
its threads a 2-D grid along the thread loops, each thread a register tile.

A thread loop is printed as no loop at all: each statement inside runs on every thread,
once for each iteration of the thread loops around it that the thread takes (unrolled
loops over a compile-time count of slots, so that a thread's locals are registers); a
loop of a thread's own inside (the sum over d of a score) is printed around those unrolled
statements, so a register tile's products are jammed: each shared value loaded once for
the tile. So every statement list is uniform (all threads of the block reach it, the same
number of times) and may hold a barrier or a shuffle: the printer prints each Barrier
(put in by moagen.steps.gpu.closing) with what it orders, and each LaneReduce (a row's max
over the keys its lanes took) as its `__shfl_xor_sync` loop. Statements that could touch
elements past the loops' ranges are guarded, never the whole list (a guard around a barrier or a shuffle would leave threads
out of it)."""
from dataclasses import replace

import sympy

from moagen.moa import scalar as S
from moagen.cuda_archs import WARP
from moagen.moa.expr import idiv, simplified
from moagen.onf.loops import (Barrier, LaneReduce, Let, Loop, Mma, Store, Unrolled, Update,
                              bound_symbol, grid_chain, is_block_copy, is_fragment_loop,
                              is_thread_loop, loop_key, most_iterations, stmt_exprs, subs_stmts,
                              walk)
from moagen.onf.names import kernel_names
from moagen.onf.signature import DTYPE_BYTES
from moagen.steps.gpu.vector import VECTOR_TILE
from moagen.targets.printer import arrays_in, names_used

AXES = "xyz"


def is_tiled(nest) -> bool:
    return bool(grid_chain(nest)[0])


class TiledKernel:
    """Prints one tiled nest with a CudaPrinter's expressions."""

    def __init__(self, printer, nest):
        self.p, self.nest = printer, nest
        self.grid, body = grid_chain(nest)
        self.quotients = _block_quotients(body, {lp.var for lp in self.grid},
                                          kernel_names(printer.onf))
        self.body = _distinct_locals(subs_stmts(body, {q: sympy.Symbol(name, integer=True)
                                                       for q, name in self.quotients.items()}))
        self.bounds = dict(self.grid[-1].gpu.bounds)
        # BlockTiles' and ThreadTiles' preconditions: at most 3 grid loops, bounds for one
        # size, one count of threads an axis
        self.threads = {lp.gpu.axis: lp.gpu.block_threads for lp in walk(self.body)
                        if is_thread_loop(lp)}
        self.block_dims = (self.threads.get("x", 1), self.threads.get("y", 1), 1)
        self.locals = {s.name: dims for s, dims in _definitions(self.body)}
        # the tensor-core sums (WarpMma): each local of a warp's fragment loops (an
        # accumulator: WarpMma's precondition) -> the Mma mark of the sum inside them
        self.mma = {}
        for lp in walk(self.body):
            if is_fragment_loop(lp) and lp.gpu.axis == "x":
                mark = next(x.gpu for x in walk(lp.body) if isinstance(x, Loop)
                            and isinstance(x.gpu, Mma))
                self.mma.update({s.name: mark for s in walk(lp.body) if isinstance(s, Let)})
        self.ctx = []  # the thread loops around the statement being printed
        # its shared arrays' places at the dtype's element size (moagen.steps.gpu.closing)
        element_bytes = DTYPE_BYTES[printer.dtype]
        self.layout = next((layout for layout in nest.shared_layouts
                            if layout.element_bytes == element_bytes), None)
        if self.layout is None:
            raise ValueError(f"nest {nest.label} has no shared layout for {element_bytes}-byte "
                             "elements: print a tiled nest as realize leaves it")
        self.shared = {a.name for a in self.layout.arrays}
        # the 16-byte loads, each (the length of the rows it reads, the arrays): VectorLoads'
        # loops and Stage's vector copies. The kernel an instance with them (VECTOR_LOADS 1)
        # where the launch finds their preconditions hold, one with their scalar form (0)
        # otherwise
        rows = {b.name: b.shape[-1] for b in printer.onf.inputs + printer.onf.temps
                + printer.onf.outputs}
        self.vector = [(lp.stop, arrays_in(lp.body)) for lp in walk(self.body)
                       if is_thread_loop(lp) and lp.gpu.vector] + \
            [(rows[a], [a]) for lp in walk(self.body) if is_block_copy(lp) and lp.gpu.vector
             for a in [_copy_source(lp)]]

    # ---- the kernel's parts -----------------------------------------------------------
    def template(self):
        return [bound_symbol(name).name for name in self.bounds] + \
            (["VECTOR_LOADS"] if self.vector else [])

    def _instances(self):
        """(the bound's condition, whether the instance loads by vectors, its template
        arguments, its shared bytes) of each compiled bound, the vector instance first."""
        shared = self.layout.total
        (name, values), = self.bounds.items() if self.bounds else ((None, (None,)),)
        out = []
        for v in values:
            bound, at, arguments = sympy.true, shared, []
            if v is not None:
                bound = sympy.Le(next(s for s in self.p.onf.sizes if s.name == name), v)
                at, arguments = shared.xreplace({bound_symbol(name): v}), [str(v)]
            for vector in ((True, False) if self.vector else (False,)):
                flag = [str(int(vector))] if self.vector else []
                text = f"<{', '.join(arguments + flag)}>" if arguments + flag else ""
                out.append((bound, vector, text, at))
        return out

    def instances(self):
        """(the sizes' condition for it, the template arguments, its shared bytes) of each
        compiled bound, as sympy expressions; a vector instance's condition has the rows'
        length a multiple of a vector (the arrays' alignment, which no size says, is
        assumed: cudaMalloc's)."""
        rows = {r for r, _ in self.vector}
        return [(sympy.And(bound, *(sympy.Eq(sympy.Mod(r, VECTOR_TILE), 0) for r in rows))
                 if vector else bound, arguments, shared)
                for bound, vector, arguments, shared in self._instances()]

    def specializations(self):
        """instances() as the launcher's text: condition ("" for none), template
        arguments, shared bytes; a vector instance's condition checks the arrays'
        alignment too (VectorLoads' preconditions)."""
        out = []
        for bound, vector, arguments, shared in self._instances():
            tests = [] if bound is sympy.true else [self.p.index(bound)]
            if vector:
                tests += sorted({f"{self.p.index(r)} % {VECTOR_TILE} == 0"
                                 for r, _ in self.vector})
                arrays = sorted({a for _, read in self.vector for a in read})
                tests.append(f"(({' | '.join(f'(uintptr_t){a}' for a in arrays)}) % 16) == 0")
            out.append((" && ".join(tests), arguments, self.p.index(shared)))
        return out

    def grid_dims(self):
        dims = [lp.stop - lp.start for lp in reversed(self.grid)]
        return tuple(dims) + (sympy.Integer(1),) * (3 - len(dims))

    def prologue(self):
        pad = self.p.indent
        lines = []
        for axis, lp in zip(AXES, reversed(self.grid)):
            start = "" if lp.start == 0 else f"{self.p.index(lp.start)} + "
            lines.append(f"{pad}const int {lp.var} = {start}blockIdx.{axis};")
        lines.append(f"{pad}const int tx = threadIdx.x, ty = threadIdx.y;")
        inner = {}
        for q, name in self.quotients.items():
            lines.append(f"{pad}const int64_t {name} = {self.p.index(q.xreplace(inner))};")
            inner[q] = sympy.Symbol(name, integer=True)
        for a in self.layout.arrays:
            lines.append(f"{pad}MOAGEN_SHARED_AT({self.p.real}, {a.name}, "
                         f"{self.p.index(a.offset)}, {self.p.index(a.count)});")
        for name, dims in self.locals.items():
            slots = "".join(f"[{self.slots(lp)}]" for lp in dims if not self.single(lp))
            kind = self.fragment(self.mma[name], "accumulator") if name in self.mma \
                else self.p.real
            lines.append(f"{pad}{kind} {name}{slots};")
        return lines

    # ---- slots: the iterations of a thread loop one thread takes ----------------------
    def tiles(self, loop):
        """How many tiles of the loop one thread takes, as C text (a compile-time count)."""
        span = loop.gpu.threads * loop.gpu.tile
        most = most_iterations(loop, self.bounds.items())  # ThreadTiles' precondition
        if most.is_Integer:
            return str(-(-int(most) // span))
        return f"(({self.p.index(most)} + {span - 1}) / {span})"

    def per_tile(self, loop):
        """A thread's slots a tile: its iterations, or a warp's fragments of them."""
        return loop.gpu.tile // loop.gpu.fragment if loop.gpu.fragment else loop.gpu.tile

    def slots(self, loop):
        tiles, per = self.tiles(loop), self.per_tile(loop)
        if tiles.isdigit():
            return str(int(tiles) * per)
        return tiles if per == 1 else f"{tiles} * {per}"

    def single(self, loop) -> bool:
        """Whether a thread takes one slot of the loop: printed with no slot loop, its
        locals without that index."""
        return self.slots(loop) == "1"

    def exact(self, loop) -> bool:
        """Whether the loop's threads take every slot at every size: a constant extent, a
        whole number of the threads' tiles."""
        extent = simplified(loop.stop - loop.start)
        return extent.is_Integer and extent % (loop.gpu.threads * loop.gpu.tile) == 0

    # ---- statements -------------------------------------------------------------------
    def lines(self):
        return self.block(self.body, 1)

    def block(self, stmts, depth):
        lines = []
        for s in stmts:
            if isinstance(s, Barrier):
                lines.append(f"{self.p.indent * depth}__syncthreads();  // {s.why}")
            elif isinstance(s, LaneReduce):
                lines += self.lane_reduction(s, depth)
            elif is_thread_loop(s) and s.gpu.vector:
                lines += self.vector_loads(s, depth)
            elif is_thread_loop(s):
                self.ctx.append(s)
                lines += self.block(s.body, depth)
                self.ctx.pop()
            elif is_block_copy(s):
                lines += self.copy(s, depth)
            elif isinstance(s, Loop):
                lines += self.loop(s, depth)
            else:
                lines += self.leaf(s, depth)
        return lines

    def loop(self, loop, depth):
        # uniform across the block's threads, or across a warp's lanes where its bounds read
        # the warp's row (check_block_form): that row declared first, in a scope of its own
        rows = [lp for lp in self.ctx
                if lp.var in loop.start.free_symbols | loop.stop.free_symbols]
        if rows:
            opening = self.first_slot(rows, depth)
            opening[0] += "  // this warp's row: the loop below is uniform across its lanes"
            return [*opening, *self.loop_lines(loop, depth + 1),
                    self.p.indent * depth + "}"]
        return self.loop_lines(loop, depth)

    def first_slot(self, loops, depth):
        """The lines opening a scope that declares the coordinates of `loops` at this
        thread's first slot (its only one, or a warp's row)."""
        pad = self.p.indent
        return [pad * depth + "{", *(pad * (depth + 1) + f"const int {lp.var} = "
                                     f"{self.position(lp, '0')};" for lp in loops)]

    def loop_lines(self, loop, depth):
        if isinstance(loop.gpu, Mma):
            return self.mma_loop(loop, depth)
        pad, v = self.p.indent * depth, loop.var
        body = self.block(loop.body, depth + 1)
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
        inner = loop.body[0] if len(loop.body) == 1 else None
        if is_block_copy(inner) and inner.gpu.vector:
            return [pad + "if (VECTOR_LOADS) {", *self.vector_copy(loop, depth + 1),
                    pad + "} else {", *self.copy(replace(loop, body=(
                        replace(inner, gpu=replace(inner.gpu, vector=False)),)), depth + 1),
                    pad + "}"]
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

    def vector_copy(self, loop, depth):
        """A 2-D copy whose x loop is a vector one (Stage's vector option): the block's
        threads over its groups of VECTOR_TILE elements of a row, flat (every thread busy
        where a row has fewer groups than the block's x threads), each group by
        moagen_load4, or zero where the copy's guard puts it past the source's edge (all
        its elements alike: the option's preconditions), then into the tile."""
        pad, inner = self.p.indent, loop.body[0]
        (store,) = inner.body
        x, width = inner.var, VECTOR_TILE
        groups = simplified(inner.stop / width)
        flat, values, k = f"{x}_g", f"{x}_v", sympy.Symbol(f"{x}_k", integer=True)
        threads = self.block_dims[0] * self.block_dims[1]
        value, guard = store.value, None
        if isinstance(value, S.Select):
            value, guard = value.then, value.cond
        load = f"moagen_load4({values}, &{self.p.expr(value)});"
        (offset,) = store.index
        return [pad * depth + f"for (int {flat} = ty * {self.block_dims[0]} + tx; "
                              f"{flat} < {self.p.index(loop.stop * groups)}; "
                              f"{flat} += {threads}) {{",
                pad * (depth + 1) + f"const int {loop.var} = {flat} / {self.p.index(groups)}, "
                                    f"{x} = {flat} % {self.p.index(groups)} * {width};",
                pad * (depth + 1) + f"{self.p.real} {values}[{width}] = {{{', '.join(['0'] * width)}}};",
                pad * (depth + 1) + (f"if ({self.p.index(guard)}) {load}" if guard else load),
                pad * (depth + 1) + "#pragma unroll",
                pad * (depth + 1) + f"for (int {k} = 0; {k} < {width}; ++{k}) "
                                    f"{store.array}[{self.p.index(offset.xreplace({x: x + k}))}]"
                                    f" = {values}[{k}];",
                pad * depth + "}"]

    def leaf(self, s, depth):
        pad = self.p.indent  # inside a thread loop (check_block_form)
        guarded = self.guarded(s)
        guard = " && ".join(f"{lp.var} < {self.p.index(lp.stop)}" for lp in guarded)
        used = self.coordinates_used(s, guarded)
        lines, level = [], depth
        for lp in self.ctx:
            if self.single(lp):  # one slot: its coordinate in a scope of its own, if used
                if lp.var in used:
                    lines += self.first_slot((lp,), level)
                    level += 1
                continue
            slot = f"s_{lp.var}"
            lines.append(pad * level + "#pragma unroll")
            lines.append(pad * level + f"for (int {slot} = 0; {slot} < {self.slots(lp)}; ++{slot}) {{")
            level += 1
            if lp.var in used:
                lines.append(pad * level + f"const int {lp.var} = {self.position(lp)};")
        text = self.fragment_statement(s) if any(map(is_fragment_loop, self.ctx)) \
            else self.p.block((s,), 0)
        if guard:
            lines.append(pad * level + f"if ({guard}) {text[0].strip()}")
            lines += [pad * level + t for t in text[1:]]
        else:
            lines += [pad * level + t for t in text]
        for level in range(level - 1, depth - 1, -1):
            lines.append(pad * level + "}")
        return lines

    def vector_loads(self, loop, depth):
        """A VectorLoads loop: each tile of a thread's slots by moagen_load4 (16-byte loads)
        in the vector instance, element by element in the scalar one."""
        pad, slot, tile = self.p.indent, f"s_{loop.var}", loop.gpu.tile
        self.ctx.append(loop)
        scalar = self.block(loop.body, depth + 1)
        around = self.ctx[:-1]  # a warp's row at most: one slot each (a loop's would repeat)
        if not all(map(self.single, around)):
            raise ValueError(f"nest {self.nest.label}: vector loads inside a thread's slots of "
                             f"{', '.join(str(lp.var) for lp in around if not self.single(lp))}")
        used = set().union(*(self.coordinates_used(s, ()) for s in loop.body)) - {loop.var}
        opening = self.first_slot([lp for lp in around if lp.var in used], depth + 1) \
            if used else []
        level = depth + 1 + bool(opening)
        guard = "" if self.exact(loop) else f"if ({loop.var} < {self.p.index(loop.stop)}) "
        vector = [*opening, pad * level + "#pragma unroll",
                  pad * level + f"for (int {slot} = 0; {slot} < {self.slots(loop)}; "
                                f"{slot} += {tile}) {{",
                  pad * (level + 1) + f"const int {loop.var} = "
                                      f"{self.position(loop, tile_first=True)};",
                  # the loop's body: Lets of loads (VectorLoads' form)
                  *(pad * (level + 1) + f"{guard}moagen_load4(&{self.local(s.name)}, "
                                        f"&{self.p.expr(s.value)});" for s in loop.body),
                  pad * level + "}"] + ([pad * (depth + 1) + "}"] if opening else [])
        self.ctx.pop()
        return [pad * depth + "if (VECTOR_LOADS) {", *vector, pad * depth + "} else {",
                *scalar, pad * depth + "}"]

    def position(self, loop, slot=None, tile_first=False):
        """The iteration of slot s_<var> (or `slot`) of this thread: of a fragment loop, the
        first of its warp's fragment."""
        lane = "t" + loop.gpu.axis
        slot, threads, tile = slot or f"s_{loop.var}", loop.gpu.threads, loop.gpu.tile
        start = "" if loop.start == 0 else f"{self.p.index(loop.start)} + "
        if loop.gpu.fragment:
            warp = "ty" if loop.gpu.axis == "y" else f"tx / {WARP}"
            first = f"{start}{warp} * {tile}"
            if slot == "0":
                return first
            if self.tiles(loop) == "1":
                return f"{first} + {slot} * {loop.gpu.fragment}"
            per = self.per_tile(loop)
            return (f"{start}({slot} / {per} * {threads} + {warp}) * {tile} + "
                    f"{slot} % {per} * {loop.gpu.fragment}")
        if slot == "0":  # the first slot: the lane's own tile
            return f"{start}{lane}" if tile == 1 else f"{start}{lane} * {tile}"
        if tile == 1:
            return f"{start}{slot} * {threads} + {lane}"
        first = f"{start}({slot} / {tile} * {threads} + {lane}) * {tile}"
        return first if tile_first else f"{first} + {slot} % {tile}"

    def guarded(self, s):
        """The thread loops whose range s must check, where a slot can fall past it; none
        for a statement on a thread's own registers from shared tiles (its value outside
        the ranges is never used)."""
        if any(map(is_fragment_loop, self.ctx)):
            # a warp's fragments: registers, and the shared tiles laid out to the block's
            # whole tile (WarpMma's form)
            return []
        own = isinstance(s, (Let, Update)) and \
            set(map(loop_key, self.locals.get(s.name, ()))) >= set(map(loop_key, self.ctx)) and \
            not (set(arrays_in((s,))) - self.shared)
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
        return name + "".join(f"[s_{lp.var}]" for lp in dims if not self.single(lp))

    # ---- tensor cores (WarpMma) ---------------------------------------------------------
    def fragment(self, mma, use, major=None):
        """The type of a fragment of mma's: use "matrix_a", "matrix_b" or "accumulator"."""
        m, n, k = mma.shape
        real = {"f64": "double"}.get(mma.precision, "wmma::precision::tf32")
        if use == "accumulator":
            real = self.p.real
        layout = f", wmma::{major}_major" if major else ""
        return f"wmma::fragment<wmma::{use}, {m}, {n}, {k}, {real}{layout}>"

    def fragment_statement(self, s):
        """A warp's statement on its accumulator fragments (at this slot): zeroed, added to
        another, or stored into the block's shared output tile."""
        mma = self.mma.get(getattr(s, "name", None)) if isinstance(s, Let) else None
        if isinstance(s, Let) and mma is not None and s.value == S.Num(0.0):
            return [f"wmma::fill_fragment({self.local(s.name)}, {self.p.expr(s.value)});"]
        if isinstance(s, Update) and s.op == "+" and isinstance(s.value, S.Local):
            # a total of sums (a weight gradient's over the batch entries): fragments of one
            # type hold their elements alike
            total, part = self.local(s.name), self.local(s.value.name)
            return [f"for (int t = 0; t < {total}.num_elements; ++t) "
                    f"{total}.x[t] += {part}.x[t];"]
        if isinstance(s, Store) and isinstance(s.value, S.Local) and s.value.name in self.mma:
            c = self.mma[s.value.name].c
            return [f"wmma::store_matrix_sync({s.array} + ({self.p.index(s.index[0])}), "
                    f"{self.local(s.value.name)}, {c.ldm}, wmma::mem_row_major);"]
        raise ValueError(f"nest {self.nest.label}: {s} in a warp's fragments is none of "
                         "WarpMma's statements")

    def mma_loop(self, loop, depth):
        """A sum on tensor cores: k steps of it at a time, each warp loading its fragments
        of the two operands' shared tiles and multiplying them into its accumulators; for
        3xTF32 each operand fragment split into its TF32 high and low parts first."""
        pad, v, mma = self.p.indent, loop.var, loop.gpu
        acc, (m, n, k) = loop.body[0].name, mma.shape
        rows, cols = (next(lp for lp in self.ctx if lp.gpu.axis == axis and lp.gpu.fragment)
                      for axis in "yx")
        loads = {x.array: x for u in loop.body for x in S.subexpressions(u.value)
                 if isinstance(x, S.Load)}
        split = mma.precision == "3xtf32"
        if self.p.real != ("double" if mma.precision == "f64" else "float"):
            raise ValueError(f"nest {self.nest.label}: {mma} multiplies no {self.p.real}")
        lines = [f"{pad * depth}for (int {v} = {self.p.index(loop.start)}, {v}_stop = "
                 f"(int)({self.p.index(loop.stop)}); {v} < {v}_stop; {v} += {k}) {{"]
        inner = depth + 1
        products = []
        for t, (a_op, b_op) in enumerate(mma.terms):
            term = "" if len(mma.terms) == 1 else str(t + 1)
            parts = {}  # operand -> its fragments' names
            for use, op, lp in (("a", a_op, rows), ("b", b_op, cols)):
                kind = self.fragment(mma, f"matrix_{use}", op.major)
                name = f"{acc}_{use}{term}"
                names = (name + "_hi", name + "_lo") if split else (name,)
                lines.append(f"{pad * inner}{kind} "
                             f"{', '.join(x + f'[{self.slots(lp)}]' for x in names)};")
                parts[use] = names
                body = [f"wmma::load_matrix_sync({names[0]}[s_{lp.var}], {op.array} + "
                        f"({self.p.index(loads[op.array].offset)}), {op.ldm});"]
                if split:  # x = hi + lo, each TF32: hi rounded from x, lo from what is left
                    hi, lo = (f"{x}[s_{lp.var}]" for x in names)
                    body += [f"for (int t = 0; t < {hi}.num_elements; ++t) {{",
                             f"{pad}const float x = {hi}.x[t];",
                             f"{pad}{hi}.x[t] = wmma::__float_to_tf32(x);",
                             f"{pad}{lo}.x[t] = wmma::__float_to_tf32(x - {hi}.x[t]);",
                             "}"]
                elif mma.precision == "tf32":
                    x = f"{names[0]}[s_{lp.var}]"
                    body += [f"for (int t = 0; t < {x}.num_elements; ++t) "
                             f"{x}.x[t] = wmma::__float_to_tf32({x}.x[t]);"]
                lines += self.slot_loop(lp, body, inner,
                                        lp.var in loads[op.array].offset.free_symbols)
            a, b = parts["a"], parts["b"]
            # the small products first: a_lo b_hi + a_hi b_lo, then a_hi b_hi
            products += ((a[1], b[0]), (a[0], b[1]), (a[0], b[0])) if split else ((a[0], b[0]),)
        c = self.local(acc)
        body = [f"wmma::mma_sync({c}, {x}[s_{rows.var}], {y}[s_{cols.var}], {c});"
                for x, y in products]
        lines += self.slot_loop(rows, self.slot_loop(cols, body, 0), inner)
        return lines + [pad * depth + "}"]

    def slot_loop(self, loop, body, depth, used=False):
        """body (lines) in an unrolled loop over this thread's slots of `loop`, its
        coordinate there declared where the body reads it (`used`)."""
        pad, slot = self.p.indent, f"s_{loop.var}"
        coordinate = [f"{pad}const int {loop.var} = {self.position(loop)};"] if used else []
        return [pad * depth + x for x in (
            "#pragma unroll", f"for (int {slot} = 0; {slot} < {self.slots(loop)}; ++{slot}) {{",
            *coordinate, *(pad + line for line in body), "}")]

    def lane_reduction(self, s, depth):
        """A LaneReduce as its butterfly shuffles, over the slots of the thread loops its
        local is defined in (all threads run them)."""
        shuffle = Update(s.name, s.op,
                         S.Local(f"__shfl_xor_sync(0xffffffffu, {self.local(s.name)}, o)"))
        return [f"{self.p.indent * depth}for (int o = {s.lanes // 2}; o > 0; o /= 2) {{",
                *self.leaf_lines(shuffle, depth + 1), self.p.indent * depth + "}"]

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


def _block_quotients(stmts, grid, names) -> dict:
    """{quotient: its name} of the integer divisions in the nest's indices and loop bounds
    that read no loop inside the grid (a folded grid loop's parts, a slice's length): the
    same for the whole block, so computed once. nvcc keeps a 64-bit division where it is
    written, a call a load in the loop over keys."""
    inside = {lp.var for lp in walk(stmts) if isinstance(lp, Loop)} - grid
    exprs = [e for lp in walk(stmts) if isinstance(lp, Loop) for e in (lp.start, lp.stop)]
    exprs += [sympy.sympify(i) for s in walk(stmts) if isinstance(s, Store) for i in s.index]
    exprs += [x.offset for s in walk(stmts) if not isinstance(s, Loop) for e in stmt_exprs(s)
              for x in S.subexpressions(e) if isinstance(x, S.Load)]
    found = dict.fromkeys(q for e in exprs for q in sorted(e.atoms(idiv), key=str)
                          if not q.free_symbols & inside)
    # the inner first, each computed from those inside it
    return {q: names.claim(names.new("quot"))
            for q in sorted(found, key=lambda q: len(q.atoms(idiv)))}


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
            if isinstance(s, Barrier):
                out.append(s)
                continue
            if isinstance(s, LaneReduce):
                out.append(replace(s, name=env.get(s.name, s.name)))
                continue
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


def _copy_source(copy):
    """The array a block's copy reads."""
    (array,) = {x.array for s in walk(copy.body) if isinstance(s, Store)
                for x in S.subexpressions(s.value) if isinstance(x, S.Load)}
    return array
