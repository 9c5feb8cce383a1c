"""CUDA backend: each nest becomes a `__global__` kernel with one thread per iteration of
its parallel loops (their indices recovered from the flat thread index), as many threads a
block as its mapping says (GpuThreads), or a thread block per iteration whose threads
share the loops inside it (GpuBlocks: moagen.steps.loop.gpu_blocks); an `extern "C"` launcher
with the common ABI, over device pointers, runs the nests in order."""
import sympy

from moagen.moa import scalar as S
from moagen.targets.c.printer import CPrinter
from moagen.targets.printer import Printer, arrays_in, dnf_comment, names_used
from moagen.targets.cuda.tiled import TiledKernel, is_tiled
from moagen.templates import render
from moagen.onf.loops import (Let, Loop, Mma, Store, Update, arrays_read, is_block_copy,
                              is_thread_loop, parallel_chain, stmt_exprs, walk)

# threads a block where no mapping says (nests a step made parallel itself: a register
# tile's panels)
THREADS_PER_BLOCK = 128


class CudaPrinter(CPrinter):
    restrict = "__restrict__"

    simd_directives = False  # a GPU thread's loop is sequential code
    kept = Printer.kept  # a GPU thread's select is a predicated move, not a branch

    def __init__(self, onf, dtype):
        super().__init__(onf, dtype)
        self.block_level = False  # printing what a GpuBlocks block's threads all run
        self.owned = frozenset()  # the arrays of that block each of whose elements one thread's
        self.block_reductions = False  # whether a kernel calls moagen_block_reduce
        self.tiled = None  # the TiledKernel being printed

    def kernels(self):
        out = []
        for nest in self.onf.nests:
            if is_tiled(nest):
                out.append(self.tiled_kernel(nest))
                continue
            chain = []
            if len(nest.body) == 1 and nest.body[0].parallel:
                chain = parallel_chain(nest.body[0])
            per_block = bool(chain) and chain[0].per_block
            extent = sympy.Mul(*[lp.stop - lp.start for lp in chain])
            count = self.index(extent)
            if per_block:  # a block per iteration: exactly `count` blocks
                prologue = self.indices(chain, "blk", ["const int64_t blk = blockIdx.x;"])
            else:
                prologue = self.indices(chain, "tid", [
                    "const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;",
                    f"if (tid >= {count}) return;"])
            self.block_level = per_block
            self.owned = thread_owned(nest.body) if per_block else frozenset()
            # a nest with no parallel loops runs on a single thread
            body = self.loop_body(chain[-1], 1) if chain else self.block(nest.body, 1)
            self.block_level, self.owned = False, frozenset()
            threads = chain[0].threads if chain and chain[0].threads else THREADS_PER_BLOCK
            used = names_used(nest.body)
            blocks = extent if per_block else sympy.ceiling(extent / threads)
            out.append({"name": f"{self.sig.name}_{nest.label.replace('.', '_')}",
                        "comment": self.comment(self.nest_comment(nest)), "count": count,
                        "threads": threads, "per_block": per_block, "tiled": False,
                        "template": [],
                        # the launch's geometry, in the signature's size symbols: what
                        # moagen.cost reads (blocks, waves, shared memory a block)
                        "grid": (blocks, sympy.Integer(1), sympy.Integer(1)),
                        "block": (threads, 1, 1), "dynamic_shared_bytes": sympy.Integer(0),
                        "params": [p for name, p in zip(self.arg_names(), self.params())
                                   if name in used],
                        "args": [name for name in self.arg_names() if name in used],
                        "prologue": prologue, "body": body})
        return out

    def tiled_kernel(self, nest):
        """A nest of moagen.steps.gpu: a block per grid iteration (moagen.targets.cuda.tiled)."""
        self.tiled = kernel = TiledKernel(self, nest)
        prologue, body = kernel.prologue(), kernel.lines()
        self.tiled = None
        used = names_used(nest.body) - {b.name for b in self.onf.shared}
        grid = kernel.grid_dims()
        instances = kernel.instances()
        return {"name": f"{self.sig.name}_{nest.label.replace('.', '_')}",
                "comment": self.comment(self.nest_comment(nest)),
                "count": self.index(sympy.Mul(*grid)), "tiled": True,
                "template": kernel.template(), "launches": kernel.specializations(),
                "grid_text": ", ".join(f"(unsigned int)({self.index(g)})" for g in grid),
                "block_text": ", ".join(map(str, kernel.block_dims)),
                "grid": grid, "block": kernel.block_dims,
                # the bytes of the instance the sizes launch (NaN: past every bound)
                "dynamic_shared_bytes": sympy.Piecewise(
                    *((b, c) for c, _, b in instances), (sympy.nan, True)),
                "instances": [(c, arguments) for c, arguments, _ in instances],
                "params": [p for name, p in zip(self.arg_names(), self.params()) if name in used],
                "args": [name for name in self.arg_names() if name in used],
                "prologue": prologue, "body": body}

    # a tiled kernel's locals are a thread's register tiles, indexed by its slots
    def let(self, name, value, mutable):
        if self.tiled and name in self.tiled.locals:
            return f"{self.tiled.local(name)} = {value};"
        return super().let(name, value, mutable)

    def update(self, name, op, value):
        return super().update(self.tiled.local(name) if self.tiled else name, op, value)

    def expr(self, e):
        if self.tiled and isinstance(e, S.Local):
            return self.tiled.local(e.name)
        return super().expr(e)

    def arg_names(self):
        """The launcher's arguments, in the order of `params`."""
        return ([a.name for a in self.sig.arrays] + [s.name for s in self.sig.sizes]
                + list(self.sig.scalars))

    def indices(self, chain, flat_name, first):
        """Recover the parallel loops' indices from a flat index (a thread's, or a block's),
        innermost fastest, so that neighbouring threads touch neighbouring elements."""
        lines = [self.indent + line for line in first]
        stride = sympy.Integer(1)
        for lp in reversed(chain):
            extent = lp.stop - lp.start
            flat = flat_name if stride == 1 else f"({flat_name} / {self._atom(stride)})"
            value = flat if lp is chain[0] else f"{flat} % {self._atom(extent)}"
            start = "" if lp.start == 0 else f"{self.index(lp.start)} + "
            lines.append(f"{self.indent}const int64_t {lp.var} = {start}{value};")
            stride = stride * extent
        return lines

    # ---- a block per iteration (GpuBlocks) ----------------------------------------------
    def block(self, stmts, depth):
        """At a block's level: every statement on every thread, but stores (thread 0's),
        and a barrier before a statement that touches an array an earlier one wrote, or
        writes one an earlier one read, since the last barrier."""
        if not self.block_level:
            return super().block(stmts, depth)
        lines, written, read = [], set(), set()
        guarded = False  # the last lines are thread 0's stores, in their `if`
        for s in stmts:
            reads = arrays_read([s]) - self.owned
            writes = {x.array for x in walk([s]) if isinstance(x, Store)} - self.owned
            if (reads | writes) & written or writes & read:
                lines.append(self.indent * depth + "__syncthreads();")
                written, read, guarded = set(), set(), False
            written, read = written | writes, read | reads
            if isinstance(s, Store):
                if guarded:  # another store of thread 0's, in the same `if`
                    lines.pop()
                else:
                    lines.append(self.indent * depth + "if (threadIdx.x == 0) {")
                lines += super().block((s,), depth + 1) + [self.indent * depth + "}"]
                guarded = True
            else:
                lines += super().block((s,), depth)
                guarded = False
        return lines

    def loop(self, loop, depth):
        if loop.across_threads:
            return self.shared_loop(loop, depth)
        lines = super().loop(loop, depth)
        if self.block_level and any(isinstance(s, Store) and s.array not in self.owned
                                    for s in walk(loop.body)):
            # what one iteration wrote, the next may read on another thread
            lines.insert(-1, self.indent * (depth + 1) + "__syncthreads();")
        return lines

    def shared_loop(self, loop, depth):
        """A loop whose iterations a block's threads share, thread t taking t, t + blockDim.x,
        ...; then the block-wide total of each local it accumulated."""
        pad, v = self.indent * depth, loop.var
        start = "" if loop.start == 0 else f"{self.index(loop.start)} + "
        lines = [f"{pad}for (int64_t {v} = {start}threadIdx.x; "
                 f"{v} < {self.index(loop.stop)}; {v} += blockDim.x) {{"]
        self.block_level = False  # inside, each thread runs its own iterations
        lines += self.loop_body(loop, depth + 1) + [pad + "}"]
        self.block_level = True
        own = {s.name for s in walk(loop.body) if isinstance(s, Let)}
        partials = {s.name: s.op for s in walk(loop.body) if isinstance(s, Update) and s.name not in own}
        for name, op in partials.items():
            combine = "moagen_sum" if op == "+" else "moagen_max"
            lines.append(f"{pad}{name} = moagen_block_reduce({name}, {combine}());")
            self.block_reductions = True
        return lines

    def atomic_add(self, target, value):
        return [f"atomicAdd(&{target}, {value});"]

    def _atom(self, e):
        text = self.index(e)
        return text if e.is_Atom else f"({text})"

    # CUDA has rsqrt / rsqrtf: a call, not a quotient
    QUOTIENTS = {fn: denominator for fn, denominator in CPrinter.QUOTIENTS.items()
                 if fn != "rsqrt"}

    flushed_exp = Printer.flushed_exp  # inline: no helper in a .cu file, fmax one instruction

    def max_or_min(self, fn, a, b):
        name = "f" + fn + ("f" if self.dtype == "float32" else "")  # one instruction on a GPU
        return f"{name}({a}, {b})"


