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

With `block` = B > 1 the running max moves once per block of B keys, FlashAttention's way:

    for jb: for j in block jb: P[row, j - B jb] = f(j)       (the block's scores)
            m' = max(m, max_k P[row, k]);  a = exp(m - m')
            for k: P[row, k] = exp(P[row, k] - m');  l = l * a + sum_k P[row, k]
            X = X * a;  for j in block jb: X += P[row, j - B jb] * g(j);  m = m'

P is a scratch row of min(n, B) per iteration of the loops around (it stays in L1). With
`unseen` (an arbitrary added mask: a row's first blocks may hold only scores of -inf), the
max subtracted is 0 while m' is -inf: exp(-inf - -inf) would be NaN, exp(-inf - 0) is the
0 the keys' weights are (a row with no key seen at all ends 0 / 0, as the unfused form). The
scores of a block are independent dot products, the rescale of X is once per block instead
of once per key, and the accumulation into X is a plain sum the compiler can keep in
registers. The values are the same up to rounding (the sums are regrouped by block).
Where the loop weighs by P times dropout's factor D(row, j) (it depends on no index of the
loop's inner loops), the block's row takes it once per key after its sum,
P[row, k] = P[row, k] * D(row, j), and the loop reads P alone: the factor drawn once per
key, not again for every column of X, the same products.

A floored max and a clamped sum (attention_varlen's, so that a row that sees no key gets
O = 0 and lse = -inf): m = max(max_j f(j), c), c a finite number, and the loop dividing by
u = max(l, c') in l's place. The running max then starts at c (max(c, max_j f) taken in the
same pass, exactly), so a key of score -inf has weight exp(-inf - m') = 0, never NaN, and X
is divided by u, let after the loop; a row that sees no key ends with m = c, l = 0, X = 0.

Preconditions, checked: the same f in all three (up to bound names); every use of m and l
(and u) inside the loop is that exact quotient; every store inside accumulates a sum.
"""
from dataclasses import dataclass, replace
from typing import Optional

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.loops import (Let, Loop, ONF, Store, Update, enclose, loop_vars, map_stmt_exprs,
                              offsets_of, scratch_row, stmt_exprs, walk)
from moagen.onf.names import claim_loop, kernel_names, loop_role
from moagen.steps.step import Step, flag, option


@dataclass(frozen=True)
class OnlineSoftmax(Step):
    layer = "algorithm"
    nest: str
    block: int = option("block={block}", 1)  # keys per step of the running max
    unseen: bool = flag("unseen")  # a row may have seen no key after a block (its max -inf)

    def __call__(self, onf: ONF) -> ONF:
        if self.block < 1:
            raise ScheduleError(f"{self}: a block holds at least one key")
        if self.unseen and self.block == 1:
            raise ScheduleError(f"{self}: unseen is for blocks of keys (block > 1); one key "
                                "at a time has no such form")
        names = kernel_names(onf)
        found, temps = [], []
        offsets = offsets_of(onf)
        nests = [replace(n, body=self._block(n.body, names, found, temps, (), offsets))
                 if n.label == self.nest else n for n in onf.nests]
        if not found:
            raise ScheduleError(f"{self}: nest {self.nest} has no max, sum of exponentials and "
                                f"loop over the same index to fuse")
        return replace(onf.with_nests(nests, str(self)), temps=onf.temps + tuple(temps))

    def _block(self, stmts, names, found, temps, loops, offsets):
        stmts = [replace(s, body=self._block(s.body, names, found, temps, loops + (s,), offsets))
                 if isinstance(s, Loop) else s for s in stmts]
        for pos, s in enumerate(stmts):
            match = _match(stmts, pos)
            if match:
                found.append(s)
                return tuple(_rewrite(stmts, match, names, self, loops, temps, offsets))
        return tuple(stmts)


def _is_reduction_let(s, op):
    return isinstance(s, Let) and isinstance(s.value, S.Reduction) and s.value.op == op


def _row_max(s):
    """(the max reduction, its floor or None) where s is let m = max_j f(j), or m floored,
    max(max_j f(j), c) with c a finite number; else None."""
    if not isinstance(s, Let):
        return None
    value, floor = S.floored(s.value) or (s.value, None)
    if isinstance(value, S.Reduction) and value.op == "max":
        return value, floor
    return None


def _clamp(stmts, start, stop, l):
    """The index of `let u = max(l, c)` (c a finite number) in stmts[start:stop]; else None."""
    for pos in range(start, stop):
        s = stmts[pos]
        if isinstance(s, Let) and (S.floored(s.value) or (None,))[0] == S.Local(l):
            return pos
    return None


def _match(stmts, pos):
    """A Match of the max at stmts[pos], its sum and the loop over the same index; or None."""
    found = _row_max(stmts[pos])
    if not found:
        return None
    m, (row_max, floor) = stmts[pos], found
    for lpos in range(pos + 1, len(stmts)):
        l = stmts[lpos]
        if not _is_reduction_let(l, "+"):
            continue
        body = l.value.body
        if not (isinstance(body, S.Un) and body.fn == "exp" and isinstance(body.arg, S.Bin)
                and body.arg.op == "-" and body.arg.right == S.Local(m.name)):
            continue
        if S.alpha_key(S.Reduction("max", l.value.var, l.value.extent, body.arg.left, "")) != \
                S.alpha_key(replace(row_max, name="")):
            continue
        for jpos in range(lpos + 1, len(stmts)):
            loop = stmts[jpos]
            if (isinstance(loop, Loop) and loop.start == 0 and loop.stop == row_max.extent
                    and any(m.name in S.free_names(e) for s in walk(loop.body)
                            for e in stmt_exprs(s))):
                f = S.subs(row_max.body, {row_max.var: loop.var})
                return Match(pos, lpos, jpos, f, floor, _clamp(stmts, lpos + 1, jpos, l.name))
    return None


@dataclass(frozen=True)
class Match:
    """Where the three passes are in a block: m's let (floored at `floor`, or None), l's,
    the loop's, f with the loop's variable, and the let u = max(l, c) the loop divides by
    in l's place (None: it divides by l)."""
    max: int
    sum: int
    loop: int
    f: S.ScalarExpr
    floor: Optional[float]
    clamp: Optional[int]


def _rewrite(stmts, match, names, transform, loops, temps, offsets):
    m, l, loop = stmts[match.max].name, stmts[match.sum].name, stmts[match.loop]
    clamp = stmts[match.clamp] if match.clamp is not None else None
    divisor = clamp.name if clamp else l
    row = {m, l, divisor}
    between = [s for k, s in enumerate(stmts[match.max + 1:match.loop], match.max + 1)
               if k not in (match.sum, match.clamp)]
    if any(row & S.free_names(e) for s in walk(between) for e in stmt_exprs(s)):
        raise ScheduleError(f"{transform}: the row max or sum is used before the fused loop")
    quotient = S.alpha_key(S.Bin("/", S.Un("exp", S.Bin("-", match.f, S.Local(m))),
                                 S.Local(divisor)))

    def probability_is(p):
        """The loop's body with every exp(f - m) / l (or / u) replaced by p."""
        def swap(e):
            return p if S.alpha_key(e) == quotient else S.map_children(e, swap)
        body = _propagate_copies([map_stmt_exprs(s, swap) for s in loop.body])
        if any(row & S.free_names(e) for s in walk(body) for e in stmt_exprs(s)):
            raise ScheduleError(f"{transform}: the loop uses the row max or sum other than in "
                                "exp(f - max) / sum")
        return body

    online = _per_key if transform.block == 1 else _per_block
    fused, stores = online(transform, loop, match.f, m, l, probability_is, names, loops, temps,
                           offsets)
    normalize = [enclose(lps, (replace(store, value=S.Bin("/", S.Access(store.array, store.index),
                                                          S.Local(divisor)), accumulate=None),))[0]
                 for store, lps in stores]
    out = list(stmts)
    # a floored max: the running max starts at its floor, max(c, max_j f) in one pass
    out[match.max] = Let(m, S.Num(float("-inf") if match.floor is None else match.floor))
    out[match.sum] = Let(l, S.Num(0.0))
    out[match.loop:match.loop + 1] = fused + ([clamp] if clamp else []) + normalize
    if clamp:
        del out[match.clamp]  # before the loop: the indices past it stand
    return out


def _fresh(names, roles):
    fresh = {role: names.claim(names.new(role)) for role in roles}
    names.locals.update(fresh.values())
    return fresh


def _per_key(transform, loop, f, m, l, probability_is, names, loops, temps, offsets):
    """([the loop, one key at a time], the stores it rescales with their loops)."""
    roles = ("score", "new_max", "exp_gap", "rescale", "p")
    fresh = _fresh(names, roles)
    score, new_max, gap, rescale, p = (S.Local(fresh[r]) for r in roles)
    body = probability_is(p)
    stores = _accumulating_stores(transform, body, ())
    body = [_rescaled(s, rescale) for s in body]
    head = [Let(fresh["score"], f),
            Let(fresh["new_max"], S.Bin("max", S.Local(m), score)),
            Let(fresh["exp_gap"], S.Un("exp", S.Bin("-", S.Bin("min", S.Local(m), score), new_max))),
            Let(fresh["rescale"], S.IfGreater(score, S.Local(m), gap, S.Num(1.0))),
            Let(fresh["p"], S.IfGreater(score, S.Local(m), S.Num(1.0), gap)),
            Update(l, "=", S.Bin("+", S.Bin("*", S.Local(l), rescale), p))]
    return [replace(loop, body=tuple(head + body + [Update(m, "=", new_max)]))], stores


def _per_block(transform, loop, f, m, l, probability_is, names, loops, temps, offsets):
    """([the loop over blocks of keys], the stores it rescales with their loops)."""
    size, j = transform.block, loop.var
    probs, row = scratch_row(transform, "probs", loops, loop, size, names, temps, offsets)
    scope = {lp.var.name for lp in loops} | loop_vars((loop,))
    block = claim_loop(names, loop_role(j.name, "blk"), scope, transform)
    first = size * block
    fresh = _fresh(names, ("block_max", "new_max", "rescale", "block_sum")
                   + (("shift",) if transform.unseen else ()))
    block_max, new_max = S.Local(fresh["block_max"]), S.Local(fresh["new_max"])
    rescale, block_sum = S.Local(fresh["rescale"]), S.Local(fresh["block_sum"])
    # what the block's scores are taken from: the new max, or 0 while it is -inf
    shift = S.Local(fresh["shift"]) if transform.unseen else new_max
    unseen = (Let(shift.name, S.IfGreater(new_max, S.Num(float("-inf")), new_max,
                                          S.Num(0.0))),) if transform.unseen else ()
    prob = S.Access(probs, row + (j - first,))
    # every step a loop over the block's keys, as Split cuts a loop (the cost view counts it)
    each_key = lambda *stmts: Loop(j, first, sympy.Min(loop.stop, first + size), stmts)

    body, factor = _key_factor(probability_is(prob), prob)
    stores = _accumulating_stores(transform, body, ())
    for store, lps in stores:
        if j in set().union(*(sympy.sympify(i).free_symbols for i in store.index)) or \
                any(j in lp.start.free_symbols | lp.stop.free_symbols for lp in lps):
            raise ScheduleError(f"{transform}: {store.array} is accumulated at other elements "
                                f"per key: it cannot be rescaled once per block")
    rescale_rows = [enclose(lps, (replace(store, value=S.Bin(
        "*", S.Access(store.array, store.index), rescale), accumulate=None),))[0]
        for store, lps in stores]
    steps = [each_key(Store(probs, row + (j - first,), f)),
             Let(block_max.name, S.Num(float("-inf"))),
             each_key(Update(block_max.name, "max", prob)),
             Let(new_max.name, S.Bin("max", S.Local(m), block_max)),
             *unseen,
             Let(rescale.name, S.Un("exp", S.Bin("-", S.Local(m), shift))),
             each_key(Store(probs, row + (j - first,), S.Un("exp", S.Bin("-", prob, shift)))),
             Let(block_sum.name, S.Num(0.0)),
             each_key(Update(block_sum.name, "+", prob)),
             Update(l, "=", S.Bin("+", S.Bin("*", S.Local(l), rescale), block_sum)),
             # the factors before the rescale, which ColumnTiles folds into the next loop
             *([each_key(Store(probs, row + (j - first,), S.Bin("*", prob, factor)))]
               if factor else []),
             *rescale_rows,
             each_key(*body),
             Update(m, "=", new_max)]
    blocks = idiv(loop.stop + size - 1, size)
    return [Loop(block, sympy.Integer(0), blocks, tuple(steps))], stores


def _key_factor(body, prob):
    """(body with each prob * D read as prob, D) where the body weighs by D too, dropout's
    factor at (row, key) (it depends on no other index), else (body, None): the block's row
    of probabilities then takes D once per key, where the products would draw it again for
    every output column (or tile of them)."""
    found, inner = set(), loop_vars(body)

    def unfactor(e):
        if isinstance(e, S.Bin) and e.op == "*" and e.left == prob and \
                isinstance(e.right, S.Dropout) and not S.free_names(e.right) & inner:
            found.add(e.right)
            return prob
        return S.map_children(e, unfactor)
    unfactored = [map_stmt_exprs(s, unfactor) for s in body]
    if len(found) != 1:  # none, or factors that differ: the products keep theirs
        return body, None
    return unfactored, found.pop()


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


def _accumulating_stores(transform, stmts, loops):
    """Every store in stmts with the loops around it; each must accumulate a sum."""
    found = []
    for s in stmts:
        if isinstance(s, Loop):
            found += _accumulating_stores(transform, s.body, loops + (s,))
        elif isinstance(s, Store):
            if s.accumulate != "+" or s.atomic:
                raise ScheduleError(f"{transform}: a store in the fused loop does not accumulate "
                                    "a sum")
            found.append((s, loops))
    return found


def _rescaled(s, rescale):
    """X += v becomes X = X * rescale + v."""
    if isinstance(s, Loop):
        return replace(s, body=tuple(_rescaled(b, rescale) for b in s.body))
    if isinstance(s, Store):
        old = S.Bin("*", S.Access(s.array, s.index), rescale)
        return replace(s, value=S.Bin("+", old, s.value), accumulate=None)
    return s
