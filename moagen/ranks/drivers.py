"""The rank layer printed in C and in Fortran: one driver function per distributed kernel and
dtype, with the ABI of moagen.onf.signature plus a leading communicator (its Fortran handle,
MPI_Comm_c2f, as an int64: what mpi4py's Comm.py2f gives and what both languages take). It
calls the rank-local kernels printed beside it and moves blocks with MPI's own calls."""
import sympy

from moagen.bind.c import declaration
from moagen.codegen.fortran import wrap_statement
from moagen.onf.signature import DTYPE_SUFFIX

C_TYPE = {"float64": "double", "float32": "float"}
C_MPI_TYPE = {"float64": "MPI_DOUBLE", "float32": "MPI_FLOAT"}
F_KIND = {"float64": "c_double", "float32": "c_float"}
F_MPI_TYPE = {"float64": "MPI_DOUBLE_PRECISION", "float32": "MPI_REAL"}


def driver_name(mapping, dtype) -> str:
    return f"{mapping.function}_{DTYPE_SUFFIX[dtype]}"


def _count(shape) -> str:
    return str(sympy.prod(shape)).replace("**", "^")


def _counts(mapping, dtype) -> dict:
    """Elements of each block that travels or is merged (zigzag: of each chunk of the
    rank's own arrays), by array name."""
    local = mapping.local_signature(dtype)
    shape = {a.name: a.shape for a in local.arrays}
    names = mapping.travel + mapping.merged
    if mapping.pattern == "owner":
        names = tuple(dict.fromkeys(names + tuple(a.name for a in local.outputs)))
    if mapping.chunks == 2:
        names = tuple(a.name for a in local.inputs + local.outputs)
    return {x: _count(shape[x]) for x in names}


def _slot(mapping, x, which):
    """The element offset of a slot of the ring's buffer of x."""
    return f"{which} * {mapping.chunks} * {x}_count" if mapping.chunks > 1 else f"{which} * {x}_count"


def _ring_steps(mapping):
    """Which blocks a zigzag step computes: (kernel role, query chunk, key chunk, merged),
    for step 0, then for blocks from a lower rank, then from a higher one."""
    return {"step == 0": (("diagonal", 0, 0, False), ("diagonal", 1, 1, False), ("local", 1, 0, True)),
            "source < rank": (("local", 0, 0, True), ("local", 1, 0, True)),
            "": (("local", 1, 0, True), ("local", 1, 1, True))}


def _comment_lines(mapping):
    if mapping.pattern == "owner":
        return [f"{mapping.name}: {mapping.local} ({mapping.variant}) over MPI ranks in owner "
                f"form, {mapping.lifted} rows a rank.",
                f"Rank r keeps its query rows; {', '.join(mapping.travel)} of one key block travel "
                "together: each step adds the block's dQ into the rank's and its "
                f"{', '.join(mapping.carried)} into the travelling sums, which go on to rank "
                "r + 1 after the step; one more pass brings them home."]
    if mapping.pattern == "zigzag":
        return [f"{mapping.name}: causal attention over MPI ranks, the sequence cut into "
                f"2 x ranks chunks of {mapping.lifted} rows; rank r holds chunks r (low) and "
                "2 ranks - 1 - r (high).",
                "At step t it holds the K, V chunks of rank s = (r - t) mod ranks (they go to "
                f"rank r + 1 while the step computes): s = r, {mapping.diagonal} on low x low "
                f"and high x high, {mapping.local} on high x low; s < r, {mapping.local} on "
                f"low and high x s's low; s > r, {mapping.local} on high x both of s's. Each "
                "block's (O, lse) is merged into its query chunk's by the logsumexp rule."]
    if mapping.pattern == "ring":
        return [f"{mapping.name}: {mapping.local} ({mapping.variant}) over MPI ranks, "
                f"{mapping.lifted} = ranks x {mapping.lifted} per rank.",
                f"Rank r holds its query rows; at step t it uses key block (r - t) mod ranks; "
                f"{', '.join(mapping.travel)} go to rank r + 1 while the step computes, and each "
                f"step's (O, lse) is merged into the running one by the logsumexp rule."]
    return [f"{mapping.name}: {mapping.local} ({mapping.variant}) over MPI ranks, the cache's "
            f"rows cut over them ({mapping.lifted} rows per rank, {mapping.empty_when_zero} of "
            f"them valid).",
            "Each rank's partial (O, lse) goes to every rank (MPI_Allgather); the parts are "
            "merged by the logsumexp rule."]


