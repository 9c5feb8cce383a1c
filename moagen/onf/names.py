"""Names: fresh names for locals and loop variables, the names a kernel already uses, and
the one rule for the loops and nests that schedule steps create. Integer loop variables
and floating-point locals must never share a name anywhere in a kernel (Fortran declares
them once, at the top), and neither may shadow an array, size or scalar."""
import re

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Let, Loop, ONF, Update, stmt_exprs, walk


class Names:
    """reserved: every name in use. fixed: the kernel's arrays, sizes and scalars. locals:
    the floating-point locals (loop variables must avoid them, even in other loops)."""

    def __init__(self, reserved, fixed=frozenset(), locals=frozenset()):
        self.reserved = set(reserved)
        self.fixed = frozenset(fixed)
        self.locals = set(locals)

    def new(self, hint: str, visible=()) -> str:
        """hint, or hint2, hint3, ...: the first not reserved and not in `visible`. A hint
        that ends in a digit (a copy's index, `t_0`) takes a letter instead, t_0b, t_0c, ...:
        `t_02` would read as an index of its own."""
        if hint[-1:].isdigit():
            counters = [f"{hint}{c}" for c in "bcdefghijklmnopqrstuvwxyz"]
        else:
            counters = []
        name, k = hint, 2
        while name in self.reserved or name in visible:
            if counters:
                name = counters.pop(0)
            else:
                name, k = f"{hint}_{k}" if hint[-1:].isdigit() else f"{hint}{k}", k + 1
        return name

    def claim(self, name: str) -> str:
        self.reserved.add(name)
        return name


def base_name(name: str) -> str:
    """The role a generated name was derived from: j2 -> j, c3 -> c."""
    return re.sub(r"\d+$", "", name) or name


# ---- the one naming rule for what schedule steps create --------------------------------

def loop_role(var: str, role: str) -> str:
    """The loop a step creates from the loop over var: i -> i_tile (a tile of i's
    iterations), j -> j_blk (a block of them), j -> j_in (the iterations of one part)."""
    return f"{var}_{role}"


def nest_role(label: str, role: str) -> str:
    """The nest a step creates beside nest label: rows -> rows.edge (the iterations past the
    last full tile), dQ -> dQ.zero, dQ.merge, dweight.partial, U.pack_Wg."""
    return f"{label}.{role}"


def folded_loop(vars) -> str:
    """The loop a step folds the loops over vars into: g, r -> g_r (a query head)."""
    return "_".join(vars)


# The one exception to loop_role: a loop cut into groups and their members (SplitLoop,
# h = inner g + r) becomes loops g and r, whatever it was called: the letters the
# grouped-query specs give a KV head and a query head of its group.
GROUPS, MEMBERS = "g", "r"


def kernel_names(onf: ONF) -> Names:
    """The names in use in a kernel, for choosing new ones."""
    fixed = ({b.name for b in onf.inputs + onf.outputs + onf.temps + onf.shared}
             | {s.name for s in onf.sizes} | set(onf.scalars))
    locals_, used = set(), set(fixed)
    for nest in onf.nests:
        for s in walk(nest.body):
            if isinstance(s, Loop):
                used.add(s.var.name)
            if isinstance(s, (Let, Update)):
                locals_.add(s.name)
            for e in stmt_exprs(s):
                used |= {x.var.name for x in S.subexpressions(e) if isinstance(x, S.Reduction)}
    return Names(used | locals_, fixed, locals_)


def claim_loop(names: Names, name: str, scope, who) -> sympy.Symbol:
    """The variable of a loop a step creates, called exactly `name`: it may repeat a loop
    variable of another nest or of a sibling loop, never one of the loops around or inside it
    (`scope`), a local or an array, size or scalar of the kernel."""
    if name in names.fixed | names.locals | set(scope):
        raise ScheduleError(f"{who}: the loop name {name} is taken where the step puts its "
                            "loop; give the step another")
    return sympy.Symbol(names.claim(name), integer=True)
