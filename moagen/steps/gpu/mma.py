"""WarpMma: a tiled GEMM's sum on tensor cores, a warp's tile of products as fragments."""
from dataclasses import dataclass, replace
from typing import Optional

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import simplified
from moagen.onf.loops import (BlockCopy, Buffer, Let, Loop, Mma, ONF, Operand, Store, Update,
                              grid_bounds, is_block_copy, is_fragment_loop, is_grid,
                              max_extent, most_iterations, rewrite_loops, walk)
from moagen.onf.names import kernel_names
from moagen.steps.gpu.staging import PAD
from moagen.steps.step import Step, flag, option, shown

# (m, n, k) of a product on the tensor cores, and the bytes of its operands' elements: WMMA's
# double m8n8k4 (DMMA on sm_80 and sm_90), its tf32 m16n16k8 (HMMA, float32 operands)
SHAPES = {"f64": ((8, 8, 4), 8), "3xtf32": ((16, 16, 8), 4), "tf32": ((16, 16, 8), 4)}
# WMMA's load and store: a fragment's first element 256-bit aligned, its rows (or columns)
# a multiple of 16 bytes apart
ALIGN, LDM_BYTES = 32, 16


@dataclass(frozen=True)
class WarpMma(Step):
    """The loop over `loop` (a sum, acc += a * b, or several such terms into one acc)
    inside two fragment loops (ThreadTiles'
    `fragment`: a warp's tile of rows along y, of columns along x) run by each warp as
    tensor-core products of fragments (precision: "f64" DMMA m8n8k4; "3xtf32" float32 as
    three TF32 products of m16n16k8; "tf32" one TF32 product, an opt-in of its own looser
    tolerance), `k` steps of the sum at a time; its operands read from shared tiles
    (Stage's) as fragments, the accumulators (zero before the sum) stored into a shared
    tile of the block's rows x columns, which the block copies to the output, the rows and
    columns past its ranges left out (what the output's element is of the sum, a residual
    added, computed there).
    Refused (ScheduleError): a sum that is not one product of two shared tiles' elements
    indexed by the sum's and the rows' (columns') variables, fragments of another shape than
    the precision's, a warp's fragments past the block's tile (each warp one tile), a chunk
    of the sum not whole steps of k, a tile whose rows are not 16 bytes apart or whose
    fragments would not start 32-byte aligned.
    A sum of no constant extent (over d) is taken where its operands' tiles are copied in
    whole steps of k (Stage's steps), and columns of no constant extent (O's over d) where
    every compiled bound of the size is whole warps' tiles (the output tile as wide as the
    bound). out: the output tile's name (a nest's second product); whole: the block copies
    out its whole tile, the rows and columns past the ranges too (where the operands' tiles
    are zero past them, so are those: a key block's scores past n, which the next product
    sums over in whole steps of k)."""
    loop: str
    precision: str = shown("{precision}")
    out: str = option("to {out}", "")
    whole: bool = flag("whole")
    nest: Optional[str] = None
    layer = "mapping"

    @property
    def tile(self) -> str:
        """The shared tile of the block's output."""
        if self.out:
            return self.out
        return f"{self.nest.replace('.', '_')}_out_tile" if self.nest else "out_tile"

    def __call__(self, onf: ONF) -> ONF:
        if self.precision not in SHAPES:
            raise ScheduleError(f"{self}: the precision is one of {', '.join(SHAPES)}")
        (m, n, k), element = SHAPES[self.precision]
        nest = self.nest_called(onf)
        names = kernel_names(onf)
        shared = {b.name: b for b in onf.shared}
        found = []

        def visit(stmts, frags):
            for s in stmts:
                if not isinstance(s, Loop):
                    continue
                if s.var.name == self.loop and frags and not is_fragment_loop(s):
                    found.append((s, frags))
                    continue
                visit(s.body, frags + ((s,) if is_fragment_loop(s) else ()))

        visit(nest.body, ())
        if not found:
            if any(is_fragment_loop(s) and s.var.name == self.loop for s in walk(nest.body)):
                raise ScheduleError(f"{self}: the loop over {self.loop} is a warp's fragment "
                                    "loop, not a sum inside a warp's rows and columns")
            raise ScheduleError(f"{self}: nest {nest.label} has 0 loops over "
                                f"{self.loop} inside fragment loops")
        # several such sums (a causal kernel's unmasked and diagonal key blocks, one after
        # the other): one output tile for all
        tile = None  # claimed where a sum needs it
        done = {}  # id(rows) -> (the rows' loop marked, the copy out)
        shapes = set()
        for summed, frags in found:
            if len(frags) != 2 or (frags[0].gpu.axis, frags[1].gpu.axis) != ("y", "x") or \
                    (frags[0].gpu.fragment, frags[1].gpu.fragment) != (m, n):
                raise ScheduleError(f"{self}: the sum is not inside a warp's rows (y) and columns "
                                    f"(x) as fragments of {m} x {n} ({self.precision})")
            rows, cols = frags
            bounds = grid_bounds(nest.body)
            spans = []
            for lp in frags:
                span = lp.gpu.threads * lp.gpu.tile
                most = max_extent(lp)
                if most is None and not self.whole and all(
                        v % span == 0 for _, values in bounds for v in values):
                    most = most_iterations(lp, bounds)  # in the bound: MAX_d
                    spans.append(most)
                    if most is not None:
                        continue
                if most != span:
                    raise ScheduleError(f"{self}: the loop over {lp.var} is not the block's "
                                        "warps' tiles exactly")
                spans.append(most)
            chunk = max_extent(summed)
            # a sum of no constant extent (over d): whole steps of k where its operands' tiles
            # are copied so, zero past the range (Stage's steps)
            whole = chunk is not None and chunk % k == 0 or \
                chunk is None and summed.start == 0 and all(
                    _copied_in_steps(nest.body, x.array, k) for u in summed.body
                    for x in S.subexpressions(u.value) if isinstance(x, S.Access))
            if not whole:
                raise ScheduleError(f"{self}: the loop over {self.loop} is not whole steps of {k}")
            if self.whole and not all(
                    _copied_in_steps(nest.body, x.array, 1) for u in summed.body
                    for x in S.subexpressions(u.value) if isinstance(x, S.Access)):
                raise ScheduleError(f"{self}: whole: the operands are not tiles a block's copy "
                                    "fills, zero past their ranges")
            updates = summed.body
            if not updates or any(not isinstance(u, Update) or u.op != "+"
                                  or u.name != updates[0].name for u in updates):
                raise ScheduleError(f"{self}: the loop over {self.loop} is not one sum "
                                    "acc += a * b (+ a' * b' ...: AddTermwise's terms)")
            update = updates[0]
            terms = []
            for u in updates:
                value = u.value
                if not (isinstance(value, S.Bin) and value.op == "*"
                        and isinstance(value.left, S.Access) and isinstance(value.right, S.Access)):
                    raise ScheduleError(f"{self}: {u.name}'s sum is not of products of two arrays' "
                                        "elements")
                terms.append((self._operand(value.left, rows, summed, shared, m, k, element,
                                            bounds),
                              self._operand(value.right, summed, cols, shared, k, n, element,
                                            bounds)))
            # the accumulators: locals zeroed in the columns' loop (the sum's, and where it is a
            # batch entry's, the entries' total, the sum added to it), one stored once at its end
            body = cols.body
            out = body[-1]
            inside = [s for s in walk(body) if not isinstance(s, Loop) and not _in_copy(s, body)
                      and not any(s is u for u in updates)]
            zeroed = {s.name for s in inside if isinstance(s, Let) and s.value == S.Num(0.0)}
            stored = {x.name for x in S.subexpressions(out.value) if isinstance(x, S.Local)} \
                if isinstance(out, Store) else set()
            if not (isinstance(out, Store) and not out.accumulate and len(stored) == 1
                    and stored <= zeroed and update.name in zeroed
                    and all(isinstance(s, Let) and s.name in zeroed
                            or isinstance(s, Update) and s.op == "+" and s.name in zeroed
                            and isinstance(s.value, S.Local) and s.value.name in zeroed
                            or s is out for s in inside)):
                raise ScheduleError(f"{self}: the loop over {cols.var} does more than zero "
                                    f"{update.name}, sum into it (and add it to a total) and store "
                                    "the result (of it and arrays' elements) once at its end")
            result, = stored
            extents = tuple(spans)
            direct = self._direct(out, result, rows, cols, extents, shared, m, element, bounds)
            if direct is not None:
                # the accumulators stored straight into the block's shared output (a key
                # block's P V into block_out): no tile of its own, no copy
                mark = Mma((m, n, k), tuple(terms), direct, self.precision)
                done[id(rows)] = (_marked(rows, summed, mark),)
                continue
            if tile is None:
                if self.tile in names.reserved:
                    raise ScheduleError(f"{self}: the name {self.tile} is taken")
                tile = names.claim(self.tile)
            ldc = extents[1] + PAD
            c = self._checked(Operand(tile, "row", ldc), m, element, bounds)
            mark = Mma((m, n, k), tuple(terms), c, self.precision)
            local = (rows.var - rows.start, cols.var - cols.start)
            into = Store(tile, local, S.Local(result))
            new_cols = replace(cols, body=body[:-1] + (into,))
            new_rows = replace(rows, body=tuple(new_cols if s is cols else s for s in rows.body))
            # the block's copy of its tile to the output: the rows and columns in range
            coords = [sympy.Symbol(names.claim(names.new("e")), integer=True) for _ in range(2)]
            at = {rows.var: rows.start + coords[0], cols.var: cols.start + coords[1]}
            # what the output's element is of the result (Y = R + the heads' sum: out_proj's
            # residual), the result read from the tile
            def value(e):
                if e == S.Local(result):
                    return S.Access(tile, tuple(coords))
                return S.map_children(e, value)

            copy = Store(out.array, tuple(sympy.sympify(i).xreplace(at) for i in out.index),
                         S.subs(value(out.value), at))
            for coord, lp, axis, span in reversed(list(zip(coords, frags, "yx", spans))):
                stop = sympy.Integer(span) if self.whole else simplified(lp.stop - lp.start)
                copy = Loop(coord, sympy.Integer(0), stop, (copy,), gpu=BlockCopy(axis))
            done[id(rows)] = (_marked(new_rows, summed, mark), copy)
            shapes.add((extents[0], ldc))
        if len(shapes) > 1:
            raise ScheduleError(f"{self}: the sums' output tiles have {len(shapes)} shapes")

        if not any(is_grid(s) for s in walk(nest.body)):
            raise ScheduleError(f"{self}: nest {nest.label} has no grid around its warps")
        body, _ = rewrite_loops(nest.body, lambda lp: id(lp) in done,
                                lambda lp, _: done[id(lp)])
        nests = [replace(x, body=body) if x is nest else x for x in onf.nests]
        return replace(onf.with_nests(nests, str(self)),
                       shared=onf.shared + ((Buffer(tile, shapes.pop()),) if tile else ()))

    def _direct(self, out, result, rows, cols, extents, shared, m, element, bounds):
        """The Operand of `out`'s array where the accumulators can be stored straight into
        it: a shared array (SharedScratch's, the block's own), stored the accumulator
        itself at (rows, columns) less their starts, rows major, as many rows and columns
        as the warps' tiles (the fragments past the ranges land in it too); else None."""
        target = shared.get(out.array)
        if self.whole or target is None or out.value != S.Local(result) or \
                len(out.index) != 2 or len(target.shape) != 2:
            return None
        local = [simplified(lp.var - lp.start) for lp in (rows, cols)]
        if [simplified(sympy.sympify(i)) for i in out.index] != local:
            return None
        room = [sympy.sympify(x) - sympy.sympify(e) for x, e in zip(target.shape, extents)]
        if not all(r.is_nonnegative or all(v >= 0 for v in _at_bounds(r, bounds))
                   and _at_bounds(r, bounds) for r in room):
            return None
        ldm = sympy.sympify(target.shape[-1])
        return self._checked(Operand(out.array, "row", int(ldm) if ldm.is_Integer else ldm),
                             m, element, bounds)

    def _operand(self, access, outer, inner, shared, rows, cols, element, bounds=()) -> Operand:
        """The fragment operand read by `access`: a shared tile indexed by the loops
        `outer` (the fragment's rows) and `inner` (its columns), each less its start."""
        tile = shared.get(access.array)
        if tile is None or len(access.index) != 2:
            raise ScheduleError(f"{self}: {access.array} is not a 2-D shared tile (Stage it)")
        expected = [simplified(lp.var - lp.start) for lp in (outer, inner)]
        index = [simplified(sympy.sympify(i)) for i in access.index]
        if index == expected:
            major = "row"
        elif index == expected[::-1]:
            major = "col"
        else:
            raise ScheduleError(f"{self}: {access.array}'s index {tuple(access.index)} is not "
                                f"({expected[0]}, {expected[1]}) or its transpose")
        ldm = sympy.sympify(tile.shape[-1])
        if not ldm.is_Integer and not _at_bounds(ldm, bounds):
            raise ScheduleError(f"{self}: {access.array}'s rows are not of a constant length")
        return self._checked(Operand(access.array, major, int(ldm) if ldm.is_Integer else ldm),
                             rows if major == "row" else cols, element, bounds)

    def _checked(self, operand, apart, element, bounds=()) -> Operand:
        """operand where its rows are LDM_BYTES apart and each fragment starts ALIGN-aligned
        (its tile does: moagen.steps.gpu.closing places it so): `apart` rows of it (a
        fragment's) and the fragment's extent along its rows keep that; a length of a
        size's bound (MAX_d + 4) at every compiled bound."""
        for ldm in _at_bounds(sympy.sympify(operand.ldm), bounds) or [operand.ldm]:
            ldm = int(ldm)
            if (ldm * element) % LDM_BYTES or (apart * ldm * element) % ALIGN:
                raise ScheduleError(f"{self}: {operand.array}'s rows, {operand.ldm} elements "
                                    f"apart, keep no {ALIGN}-byte alignment of its fragments")
        return operand


