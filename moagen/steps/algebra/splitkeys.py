"""Split over keys: an ONF rewrite that lets one query row use every core.

It takes a nest that OnlineSoftmax produced, `for heads..: state = init; for j: update;
finish`, whose state is a running max m, a running sum l and rescaled rows X, and cuts the
loop over j into `splits` slices run in parallel:

    partial  for heads.., s:  state = init; for j in slice s: update;
                              m_part[.., s] = m; l_part[.., s] = l; X_part[.., s, :] = X
    merge    for heads..:     m = max_s m_part;  l = sum_s l_part * exp(m_part - m)
                              X = sum_s X_part * exp(m_part - m);  finish

The merge is the logsumexp rule: each slice's partial results rescaled to the global max.
An empty slice (more slices than rows) has m = -inf, l = 0, X = 0 and weighs nothing.
"""
from dataclasses import dataclass, replace
from typing import Optional, Tuple, Union

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.loops import (Buffer, Let, Loop, Nest, ONF, Store, Update, enclose, loop_vars,
                              map_stmt_exprs, perfect_chain, walk)
from moagen.onf.names import claim_loop, kernel_names, loop_role, nest_role
from moagen.steps.step import Step, option, shown


@dataclass(frozen=True)
class SplitKeys(Step):
    layer = "algorithm"
    nest: str
    over: Tuple[str, ...] = shown("over=({over})")  # the loops outside the split (batch, head)
    var: str  # the loop over keys
    splits: Union[int, sympy.Expr]  # a count, or one from the sizes (the keys': n)
    # rows a slice (None: the rows shared evenly), a count or an expression of sizes the
    # call makes at least 1 (GivenSize's); then splits must be k ceil(extent / (k rows)),
    # enough whole slices for the rows, k of them at a time
    rows: Optional[Union[int, sympy.Expr]] = option("{rows} rows a slice", None)

    @property
    def slices(self) -> str:
        """The loop over the slices it creates (j_split)."""
        return loop_role(self.var, "split")

    @property
    def partial(self) -> str:
        """The nest it creates that computes each slice's partial results."""
        return nest_role(self.nest, "partial")

    @property
    def merge(self) -> str:
        """The nest it creates that merges the slices by their logsumexp."""
        return nest_role(self.nest, "merge")

    def __call__(self, onf: ONF) -> ONF:
        nest = next((n for n in onf.nests if n.label == self.nest), None)
        chain = perfect_chain(nest.body, len(self.over)) if nest else None
        if chain is None or [lp.var.name for lp in chain] != list(self.over):
            raise ScheduleError(f"{self}: no nest {self.nest} starting with loops "
                                f"{', '.join(self.over)}")
        splits = sympy.sympify(self.splits)
        if splits.is_Integer and splits < 1 or not splits.free_symbols <= set(onf.sizes):
            raise ScheduleError(f"{self}: the number of splits must be at least 1, a count "
                                "or an expression of the kernel's sizes")
        body = list(chain[-1].body)
        jpos = next((k for k, s in enumerate(body) if isinstance(s, Loop)
                     and s.var.name == self.var), None)
        if jpos is None:
            raise ScheduleError(f"{self}: nest {self.nest} has no loop {self.var}")
        loop = body[jpos]
        m, l = self._state(loop)
        rows = self._rows(loop, chain)
        names = kernel_names(onf)
        inside = loop_vars((loop,))
        s = claim_loop(names, self.slices, {lp.var.name for lp in chain} | inside, self)
        heads = tuple(lp.var for lp in chain)
        extents = tuple(lp.stop - lp.start for lp in chain)
        shapes = {b.name: b.shape for b in onf.outputs + onf.temps}
        part = {x: names.claim(names.new(f"{x}_part")) for x in [m, l] + rows}
        temps = tuple(Buffer(part[x], extents + (splits,)) for x in (m, l)) + tuple(
            Buffer(part[x], extents + (splits,) + shapes[x][len(chain):]) for x in rows)

        def to_part(e):  # X[heads.., tail..] -> X_part[heads.., s, tail..]
            if isinstance(e, S.Access) and e.array in rows:
                return S.Access(part[e.array], heads + (s,) + e.index[len(heads):])
            return S.map_children(e, to_part)

        def stmt_to_part(st):
            st = map_stmt_exprs(st, to_part) if not isinstance(st, Loop) else replace(
                st, body=tuple(stmt_to_part(b) for b in st.body))
            if isinstance(st, Store) and st.array in rows:
                st = replace(st, array=part[st.array], index=heads + (s,) + st.index[len(heads):])
            return st

        chunk = self._chunk(loop.stop - loop.start, splits, set(onf.sizes))
        first = loop.start + s * chunk
        sliced = replace(loop, start=first, stop=sympy.Min(loop.stop, first + chunk))
        keep = [Store(part[x], heads + (s,), S.Local(x)) for x in (m, l)]
        partial_body = [stmt_to_part(st) for st in body[:jpos] + [sliced]] + keep
        partial = Nest(nest.target, enclose(chain, (Loop(s, sympy.Integer(0),
                                                         splits,
                                                         tuple(partial_body)),)),
                       nest.origin, self.partial)
        merge = Nest(nest.target, enclose(chain, tuple(self._merge(m, l, rows, part, heads, s,
                                                                   loop) + body[jpos + 1:])),
                     nest.origin, self.merge)
        nests = []
        for n in onf.nests:
            nests += [partial, merge] if n is nest else [n]
        return replace(onf.with_nests(nests, str(self)), temps=onf.temps + temps)

    def _chunk(self, extent, splits, sizes):
        """The rows of a slice; refused: `rows` below 1 or not of the sizes, or with a
        count of slices that is not k whole slices' worth of the extent, k at a time."""
        if self.rows is None:
            return idiv(extent + splits - 1, splits)
        rows, k = sympy.sympify(self.rows), splits.as_coeff_Mul()[0]
        if rows.is_Integer and rows < 1 or not rows.free_symbols <= sizes:
            raise ScheduleError(f"{self}: the rows a slice must be at least 1, a count or an "
                                "expression of the kernel's sizes")
        if not k.is_Integer or splits != k * idiv(extent + k * rows - 1, k * rows):
            raise ScheduleError(f"{self}: with {rows} rows a slice the slices must be "
                                f"k ceil(({extent}) / ({rows} k)) for an integer k")
        return rows

    def _state(self, loop):
        """The running max m and sum l: the locals the loop assigns, m in max(m, score)."""
        assigned = [st for st in loop.body if isinstance(st, Update) and st.op == "="]
        maxima = {e.left.name for st in walk(loop.body) if isinstance(st, Let)
                  for e in [st.value] if isinstance(e, S.Bin) and e.op == "max"
                  and isinstance(e.left, S.Local)}
        names = [st.name for st in assigned]
        m = [x for x in names if x in maxima]
        if len(names) != 2 or len(m) != 1:
            raise ScheduleError(f"{self}: the loop over {self.var} is not an online softmax "
                                f"(a running max and a running sum)")
        return m[0], next(x for x in names if x != m[0])

    def _rows(self, loop, chain):
        """The arrays the loop accumulates rescaled, indexed by the outer loops first."""
        rows = []
        for st in walk(loop.body):
            if isinstance(st, Store):
                if st.accumulate or st.atomic or tuple(st.index[:len(chain)]) != \
                        tuple(lp.var for lp in chain):
                    raise ScheduleError(f"{self}: store to {st.array} is not a row of the "
                                        f"outer loops' own output")
                rows.append(st.array)
        return list(dict.fromkeys(rows))

    def _merge(self, m, l, rows, part, heads, s, loop):
        """The logsumexp rule, combining the slices' partial results."""
        m_s = S.Access(part[m], heads + (s,))
        weight = S.Un("exp", S.Bin("-", m_s, S.Local(m)))
        splits = sympy.sympify(self.splits)
        out = [Let(m, S.Reduction("max", s, splits, m_s, m)),
               Let(l, S.Reduction("+", s, splits,
                                  S.Bin("*", S.Access(part[l], heads + (s,)), weight), l))]
        for x in rows:
            store, loops = next((st, lps) for st, lps in _stores(loop.body, ()) if st.array == x)
            tail = store.index[len(heads):]
            value = S.Reduction("+", s, splits,
                                S.Bin("*", S.Access(part[x], heads + (s,) + tail), weight), "acc")
            out.append(enclose(loops, (Store(x, store.index, value),))[0])
        return out


def _stores(stmts, loops):
    for st in stmts:
        if isinstance(st, Loop):
            yield from _stores(st.body, loops + (st,))
        elif isinstance(st, Store):
            yield st, loops