def thread_owned(stmts) -> frozenset:
    """The arrays of a GpuBlocks block (its statements `stmts`, laid out) each of whose
    elements only one of its threads touches, so that no barrier need order their accesses:
    those every access of which lies in a loop the threads share over [0, L), at an offset
    v + L*R (v the loop's variable, R an integer polynomial free of v). Such an element e
    is v = e mod L's, thread v mod blockDim.x's, in every loop and at every iteration
    around it (a part's dweight partials, a row's dx)."""
    owned, other = set(), set()

    def visit(stmts, shared):
        for s in stmts:
            if isinstance(s, Loop):
                inner = s if s.across_threads else shared
                visit(s.body, inner)
                continue
            # an access by a multi-index (not laid out) is never taken as owned
            accesses = [(e.array, e.offset if isinstance(e, S.Load) else None)
                        for x in stmt_exprs(s) for e in S.subexpressions(x)
                        if isinstance(e, (S.Load, S.Access))]
            if isinstance(s, Store):
                accesses.append((s.array, s.index[0] if len(s.index) == 1 else None))
            for array, offset in accesses:
                (owned if _owned_offset(offset, shared) else other).add(array)

    visit(stmts, None)
    return frozenset(owned - other)


def _owned_offset(offset, loop) -> bool:
    """Whether `offset` is v + L*R inside the shared loop `loop` over v in [0, L)."""
    if loop is None or offset is None or loop.start != 0:
        return False
    rest = sympy.cancel((sympy.sympify(offset) - loop.var) / loop.stop)
    if loop.var in rest.free_symbols:
        return False
    if not rest.free_symbols:
        return rest.is_integer is True
    if not rest.is_polynomial(*rest.free_symbols) or \
            not all(v.is_integer for v in rest.free_symbols):
        return False
    return all(c.is_integer for c in sympy.Poly(rest, *rest.free_symbols).coeffs())


def emit_cuda(onfs_by_dtype, banner):
    launchers, keep = [], False
    for dtype, onf in onfs_by_dtype:
        p = CudaPrinter(onf, dtype)
        launchers.append({"name": p.sig.name, "params": p.params(), "kernels": p.kernels(),
                          "block_reductions": p.block_reductions})
        keep = keep or p.uses_keep
    dnf = CudaPrinter(onfs_by_dtype[0][1], onfs_by_dtype[0][0]).comment(
        dnf_comment([onf for _, onf in onfs_by_dtype]))
    return render("cuda/kernel.cu.j2", banner=banner, dnf=dnf, launchers=launchers,
                  block_reductions=any(l["block_reductions"] for l in launchers),
                  keep=keep, qualifier="__device__ static inline ", helper_directive="",
                  tiled=any(k["tiled"] for l in launchers for k in l["kernels"]),
                  vector_loads=any((is_thread_loop(lp) or is_block_copy(lp)) and lp.gpu.vector
                                   for _, onf in onfs_by_dtype
                                   for n in onf.nests for lp in walk(n.body)),
                  mma=any(isinstance(lp.gpu, Mma) for _, onf in onfs_by_dtype
                          for n in onf.nests for lp in walk(n.body) if isinstance(lp, Loop)))
