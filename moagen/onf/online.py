"""The online softmax: an ONF rewrite that changes the arithmetic and keeps the value.

It recognises, in one block (after Hoist),

    let m = max_j f(j)
    let l = sum_j exp(f(j) - m)
    for j: ... exp(f(j) - m) / l ... ; X += t * g(j)

and fuses the three passes over j into one, with a running max and sum:

    let m = -inf;  let l = 0
    for j: s = f(j); m' = max(m, s); a = exp(m - m'); p = exp(s - m')
           l = l * a + p;  X = X * a + p * g(j);  m = m'
    X = X / l

One of a and p is exp(0) = 1 (a when s <= m, p when s > m), so one exponential per key
suffices: e = exp(min(m, s) - m'), a = (s > m ? e : 1), p = (s > m ? 1 : e), bit for bit
the same values (an exponential costs tens of multiply-adds' time).

Preconditions, checked: the same f in all three (up to bound names); every use of m and l
inside the loop is that exact quotient; every store inside accumulates a sum.
"""
from dataclasses import dataclass, replace

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import (Let, Loop, ONF, Store, Update, enclose, map_stmt_exprs,
                              stmt_exprs, walk)
from moagen.onf.schedule import kernel_names


@dataclass(frozen=True)
class OnlineSoftmax:
    nest: str

    def __str__(self):
        return f"online_softmax({self.nest})"

    def __call__(self, onf: ONF) -> ONF:
        names = kernel_names(onf)
        found = []
        nests = [replace(n, body=self._block(n.body, names, found)) if n.label == self.nest else n
                 for n in onf.nests]
        if not found:
            raise ScheduleError(f"{self}: nest {self.nest} has no max, sum of exponentials and "
                                f"loop over the same index to fuse")
        return onf.with_nests(nests, str(self))

    def _block(self, stmts, names, found):
        stmts = [replace(s, body=self._block(s.body, names, found)) if isinstance(s, Loop) else s
                 for s in stmts]
        for pos, s in enumerate(stmts):
            match = _match(stmts, pos)
            if match:
                found.append(s)
                return tuple(_rewrite(stmts, match, names, self))
        return tuple(stmts)


def _is_reduction_let(s, op):
    return isinstance(s, Let) and isinstance(s.value, S.Reduction) and s.value.op == op


def _match(stmts, pos):
    """(index of m, index of l, index of the loop, f with the loop's variable) or None."""
    if not _is_reduction_let(stmts[pos], "max"):
        return None
    m = stmts[pos]
    for lpos in range(pos + 1, len(stmts)):
        l = stmts[lpos]
        if not _is_reduction_let(l, "+"):
            continue
        body = l.value.body
        if not (isinstance(body, S.Un) and body.fn == "exp" and isinstance(body.arg, S.Bin)
                and body.arg.op == "-" and body.arg.right == S.Local(m.name)):
            continue
        if S.alpha_key(S.Reduction("max", l.value.var, l.value.extent, body.arg.left, "")) != \
                S.alpha_key(replace(m.value, name="")):
            continue
        for jpos in range(lpos + 1, len(stmts)):
            loop = stmts[jpos]
            if (isinstance(loop, Loop) and loop.start == 0 and loop.stop == m.value.extent
                    and any(m.name in S.free_names(e) for s in walk(loop.body)
                            for e in stmt_exprs(s))):
                f = S.subs(m.value.body, {m.value.var: loop.var})
                return pos, lpos, jpos, f
    return None


def _rewrite(stmts, match, names, transform):
    mpos, lpos, jpos, f = match
    m, l, loop = stmts[mpos].name, stmts[lpos].name, stmts[jpos]
    between = [s for k, s in enumerate(stmts[mpos + 1:jpos], mpos + 1) if k != lpos]
    if any({m, l} & S.free_names(e) for s in walk(between) for e in stmt_exprs(s)):
        raise ScheduleError(f"{transform}: the row max or sum is used before the fused loop")
    roles = ("score", "new_max", "exp_gap", "rescale", "p")
    fresh = {role: names.claim(names.new(role)) for role in roles}
    names.locals.update(fresh.values())
    score, new_max, gap, rescale, p = (S.Local(fresh[r]) for r in roles)
    quotient = S.alpha_key(S.Bin("/", S.Un("exp", S.Bin("-", f, S.Local(m))), S.Local(l)))

    def replace_quotient(e):
        if S.alpha_key(e) == quotient:
            return p
        return S.map_children(e, replace_quotient)

    body = _propagate_copies([map_stmt_exprs(s, replace_quotient) for s in loop.body])
    if any({m, l} & S.free_names(e) for s in walk(body) for e in stmt_exprs(s)):
        raise ScheduleError(f"{transform}: the loop uses the row max or sum other than in "
                            "exp(f - max) / sum")
    rescaled = []
    body = [_rescale(s, rescale.name, rescaled, (), transform) for s in body]
    head = [Let(fresh["score"], f),
            Let(fresh["new_max"], S.Bin("max", S.Local(m), score)),
            Let(fresh["exp_gap"], S.Un("exp", S.Bin("-", S.Bin("min", S.Local(m), score), new_max))),
            Let(fresh["rescale"], S.IfGreater(score, S.Local(m), gap, S.Num(1.0))),
            Let(fresh["p"], S.IfGreater(score, S.Local(m), S.Num(1.0), gap)),
            Update(l, "=", S.Bin("+", S.Bin("*", S.Local(l), rescale), p))]
    fused = replace(loop, body=tuple(head + body + [Update(m, "=", new_max)]))
    normalize = [enclose(loops, (replace(store, value=S.Bin("/", S.Access(store.array, store.index),
                                                            S.Local(l)), accumulate=None),))[0]
                 for store, loops in rescaled]
    out = list(stmts)
    out[mpos] = Let(m, S.Num(float("-inf")))
    out[lpos] = Let(l, S.Num(0.0))
    out[jpos:jpos + 1] = [fused] + normalize
    return out


def _propagate_copies(stmts):
    """Drop `let t = p` left behind by the rewrite and use p for t."""
    rename, out = {}, []
    for s in stmts:
        s = map_stmt_exprs(s, lambda e: S.rename_locals(e, rename)) if rename else s
        if isinstance(s, Let) and isinstance(s.value, S.Local):
            rename[s.name] = s.value.name
            continue
        out.append(s)
    return out


def _rescale(s, rescale, rescaled, loops, transform):
    """X += v becomes X = X * rescale + v; each such store is listed with its loops."""
    if isinstance(s, Loop):
        return replace(s, body=tuple(_rescale(b, rescale, rescaled, loops + (s,), transform)
                                     for b in s.body))
    if isinstance(s, Store):
        if s.accumulate != "+" or s.atomic:
            raise ScheduleError(f"{transform}: a store in the fused loop does not accumulate "
                                "a sum")
        rescaled.append((s, loops))
        old = S.Bin("*", S.Access(s.array, s.index), S.Local(rescale))
        return replace(s, value=S.Bin("+", old, s.value), accumulate=None)
    return s

