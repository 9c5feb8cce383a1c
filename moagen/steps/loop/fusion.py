"""Fusion: nests that share their outer loops run as one, and sibling loops inside them as
one where they are independent."""
from dataclasses import dataclass, replace
from typing import Tuple

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import (Let, Loop, Nest, ONF, Store, Update, enclose,
                              perfect_chain, stmt_exprs, walk)
from moagen.steps.step import Step, hidden, shown


@dataclass(frozen=True)
class FuseNests(Step):
    """Run several nests as one: they must start with the same loops `over`, and a later
    nest may read what an earlier one wrote only at the same iteration of those loops
    (the backward reading the forward's O and lse of the same row). Inside, sibling loops
    over the same range are fused wherever they are independent."""
    nests: Tuple[str, ...]
    over: Tuple[str, ...] = shown("over=({over})")
    name: str = hidden()
    printed_name = "fuse"

    def __call__(self, onf: ONF) -> ONF:
        chosen = [self.nest_called(onf, label) for label in self.nests]
        chains = [perfect_chain(n.body, len(self.over)) for n in chosen]
        for n, chain in zip(chosen, chains):
            if chain is None or [lp.var.name for lp in chain] != list(self.over):
                raise ScheduleError(f"{self}: nest {n.label} does not start with the loops "
                                    f"{', '.join(self.over)}")
            if [(lp.start, lp.stop) for lp in chain] != [(lp.start, lp.stop) for lp in chains[0]]:
                raise ScheduleError(f"{self}: nest {n.label}'s loops have other bounds")
        self._check_same_iteration(chosen, chains[0])
        order = sorted(chosen, key=onf.nests.index)
        place = self._place(onf, order)
        body = fuse_siblings([s for n in order for s in perfect_chain(n.body, len(self.over))[-1].body])
        fused = Nest(order[0].target, enclose(chains[0], body),
                     "\n".join(n.origin for n in order), self.name)
        nests = [fused if n is place else n for n in onf.nests if n is place or n not in order]
        return onf.with_nests(nests, str(self))

    def _place(self, onf, order):
        """The member whose place the fused nest takes: the last, the others moving later,
        or else the first, the others moving earlier (a member that the nests between
        them do not touch can move past them)."""
        blocked = self._blocker(onf, order[:-1], order[-1])
        if blocked is None:
            return order[-1]
        if self._blocker(onf, order[1:], order[0]) is None:
            return order[0]
        member, other = blocked
        raise ScheduleError(f"{self}: nest {member.label} cannot move past nest {other.label}, "
                            "which shares data with it")

    def _blocker(self, onf, members, place):
        """(member, nest) where a member cannot move past a nest on its way to `place` (the
        nest touches what the member writes or writes what it reads); None when all can."""
        at = onf.nests.index(place)
        for member in members:
            i = onf.nests.index(member)
            for other in onf.nests[min(i, at) + 1:max(i, at)]:
                if other not in members and not independent(as_block(member), as_block(other)):
                    return member, other
        return None

    def _check_same_iteration(self, chosen, chain):
        written = set()
        own = {lp.var for lp in chain}
        for n in chosen:
            for s in walk(n.body):
                for e in stmt_exprs(s):
                    for access in (x for x in S.subexpressions(e) if isinstance(x, S.Access)):
                        if access.array in written and not own <= _index_symbols(access.index):
                            raise ScheduleError(
                                f"{self}: nest {n.label} reads {access.array} at another "
                                f"iteration of {', '.join(self.over)} than the one writing it")
            written |= {s.array for s in walk(n.body) if isinstance(s, Store)}


def as_block(nest):
    return Loop(sympy.Symbol("_nest"), sympy.Integer(0), sympy.Integer(1), nest.body)


def _index_symbols(index):
    return {i for i in index if isinstance(i, sympy.Symbol)}


def fuse_siblings(block):
    """Merge each loop with the nearest earlier sibling over the same range when neither
    depends on the other, and one of them can move to the other past the statements between
    them (it depends on none of them); then fuse inside the merged body."""
    out = []
    for s in block:
        target, moves_up = _fusion_partner(out, s) if isinstance(s, Loop) else (None, False)
        if target is None:
            out.append(s)
            continue
        merged = replace(out[target], body=fuse_siblings(out[target].body + s.body))
        if moves_up:
            out[target] = merged
        else:
            del out[target]  # the earlier loop moves down to s (dQ's past dK's zeroing)
            out.append(merged)
    return tuple(out)


def _fusion_partner(out, loop):
    """(the position of the loop's partner in out, whether the loop moves up to it rather
    than the partner down to the loop); (None, False) when it has none."""
    for pos in range(len(out) - 1, -1, -1):
        other = out[pos]
        if (isinstance(other, Loop) and other.var == loop.var and other.start == loop.start
                and other.stop == loop.stop and not other.parallel and not loop.parallel
                and independent(other, loop)):
            between = out[pos + 1:]
            if all(independent(loop, x) for x in between):
                return pos, True
            if all(independent(other, x) for x in between):
                return pos, False
    return None, False


def independent(a, b) -> bool:
    """No value flows between a and b and they write different things."""
    reads_a, writes_a = _effects(a)
    reads_b, writes_b = _effects(b)
    return not (writes_a & (reads_b | writes_b) or writes_b & reads_a)


def _effects(stmt):
    reads, writes = set(), set()
    for s in walk([stmt]):
        if isinstance(s, (Let, Update, Store)):
            reads |= S.free_names(s.value)
        if isinstance(s, (Let, Update)):
            writes.add(s.name)
        if isinstance(s, Store):
            writes.add("@" + s.array)
            if s.accumulate:
                reads.add("@" + s.array)
            reads |= {x.name for i in s.index for x in sympy.sympify(i).free_symbols}
    return reads, writes
