"""The rank layer printed in Fortran (moagen.ranks.drivers): a module of bind(C) drivers that
uses MPI's `mpi` module and the rank-local kernels' module."""
from moagen.targets.fortran.printer import wrap_statement
from moagen.ranks.drivers import block_counts, comment_lines, driver_name, slot, zigzag_blocks

F_KIND = {"float64": "c_double", "float32": "c_float"}
F_MPI_TYPE = {"float64": "MPI_DOUBLE_PRECISION", "float32": "MPI_REAL"}


def fortran_driver(mapping, dtype) -> list:
    local, merge = mapping.local_signature(dtype), mapping.merge_signature(dtype)
    kind, mpi_type = F_KIND[dtype], F_MPI_TYPE[dtype]
    arrays = mapping.driver_arrays(dtype)
    name = driver_name(mapping, dtype)
    sizes = [s.name for s in local.sizes]
    args = ["comm"] + [a.name for a in arrays] + sizes + list(local.scalars)
    counts = block_counts(mapping, dtype)
    o, lse = mapping.merged or (None, None)
    merge_args = [f"{o}_part", f"{lse}_part", o, lse] + [
        f"int({v}, c_int64_t)" if not v.isidentifier() or v == "ranks" else v
        for v in mapping.merge_args().values()] if mapping.merged else []
    intent = {"in": "intent(in)", "out": "intent(out)", "scratch": "intent(inout)"}
    lines = ["", *(f"  ! {line}" for line in comment_lines(mapping)),
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
            actual.append(outputs.get(a.name, f"{a.name}_ring({slot(mapping, a.name, 'now')})"
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
            lines += [f"        call MPI_Irecv({x}_ring({slot(mapping, x, 'later')}), int({count(x)}), "
                      f"{mpi_type}, prev, {tag}, int(comm), requests(pending + 1), ierr)",
                      f"        call MPI_Isend({x}_ring({slot(mapping, x, 'now')}), int({count(x)}), "
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
            for k, (condition, blocks) in enumerate(zigzag_blocks(mapping).items()):
                head = (("if" if k == 0 else "else if") + f" ({condition}) then"
                        if condition else "else")
                lines.append(f"      {head}")
                for role, q, key, merged in blocks:
                    names = ("low", "high")
                    lines.append(f"        ! {names[q]} queries x {names[key]} keys")
                    over = {x: f"{x}_ring({slot(mapping, x, 'now')}"
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
