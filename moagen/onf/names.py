"""Fresh names for locals and loop variables. Integer loop variables and floating-point
locals must never share a name anywhere in a kernel (Fortran declares them once, at the
top), and neither may shadow an array, size or scalar."""
import re


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
