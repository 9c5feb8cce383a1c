"""The rank layer printed in C (moagen.ranks.drivers): MPI's C calls around the rank-local
kernels, one translation unit beside theirs."""
from moagen.targets.c.loader import declaration
from moagen.ranks.drivers import block_counts, comment_lines, driver_name, slot, zigzag_blocks

C_TYPE = {"float64": "double", "float32": "float"}
C_MPI_TYPE = {"float64": "MPI_DOUBLE", "float32": "MPI_FLOAT"}


def c_driver(mapping, dtype) -> str:
    local, merge = mapping.local_signature(dtype), mapping.merge_signature(dtype)
    real, mpi_type = C_TYPE[dtype], C_MPI_TYPE[dtype]
    arrays = mapping.driver_arrays(dtype)
    params = ["int64_t comm_handle"]
    params += [f"{'const ' if a.intent == 'in' else ''}{real} *restrict {a.name}" for a in arrays]
    params += [f"int64_t {s.name}" for s in local.sizes] + [f"{real} {s}" for s in local.scalars]
    counts = block_counts(mapping, dtype)
    o, lse = mapping.merged or (None, None)
    merge_args = ", ".join([f"{o}_part", f"{lse}_part", o, lse] + list(mapping.merge_args().values())) \
        if mapping.merged else ""
    lines = ["/* " + line + " */" for line in comment_lines(mapping)]
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
            args.append(outputs.get(a.name, f"{a.name}_ring + {slot(mapping, a.name, 'now')}"
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
            lines += [f"            MPI_Irecv({x}_ring + {slot(mapping, x, 'later')}, (int) ({count(x)}), "
                      f"{mpi_type}, prev, {tag}, comm, &requests[pending++]);",
                      f"            MPI_Isend({x}_ring + {slot(mapping, x, 'now')}, (int) ({count(x)}), "
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
            for k, (condition, blocks) in enumerate(zigzag_blocks(mapping).items()):
                head = ("if" if k == 0 else "} else if") + f" ({condition}) {{" if condition else "} else {"
                lines.append(f"        {head}")
                for role, q, key, merged in blocks:
                    names = ("low", "high")
                    lines.append(f"            /* {names[q]} queries x {names[key]} keys */")
                    over = {x: f"{x}_ring + {slot(mapping, x, 'now')}"
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