# ---------------------------------------------------------------- C

def c_driver(mapping, dtype) -> str:
    local, merge = mapping.local_signature(dtype), mapping.merge_signature(dtype)
    real, mpi_type = C_TYPE[dtype], C_MPI_TYPE[dtype]
    arrays = mapping.driver_arrays(dtype)
    params = ["int64_t comm_handle"]
    params += [f"{'const ' if a.intent == 'in' else ''}{real} *restrict {a.name}" for a in arrays]
    params += [f"int64_t {s.name}" for s in local.sizes] + [f"{real} {s}" for s in local.scalars]
    counts = _counts(mapping, dtype)
    o, lse = mapping.merged or (None, None)
    merge_args = ", ".join([f"{o}_part", f"{lse}_part", o, lse] + list(mapping.merge_args().values())) \
        if mapping.merged else ""
    lines = ["/* " + line + " */" for line in _comment_lines(mapping)]
    lines += [f"void {driver_name(mapping, dtype)}(", ",\n".join(f"    {p}" for p in params), ")",
              "{",
              "    MPI_Comm comm = MPI_Comm_f2c((MPI_Fint) comm_handle);",
              "    int rank, ranks;",
              "    MPI_Comm_rank(comm, &rank);",
              "    MPI_Comm_size(comm, &ranks);"]
    lines += [f"    const int64_t {x}_count = {c};" for x, c in counts.items()]

    def local_call(outputs, sig=local):
        args = []
        for a in sig.arrays:
            args.append(outputs.get(a.name, f"{a.name}_ring + {_slot(mapping, a.name, 'now')}"
                                    if a.name in mapping.travel else a.name))
        args += [s.name for s in sig.sizes] + list(sig.scalars)
        return f"{sig.name}({', '.join(args)});"

    def merged_call(overrides, into=False):
        """The block's (O, lse) into slot 1 of the parts, the running one (the outputs' high
        chunk where `into`) copied to slot 0, both merged into the running one."""
        at = {x: f"{x} + {x}_count" if into else x for x in mapping.merged}
        parts = {x: f"{x}_part + {x}_count" for x in mapping.merged}
        args = merge_args if not into else ", ".join(
            [f"{o}_part", f"{lse}_part", at[o], at[lse]] + list(mapping.merge_args().values()))
        return ([f"memcpy({x}_part, {at[x]}, {x}_count * sizeof({real}));" for x in mapping.merged]
                + [local_call({**overrides, **parts}), f"{merge.name}({args});"])

    if mapping.pattern == "owner":
        lines += _c_owner(mapping, local, real, mpi_type, local_call)
    elif mapping.pattern in ("ring", "zigzag"):
        count = (lambda x: f"{mapping.chunks} * {x}_count") if mapping.chunks > 1 else \
            (lambda x: f"{x}_count")
        lines += ["    const int next = (rank + 1) % ranks, prev = (rank + ranks - 1) % ranks;",
                  "    /* the rank's own blocks are where step 0 finds them */"]
        lines += [f"    memcpy({x}_ring, {x}, {count(x)} * sizeof({real}));" for x in mapping.travel]
        lines += ["    for (int step = 0; step < ranks; ++step) {",
                  "        const int64_t now = step % 2, later = 1 - now;",
                  f"        MPI_Request requests[{2 * len(mapping.travel)}];",
                  "        int pending = 0;",
                  "        if (step + 1 < ranks) {  /* the next blocks arrive while this step computes */"]
        for tag, x in enumerate(mapping.travel):
            lines += [f"            MPI_Irecv({x}_ring + {_slot(mapping, x, 'later')}, (int) ({count(x)}), "
                      f"{mpi_type}, prev, {tag}, comm, &requests[pending++]);",
                      f"            MPI_Isend({x}_ring + {_slot(mapping, x, 'now')}, (int) ({count(x)}), "
                      f"{mpi_type}, next, {tag}, comm, &requests[pending++]);"]
        lines.append("        }")
        if mapping.pattern == "ring":
            lines += ["        if (step == 0) {",
                      f"            {local_call({})}",
                      "        } else {  /* slot 0: the running result; slot 1: this block's */"]
            lines += [f"            {line}" for line in merged_call({})]
            lines.append("        }")
        else:
            sigs = {"local": local, "diagonal": mapping.diagonal_signature(dtype)}
            lines.append("        const int source = (rank - step + ranks) % ranks;  /* whose chunks */")
            for k, (condition, blocks) in enumerate(_ring_steps(mapping).items()):
                head = ("if" if k == 0 else "} else if") + f" ({condition}) {{" if condition else "} else {"
                lines.append(f"        {head}")
                for role, q, key, merged in blocks:
                    names = ("low", "high")
                    lines.append(f"            /* {names[q]} queries x {names[key]} keys */")
                    over = {x: f"{x}_ring + {_slot(mapping, x, 'now')}"
                               + (f" + {x}_count" if key else "") for x in mapping.travel}
                    over.update({a.name: f"{a.name} + {a.name}_count" if q else a.name
                                 for a in local.inputs if a.name not in mapping.travel})
                    if merged:
                        lines += [f"            {line}" for line in
                                  merged_call(over, into=bool(q))]
                    else:
                        over.update({x: f"{x} + {x}_count" if q else x for x in mapping.merged})
                        lines.append(f"            {local_call(over, sigs[role])}")
            lines.append("        }")
        lines += ["        MPI_Waitall(pending, requests, MPI_STATUSES_IGNORE);",
                  "    }"]
    else:
        lines += [f"    if ({mapping.empty_when_zero} > 0) {{",
                  f"        {local_call({})}",
                  "    } else {  /* no rows here: a part that weighs nothing */",
                  f"        for (int64_t e = 0; e < {o}_count; ++e) {o}[e] = 0;",
                  f"        for (int64_t e = 0; e < {lse}_count; ++e) {lse}[e] = -INFINITY;",
                  "    }"]
        lines += [f"    MPI_Allgather({x}, (int) {x}_count, {mpi_type}, {x}_part, (int) {x}_count, "
                  f"{mpi_type}, comm);" for x in mapping.merged]
        lines += [f"    {merge.name}({merge_args});"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _c_owner(mapping, local, real, mpi_type, local_call):
    """The owner's steps: K and V posted before the compute, the sums after it."""
    carried = mapping.carried
    blocks = [x for x in mapping.travel if x not in carried]

    def post(names, first_tag, last):
        out = []
        for tag, x in enumerate(names, first_tag):
            out += [f"    {last}MPI_Irecv({x}_ring + later * {x}_count, (int) {x}_count, {mpi_type}, "
                    f"prev, {tag}, comm, &requests[pending++]);",
                    f"    {last}MPI_Isend({x}_ring + now * {x}_count, (int) {x}_count, {mpi_type}, "
                    f"next, {tag}, comm, &requests[pending++]);"]
        return out

    outputs = [a.name for a in local.outputs]
    own = {x: x if x not in carried else f"{x}_now" for x in outputs}
    lines = ["    const int next = (rank + 1) % ranks, prev = (rank + ranks - 1) % ranks;",
             "    /* the rank's own blocks are where step 0 finds them */"]
    lines += [f"    memcpy({x}_ring, {x}, {x}_count * sizeof({real}));" for x in blocks]
    lines += ["    for (int step = 0; step < ranks; ++step) {",
              "        const int64_t now = step % 2, later = 1 - now;",
              f"        MPI_Request requests[{2 * len(mapping.travel)}];",
              "        int pending = 0;"]
    lines += [f"        {real} *const {x}_now = {x}_ring + now * {x}_count;  /* the sums of this step's block */"
              for x in carried]
    lines += ["        if (step + 1 < ranks) {  /* the next blocks arrive while this step computes */"]
    lines += post(blocks, 0, "        ")
    lines += ["        }",
              "        if (step == 0) {  /* the first block's gradients start the sums */",
              f"            {local_call(own)}",
              "        } else {",
              f"            {local_call({x: f'{x}_block' for x in outputs})}"]
    for x in outputs:
        lines += [f"            for (int64_t e = 0; e < {x}_count; ++e) {{",
                  f"                {own[x]}[e] += {x}_block[e];",
                  "            }"]
    lines += ["        }",
              "        if (ranks > 1) {  /* the sums go on with their block; after the last step, home */"]
    lines += post(carried, len(blocks), "        ")
    lines += ["        }",
              "        MPI_Waitall(pending, requests, MPI_STATUSES_IGNORE);",
              "    }",
              "    const int64_t home = ranks > 1 ? ranks % 2 : 0;  /* the slot the last pass filled */"]
    lines += [f"    memcpy({x}, {x}_ring + home * {x}_count, {x}_count * sizeof({real}));" for x in carried]
    return lines


def c_file(mapping, dtypes, banner) -> str:
    """The driver translation unit: the local kernels' prototypes, then the drivers."""
    head = ["/* " + line + " */" for line in banner]
    head += ["#include <math.h>", "#include <stdint.h>", "#include <string.h>", "#include <mpi.h>", ""]
    for dtype in dtypes:
        head.append(declaration(mapping.local_signature(dtype)))
        if mapping.merged:
            head.append(declaration(mapping.merge_signature(dtype)))
        if mapping.diagonal:
            head.append(declaration(mapping.diagonal_signature(dtype)))
    return "\n".join(head) + "\n\n" + "\n".join(c_driver(mapping, d) for d in dtypes)


# ---------------------------------------------------------------- Fortran

def fortran_driver(mapping, dtype) -> list:
    local, merge = mapping.local_signature(dtype), mapping.merge_signature(dtype)
    kind, mpi_type = F_KIND[dtype], F_MPI_TYPE[dtype]
    arrays = mapping.driver_arrays(dtype)
    name = driver_name(mapping, dtype)
    sizes = [s.name for s in local.sizes]
    args = ["comm"] + [a.name for a in arrays] + sizes + list(local.scalars)
    counts = _counts(mapping, dtype)
    o, lse = mapping.merged or (None, None)
    merge_args = [f"{o}_part", f"{lse}_part", o, lse] + [
        f"int({v}, c_int64_t)" if not v.isidentifier() or v == "ranks" else v
        for v in mapping.merge_args().values()] if mapping.merged else []
    intent = {"in": "intent(in)", "out": "intent(out)", "scratch": "intent(inout)"}
    lines = ["", *(f"  ! {line}" for line in _comment_lines(mapping)),
             f"  subroutine {name}({', '.join(args)}) &", f'      bind(C, name="{name}")',
             f"    integer(c_int64_t), value, intent(in) :: {', '.join(['comm'] + sizes)}"]
    if local.scalars:
        lines.append(f"    real({kind}), value, intent(in) :: {', '.join(local.scalars)}")
    for a in arrays:
        travels = a.name in (f"{x}_ring" for x in mapping.travel)
        lines.append(f"    real({kind}), {intent[a.intent]}{', asynchronous' if travels else ''} "
                     f":: {a.name}(0:*)")
    lines += ["    integer :: rank, ranks, ierr",
              f"    integer(c_int64_t) :: {', '.join(f'{x}_count' for x in counts)}"]
    if mapping.pattern != "gather":
        lines += [f"    integer :: next, prev, step, pending, requests({2 * len(mapping.travel)})",
                  "    integer(c_int64_t) :: now, later"]
    if mapping.pattern == "owner":
        lines.append("    integer(c_int64_t) :: home")
    if mapping.pattern == "zigzag":
        lines.append("    integer :: source")
    lines += [""]
    lines += [f"    {x}_count = {c}" for x, c in counts.items()]
    lines += ["    call MPI_Comm_rank(int(comm), rank, ierr)",
              "    call MPI_Comm_size(int(comm), ranks, ierr)"]

    def local_call(outputs, sig=local):
        actual = []
        for a in sig.arrays:
            actual.append(outputs.get(a.name, f"{a.name}_ring({_slot(mapping, a.name, 'now')})"
                                      if a.name in mapping.travel else a.name))
        return f"call {sig.name}({', '.join(actual + sizes + list(sig.scalars))})"

    def merged_call(overrides, into=False):
        """As the C driver's: the running result (its high chunk where `into`) to slot 0 of
        the parts, the block's to slot 1, both merged into the running one."""
        at = {x: f"{x}({x}_count)" if into else x for x in mapping.merged}
        rows = {x: f"{x}_count:2 * {x}_count - 1" if into else f"0:{x}_count - 1"
                for x in mapping.merged}
        args = [f"{o}_part", f"{lse}_part", at[o], at[lse]] + merge_args[4:]
        return ([f"{x}_part(0:{x}_count - 1) = {x}({rows[x]})" for x in mapping.merged]
                + [local_call({**overrides, **{x: f"{x}_part({x}_count)" for x in mapping.merged}}),
                   f"call {merge.name}({', '.join(args)})"])

    if mapping.pattern == "owner":
        lines += _fortran_owner(mapping, local, mpi_type, local_call)
    elif mapping.pattern != "gather":
        count = (lambda x: f"{mapping.chunks} * {x}_count") if mapping.chunks > 1 else \
            (lambda x: f"{x}_count")
        lines += ["    next = mod(rank + 1, ranks)", "    prev = mod(rank + ranks - 1, ranks)",
                  "    ! the rank's own blocks are where step 0 finds them"]
        lines += [f"    {x}_ring(0:{count(x)} - 1) = {x}(0:{count(x)} - 1)" for x in mapping.travel]
        lines += ["    do step = 0, ranks - 1",
                  "      now = mod(step, 2)",
                  "      later = 1 - now",
                  "      pending = 0",
                  "      if (step + 1 < ranks) then  ! the next blocks arrive while this step computes"]
        for tag, x in enumerate(mapping.travel):
            lines += [f"        call MPI_Irecv({x}_ring({_slot(mapping, x, 'later')}), int({count(x)}), "
                      f"{mpi_type}, prev, {tag}, int(comm), requests(pending + 1), ierr)",
                      f"        call MPI_Isend({x}_ring({_slot(mapping, x, 'now')}), int({count(x)}), "
                      f"{mpi_type}, next, {tag}, int(comm), requests(pending + 2), ierr)",
                      "        pending = pending + 2"]
        lines.append("      end if")
        if mapping.pattern == "ring":
            lines += ["      if (step == 0) then",
                      f"        {local_call({})}",
                      "      else  ! slot 0: the running result; slot 1: this block's"]
            lines += [f"        {line}" for line in merged_call({})]
            lines.append("      end if")
        else:
            sigs = {"local": local, "diagonal": mapping.diagonal_signature(dtype)}
            lines.append("      source = mod(rank - step + ranks, ranks)  ! whose chunks")
            for k, (condition, blocks) in enumerate(_ring_steps(mapping).items()):
                head = (("if" if k == 0 else "else if") + f" ({condition}) then"
                        if condition else "else")
                lines.append(f"      {head}")
                for role, q, key, merged in blocks:
                    names = ("low", "high")
                    lines.append(f"        ! {names[q]} queries x {names[key]} keys")
                    over = {x: f"{x}_ring({_slot(mapping, x, 'now')}"
                               + (f" + {x}_count)" if key else ")") for x in mapping.travel}
                    over.update({a.name: f"{a.name}({a.name}_count)" if q else a.name
                                 for a in local.inputs if a.name not in mapping.travel})
                    if merged:
                        lines += [f"        {line}" for line in merged_call(over, into=bool(q))]
                    else:
                        over.update({x: f"{x}({x}_count)" if q else x for x in mapping.merged})
                        lines.append(f"        {local_call(over, sigs[role])}")
            lines.append("      end if")
        lines += ["      call MPI_Waitall(pending, requests, MPI_STATUSES_IGNORE, ierr)",
                  "    end do"]
    else:
        lines += [f"    if ({mapping.empty_when_zero} > 0) then",
                  f"      {local_call({})}",
                  "    else  ! no rows here: a part that weighs nothing",
                  f"      {o}(0:{o}_count - 1) = 0",
                  f"      {lse}(0:{lse}_count - 1) = ieee_value(0.0_{kind}, ieee_negative_inf)",
                  "    end if"]
        lines += [f"    call MPI_Allgather({x}, int({x}_count), {mpi_type}, {x}_part, int({x}_count), "
                  f"{mpi_type}, int(comm), ierr)" for x in mapping.merged]
        lines += [f"    call {merge.name}({', '.join(merge_args)})"]
    lines.append(f"  end subroutine {name}")
    return lines


def _fortran_owner(mapping, local, mpi_type, local_call):
    """As _c_owner: K and V posted before the compute, the sums after it."""
    carried = mapping.carried
    blocks = [x for x in mapping.travel if x not in carried]

    def post(names, first_tag, indent):
        out = []
        for tag, x in enumerate(names, first_tag):
            out += [f"{indent}call MPI_Irecv({x}_ring(later * {x}_count), int({x}_count), {mpi_type}, "
                    f"prev, {tag}, int(comm), requests(pending + 1), ierr)",
                    f"{indent}call MPI_Isend({x}_ring(now * {x}_count), int({x}_count), {mpi_type}, "
                    f"next, {tag}, int(comm), requests(pending + 2), ierr)",
                    f"{indent}pending = pending + 2"]
        return out

    outputs = [a.name for a in local.outputs]
    own = {x: x if x not in carried else f"{x}_ring(now * {x}_count)" for x in outputs}
    lines = ["    next = mod(rank + 1, ranks)", "    prev = mod(rank + ranks - 1, ranks)",
             "    ! the rank's own blocks are where step 0 finds them"]
    lines += [f"    {x}_ring(0:{x}_count - 1) = {x}(0:{x}_count - 1)" for x in blocks]
    lines += ["    do step = 0, ranks - 1",
              "      now = mod(step, 2)",
              "      later = 1 - now",
              "      pending = 0",
              "      if (step + 1 < ranks) then  ! the next blocks arrive while this step computes"]
    lines += post(blocks, 0, "        ")
    lines += ["      end if",
              "      if (step == 0) then  ! the first block's gradients start the sums",
              f"        {local_call(own)}",
              "      else",
              f"        {local_call({x: f'{x}_block' for x in outputs})}"]
    for x in outputs:
        target = (f"{x}_ring(now * {x}_count:now * {x}_count + {x}_count - 1)" if x in carried
                  else f"{x}(0:{x}_count - 1)")
        lines.append(f"        {target} = {target} + {x}_block(0:{x}_count - 1)")
    lines += ["      end if",
              "      if (ranks > 1) then  ! the sums go on with their block; after the last step, home"]
    lines += post(carried, len(blocks), "        ")
    lines += ["      end if",
              "      call MPI_Waitall(pending, requests, MPI_STATUSES_IGNORE, ierr)",
              "    end do",
              "    home = merge(mod(ranks, 2), 0, ranks > 1)  ! the slot the last pass filled"]
    lines += [f"    {x}(0:{x}_count - 1) = {x}_ring(home * {x}_count:home * {x}_count + {x}_count - 1)"
              for x in carried]
    return lines


DRIVER_MODULE = "moagen_ranks"


def fortran_file(mapping, dtypes, banner, kernels_module) -> str:
    """The driver module: MPI's Fortran bindings and the rank-local kernels' module."""
    lines = [f"! {line}" for line in banner]
    lines += [f"module {DRIVER_MODULE}",
              "  use, intrinsic :: iso_c_binding, only: c_double, c_float, c_int64_t",
              "  use, intrinsic :: ieee_arithmetic, only: ieee_value, ieee_negative_inf",
              "  use mpi",
              f"  use {kernels_module}",
              "  implicit none",
              "", "contains"]
    for dtype in dtypes:
        lines += fortran_driver(mapping, dtype)
    lines += ["", f"end module {DRIVER_MODULE}"]
    return "".join(w + "\n" for line in lines for w in wrap_statement(line))
