"""Hoist: loop-invariant code motion, reductions included, with common subexpressions
computed once."""
from dataclasses import dataclass, replace
from typing import Optional

from moagen.moa import scalar as S
from moagen.onf.loops import (Let, Loop, Store, Update, defined_names, map_stmt_exprs, stmt_exprs,
                              walk)
from moagen.steps.step import Step


@dataclass(frozen=True)
class Hoist(Step):
    """Compute every loop-invariant value once, just before the loop it does not depend on:
    a row's max and sum leave the loops over columns and keys, and values that appear twice
    (the row max inside the row sum and inside each probability) are computed once."""
    nest: Optional[str] = None

    def rewrite_nest(self, nest, names):
        return _hoist_block(nest.body, names)


def _hoist_block(stmts, names):
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            pre, body = _hoist_out_of_loop(_hoist_block(s.body, names), s.var.name, names)
            out += pre
            out.append(replace(s, body=body))
        else:
            pre = []
            stmt = map_stmt_exprs(s, lambda e: _extract(e, frozenset(), False, pre, names))
            out += pre + [stmt]
    return _share_subexpressions(_cse(out), names)


def _hoist_out_of_loop(body, var, names):
    updated = {s.name for s in walk(body) if isinstance(s, Update)}
    variant = {var} | updated | {"@" + s.array for s in walk(body) if isinstance(s, Store)}
    pre, kept = [], []
    for s in body:
        if (isinstance(s, Let) and s.name not in updated
                and not S.free_names(s.value) & variant):
            pre.append(s)
            continue
        inner = frozenset(variant | defined_names([s]))
        kept.append(map_stmt_exprs(s, lambda e: _extract(e, inner, True, pre, names)))
        if isinstance(s, Let):
            variant.add(s.name)
    return pre, tuple(kept)


def _extract(e, variant, may_extract, pre, names):
    """Replace each maximal subexpression of e that depends on nothing in `variant` by a new
    local, defined in `pre`. At statement level (may_extract False) only subexpressions
    inside a reduction qualify: the statement itself stays where it is."""
    if may_extract and not isinstance(e, S.LEAVES) and not S.free_names(e) & variant:
        value = _extract(e, frozenset(), False, pre, names)
        name = names.claim(names.new(e.name if isinstance(e, S.Reduction) else "t"))
        names.locals.add(name)
        pre.append(Let(name, value))
        return S.Local(name)
    if isinstance(e, S.Reduction):
        body = _extract(e.body, variant | {e.var.name}, True, pre, names)
        return replace(e, body=body)
    return S.map_children(e, lambda c: _extract(c, variant, may_extract, pre, names))


def _cse(block):
    """Drop a Let whose value equals an earlier Let's in the same block; use the first."""
    updated = {s.name for s in walk(block) if isinstance(s, Update)}
    seen, rename, out = {}, {}, []
    for s in block:
        if rename:
            s = map_stmt_exprs(s, lambda e: S.rename_locals(e, rename))
        if isinstance(s, Let) and s.name not in updated:
            key = S.alpha_key(s.value)
            if key in seen:
                rename[s.name] = seen[key]
                continue
            seen[key] = s.name
        out.append(s)
    return tuple(out)


def _share_subexpressions(block, names):
    """Compute a value that two statements of a block share (the probability inside both
    dS and the dV update) once, in a local before the first of them. Reduction bodies are
    not searched: their values depend on the bound variable."""
    block = list(block)
    changing = {s.name for s in walk(block) if isinstance(s, Update)}
    changing |= {"@" + s.array for s in walk(block) if isinstance(s, Store)}
    while True:
        seen = {}  # alpha key -> [occurrences, first statement, size, expression]
        for pos, s in enumerate(block):
            for e in stmt_exprs(s):
                for sub in _shareable(e):
                    if not S.free_names(sub) & changing:
                        seen.setdefault(S.alpha_key(sub), [0, pos, _size(sub), sub])[0] += 1
        repeated = [v for v in seen.values() if v[0] > 1]
        if not repeated:
            return tuple(block)
        _, pos, _, expr = max(repeated, key=lambda v: v[2])
        key = S.alpha_key(expr)
        first = block[pos]
        if isinstance(first, Let) and S.alpha_key(first.value) == key:
            name, start = first.name, pos + 1  # the first use already names the value
        else:
            name = names.claim(names.new(expr.name if isinstance(expr, S.Reduction) else "t"))
            names.locals.add(name)
            block.insert(pos, Let(name, expr))
            start = pos + 1
        block[start:] = [map_stmt_exprs(s, lambda e: _replace(e, key, S.Local(name)))
                         if not isinstance(s, Loop) else s for s in block[start:]]


def _shareable(e):
    """The non-leaf subexpressions of e, outside reduction bodies."""
    if isinstance(e, S.LEAVES):
        return
    yield e
    if not isinstance(e, S.Reduction):
        for c in S.children(e):
            yield from _shareable(c)


def _replace(e, key, local):
    if not isinstance(e, S.LEAVES) and S.alpha_key(e) == key:
        return local
    if isinstance(e, S.Reduction):
        return e
    return S.map_children(e, lambda c: _replace(c, key, local))


def _size(e):
    return 1 + sum(_size(c) for c in S.children(e))