@dataclass(frozen=True)
class WarpTiles(Step):
    """The thread loops around the sum over `loop` (its rows along y, its columns along x
    directly inside, nothing else in that; each such sum: a causal kernel's unmasked and
    diagonal key blocks) taken by the block's warps as tiles of fragments
    of the precision's shape (WarpMma's form): `warps` (along y, along x), each a tile of
    the loop's most iterations over them. A thread loop of one mapping run with others
    (ThreadPhases' phases): the rows' loop split around the columns', so that the product
    is a phase of its own, the statements before and after it in loops of the rows' old
    mapping. The block's threads stay as many along each axis (x: 32 lanes a warp).
    Refused: no such sum, a loop past its warps' tiles or not whole fragments, and warps
    that would change the block's threads."""
    loop: str
    precision: str = shown("{precision}")
    warps: tuple = shown("{warps} warps", (1, 1))
    # a warp's tile along y, x where the loop has no constant extent (O's columns over d:
    # a warp then takes as many tiles as the size's bound needs); 0: the loop's extent
    tiles: tuple = option("tiles {tiles}", (0, 0))
    nest: Optional[str] = None
    layer = "mapping"

    def rewrite_nest(self, nest, names):
        from moagen.onf.loops import Threads, is_thread_loop
        if self.precision not in SHAPES:
            raise ScheduleError(f"{self}: the precision is one of {', '.join(SHAPES)}")
        (m, n, _), _ = SHAPES[self.precision]
        block = {lp.gpu.axis: lp.gpu.block_threads for lp in walk(nest.body)
                 if is_thread_loop(lp)}
        found = []

        bounds = grid_bounds(nest.body)

        def mapped(lp, axis, warps, fragment):
            most = max_extent(lp)
            tile = self.tiles["yx".index(axis)] or (-(-most // warps) if most else 0)
            if most is None and not (tile and all(
                    v % (warps * tile) == 0 for _, values in bounds for v in values)
                    and most_iterations(lp, bounds) is not None):
                tile = 0  # no constant extent, and no bound of whole warps' tiles
            if not tile or tile % fragment or most is not None and most > warps * tile:
                raise ScheduleError(f"{self}: the loop over {lp.var} is no whole fragments of "
                                    f"{fragment} for {warps} warps")
            gpu = Threads(axis, warps, tile, fragment)
            if block.get(axis, gpu.block_threads) != gpu.block_threads:
                raise ScheduleError(f"{self}: {warps} warps along {axis} are "
                                    f"{gpu.block_threads} threads, the block's {block[axis]}")
            return replace(lp, gpu=gpu)

        def product(cols):
            return is_thread_loop(cols) and cols.gpu.axis == "x" and not cols.gpu.fragment \
                and any(isinstance(x, Loop) and x.var.name == self.loop and x.gpu is None
                        for x in cols.body)

        def visit(stmts):
            out = []
            for s in stmts:
                if is_thread_loop(s) and s.gpu.axis == "y" and not s.gpu.fragment and \
                        any(product(c) for c in s.body):
                    at = next(k for k, c in enumerate(s.body) if product(c))
                    cols = s.body[at]
                    found.append(s)
                    if s.body[:at]:
                        out.append(replace(s, body=s.body[:at]))
                    out.append(replace(mapped(s, "y", self.warps[0], m),
                                       body=(mapped(cols, "x", self.warps[1], n),)))
                    if s.body[at + 1:]:
                        out.append(replace(s, body=s.body[at + 1:]))
                elif isinstance(s, Loop):
                    out.append(replace(s, body=visit(s.body)))
                else:
                    out.append(s)
            return tuple(out)

        body = visit(nest.body)
        if not found:
            raise ScheduleError(f"{self}: nest {nest.label} has no sum over {self.loop} in "
                                "thread loops of rows (y) and columns (x)")
        return body


def _at_bounds(e, bounds):
    """e (in MAX_ symbols) at each compiled bound, integers; [] where e is a number or
    another size's."""
    from moagen.onf.loops import bound_symbol
    if e.is_Integer or not bounds:
        return []
    values = [e.xreplace({bound_symbol(name): v}) for name, vs in bounds for v in vs]
    return values if all(v.is_Integer for v in values) else []


def _copied_in_steps(body, tile, k) -> bool:
    """Whether every block copy into `tile` runs whole steps of k along each axis (and so
    zero-fills past a range of no constant extent)."""
    copies = [lp for lp in walk(body) if is_block_copy(lp)
              and any(isinstance(x, Store) and x.array == tile for x in walk(lp.body))]
    if not copies:
        return False
    for lp in copies:
        extent = sympy.sympify(simplified(lp.stop - lp.start))
        coeff, _ = extent.as_coeff_Mul()
        if not (coeff.is_Integer and int(coeff) % k == 0):
            return False
    return True


def _in_copy(s, body) -> bool:
    """Whether s is inside a block's copy (Stage's) among body."""
    return any(is_block_copy(c) and any(x is s for x in walk(c.body))
               for c in walk(body))


def _marked(stmt, summed, mark):
    """stmt with the loop `summed` (by identity) marked."""
    if stmt is summed:
        return replace(stmt, gpu=mark)
    if isinstance(stmt, Loop):
        return replace(stmt, body=tuple(_marked(s, summed, mark) for s in stmt.body))
    return stmt
