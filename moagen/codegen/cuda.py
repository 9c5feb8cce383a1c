"""CUDA backend: each nest becomes a `__global__` kernel with one thread per iteration of
its parallel loops (their indices recovered from the flat thread index), as many threads a
block as its mapping says (GpuThreads); an `extern "C"` launcher with the common ABI, over
device pointers, runs the nests in order."""
import sympy

from moagen.codegen.c import CPrinter
from moagen.codegen.printer import dnf_comment, render
from moagen.onf.loops import parallel_chain

# threads a block where no mapping says (nests a step made parallel itself: a register
# tile's panels)
THREADS_PER_BLOCK = 128


class CudaPrinter(CPrinter):
    restrict = "__restrict__"

    simd_directives = False  # a GPU thread's loop is sequential code

    def kernels(self):
        out = []
        for nest in self.onf.nests:
            chain = []
            if len(nest.body) == 1 and nest.body[0].parallel:
                chain = parallel_chain(nest.body[0])
            # a nest with no parallel loops runs on a single thread
            body = self.loop_body(chain[-1], 1) if chain else self.block(nest.body, 1)
            count = self.index(sympy.Mul(*[lp.stop - lp.start for lp in chain]))
            threads = chain[0].threads if chain and chain[0].threads else THREADS_PER_BLOCK
            out.append({"name": f"{self.sig.name}_{nest.label.replace('.', '_')}",
                        "comment": self.comment(self.nest_comment(nest)), "count": count,
                        "threads": threads,
                        "prologue": self.thread_indices(chain, count), "body": body})
        return out

    def thread_indices(self, chain, count):
        """Recover the parallel loops' indices from the flat thread index, innermost
        fastest, so that neighbouring threads touch neighbouring elements."""
        pad = self.indent
        lines = [f"{pad}const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;",
                 f"{pad}if (tid >= {count}) return;"]
        stride = sympy.Integer(1)
        for lp in reversed(chain):
            extent = lp.stop - lp.start
            flat = "tid" if stride == 1 else f"(tid / {self._atom(stride)})"
            value = flat if lp is chain[0] else f"{flat} % {self._atom(extent)}"
            start = "" if lp.start == 0 else f"{self.index(lp.start)} + "
            lines.append(f"{pad}const int64_t {lp.var} = {start}{value};")
            stride = stride * extent
        return lines

    def atomic_add(self, target, value):
        return [f"atomicAdd(&{target}, {value});"]

    def _atom(self, e):
        text = self.index(e)
        return text if e.is_Atom else f"({text})"

    def unary(self, fn, arg, node):
        if fn == "rsqrt":  # CUDA's rsqrt / rsqrtf
            return self.call("rsqrt", arg)
        return super().unary(fn, arg, node)

    def max_or_min(self, fn, a, b):
        name = "f" + fn + ("f" if self.dtype == "float32" else "")  # one instruction on a GPU
        return f"{name}({a}, {b})"


def emit_cuda(onfs_by_dtype, banner):
    launchers = []
    for dtype, onf in onfs_by_dtype:
        p = CudaPrinter(onf, dtype)
        args = [a.name for a in p.sig.arrays] + [s.name for s in p.sig.sizes] + list(p.sig.scalars)
        launchers.append({"name": p.sig.name, "params": p.params(), "args": args,
                          "kernels": p.kernels()})
    dnf = CudaPrinter(onfs_by_dtype[0][1], onfs_by_dtype[0][0]).comment(
        dnf_comment([onf for _, onf in onfs_by_dtype]))
    return render("cuda/kernel.cu.j2", banner=banner, dnf=dnf, launchers=launchers)
