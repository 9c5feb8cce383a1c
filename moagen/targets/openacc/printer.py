"""OpenACC: the C and the Fortran printers with OpenACC directives for what the OpenMP ones
print on a CPU. One data region around the kernel's nests moves its arrays (inputs copied
in, outputs copied out, what it updates both ways, scratch created on the device); each
nest then runs as one compute construct over arrays already present: its parallel chain
(a GpuThreads mapping) as `parallel loop gang vector collapse(k)`, a vector lane an
iteration, `vector_length` the mapping's threads a block; a nest with no parallel loop as
`serial`, so that it too runs where its arrays are. Atomic sums are `atomic update`;
loops the CPU vectorizes are a lane's sequential code (no `simd`)."""
import sympy

from moagen.targets.c.printer import CPrinter
from moagen.targets.fortran.printer import FortranPrinter
from moagen.targets.printer import arrays_in
from moagen.errors import ScheduleError
from moagen.onf.loops import Loop, walk

# the data clause of a kernel argument, by its intent (moagen.onf.signature.ArrayParam)
DATA_CLAUSE = {"in": "copyin", "out": "copyout", "inout": "copy", "scratch": "create"}


class _OpenAcc:
    """What the C and Fortran OpenACC printers share. Each language gives the `sentinel` a
    directive starts with, the depth of a function's statements (`body_depth`), a region
    around lines (`region`), the data directive's lines, the `private` clause of a parallel
    chain and an array with its extent in a data clause (`extent`)."""
    sentinel: str
    simd_directives = False  # a vector lane runs its loops in order

    def compute_construct(self, loop):
        """The directive that runs a parallel chain on the device."""
        threads = f" vector_length({loop.threads})" if loop.threads else ""
        return (f"{self.sentinel} parallel loop gang vector collapse({loop.parallel}){threads}"
                f"{self.present(walk(loop.body))}{self.private(loop)}")

    def nest_block(self, nest, depth):
        """A nest that starts parallel loops only, or a serial region of its own."""
        top = [s for s in nest.body if isinstance(s, Loop) and s.parallel]
        if top:
            if len(top) != len(nest.body):
                raise ScheduleError(f"OpenACC: nest {nest.label} runs statements next to its "
                                    "parallel loops; map them into one parallel chain")
            return self.block(nest.body, depth)
        if any(isinstance(s, Loop) and s.parallel for s in walk(nest.body)):
            raise ScheduleError(f"OpenACC: nest {nest.label} runs parallel loops inside "
                                "sequential ones; make the outermost loops the parallel chain")
        pad = self.indent * depth
        return ([f"{pad}{self.sentinel} serial{self.present(walk(nest.body))}"]
                + self.region(self.block(nest.body, depth), pad, "serial"))

    def function_body(self, lines):
        by_clause = {}
        for a in self.sig.arrays:
            by_clause.setdefault(DATA_CLAUSE[a.intent], []).append(self.extent(a))
        clauses = [f"{clause}({', '.join(names)})" for clause, names in by_clause.items()]
        pad = self.indent * self.body_depth
        return [pad + line for line in self.data_directive(clauses)] + self.region(lines, pad, "data")

    def present(self, stmts):
        names = arrays_in(list(stmts))
        return f" present({', '.join(names)})" if names else ""


class OpenAccC(_OpenAcc, CPrinter):
    sentinel = "#pragma acc"
    helper_directive = "#pragma acc routine seq"  # the max / min helpers run on the device
    body_depth = 1

    def parallel_directives(self, loop):
        return [self.compute_construct(loop)]

    def private(self, loop):
        return ""  # what an iteration assigns is declared inside it

    def data_directive(self, clauses):
        """A clause a line: the arrays of a kernel make a long line."""
        lines = [f"{self.sentinel} data {clauses[0]}"] + [f"    {c}" for c in clauses[1:]]
        return [line + " \\" for line in lines[:-1]] + lines[-1:]

    def region(self, lines, pad, construct):
        return [pad + "{"] + [self.indent + line for line in lines] + [pad + "}"]

    def extent(self, array):
        # the extents one by one: sympy would print n*n as pow(n, 2), a double
        size = "*".join(self.index(d) if sympy.sympify(d).is_Atom else f"({self.index(d)})"
                        for d in array.shape)
        return f"{array.name}[0:{size}]"

    def atomic_add(self, target, value):
        return ["#pragma acc atomic update", f"{target} += {value};"]


class OpenAccFortran(_OpenAcc, FortranPrinter):
    sentinel = "!$acc"
    atomic_directive = "!$acc atomic update"
    body_depth = 2

    def parallel_directives(self, loop):
        return [self.compute_construct(loop)], ["!$acc end parallel loop"]

    def private(self, loop):
        names = self.private_names(loop)
        return f" private({', '.join(names)})" if names else ""

    def data_directive(self, clauses):
        return [f"{self.sentinel} data {' '.join(clauses)}"]  # wrapped as any long line

    def region(self, lines, pad, construct):
        return [self.indent + line for line in lines] + [f"{pad}!$acc end {construct}"]

    def extent(self, array):
        return array.name  # an explicit-shape dummy: the whole array


class OpenAccCPlainPointers(OpenAccC):
    restrict = ""  # the ablation of moagen.targets.c.target.NO_RESTRICT, offloaded
