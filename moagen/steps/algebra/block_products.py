"""BlockProducts: a key block's products into the output summed apart, then added once.

OnlineSoftmax's block form (moagen.steps.algebra.online) leaves, in each block of keys,

    for c: X[r, c] = X[r, c] * a                      (the rescale)
    for j in the block: t = P[r, j]; for c: X[r, c] += t * g(j, c)

and this step writes it as

    for c: let x = 0; for j in the block: x += P[r, j] * g(j, c); B[r, c] = x
    for c: X[r, c] = X[r, c] * a + B[r, c]

the same sum in another order (the block's terms summed first, then added to the rescaled
row: equal in exact arithmetic; in floating point the block's sum rounds apart). B, a
scratch array of X's shape, holds a block's products: the first loop is then a product of
the block's probabilities and values with its own accumulator, what a tensor-core step
takes (WarpMma), while X's rescale and addition stay per row (WMMA's accumulators cannot be
rescaled by rows). Refused (ScheduleError): no loop over `blocks` holding that rescale and
those products of one array X, over one column loop."""
from dataclasses import dataclass, replace
from typing import Optional

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Buffer, Let, Loop, Store, Update, rewrite_loops
from moagen.onf.names import kernel_names
from moagen.steps.step import Step, shown


@dataclass(frozen=True)
class BlockProducts(Step):
    """In each loop over `blocks` (the key blocks), X's rescale and the block's products
    into X as a sum of the block's own, stored to a new scratch array `name` (X's shape),
    added to the rescaled X once (the module's docstring)."""
    blocks: str
    name: str = shown("into {name}", "block_out")
    nest: Optional[str] = None
    # a rewrite the tensor-core mapping asks for, after the threads are given their loops
    # (its column loops keep their mapping)
    layer = "mapping"

    def __call__(self, onf):
        nest = self.nest_called(onf)
        names = kernel_names(onf)
        shapes = {b.name: b.shape for b in onf.inputs + onf.outputs + onf.temps}
        targets = set()
        if self.name in names.reserved:
            raise ScheduleError(f"{self}: the name {self.name} is taken")
        names.claim(self.name)
        body, found = rewrite_loops(
            nest.body, lambda lp: lp.var.name == self.blocks,
            lambda lp, _: (replace(lp, body=self._block(lp.body, names, targets)),))
        if not found:
            raise ScheduleError(f"{self}: nest {nest.label} has no loop over {self.blocks}")
        nests = [replace(n, body=body) if n is nest else n for n in onf.nests]
        if len(targets) != 1:
            raise ScheduleError(f"{self}: the blocks' products go to {len(targets)} arrays")
        target, = targets
        return replace(onf.with_nests(nests, str(self)),
                       temps=onf.temps + (Buffer(self.name, shapes[target]),))

    def _block(self, body, names, targets):
        rescale = next((k for k, s in enumerate(body) if _rescale(s)), None)
        product = next((k for k, s in enumerate(body) if rescale is not None and k > rescale
                        and _products(s, body[rescale])), None)
        if rescale is None or product is None:
            raise ScheduleError(f"{self}: the loop over {self.blocks} holds no rescale "
                                "X = X * a over a column loop followed by the block's "
                                "products X += p * g")
        cols = body[rescale]
        scaled = cols.body[0]
        keys = body[product]
        t, inner = _products(keys, cols)
        update = inner.body[0]
        value = update.value if t is None else S.subs_locals(update.value, {t.name: t.value})
        targets.add(scaled.array)
        acc = names.claim(names.new("block_acc"))
        # the column loops keep the rescale's mapping (its threads, where it has one)
        summed = replace(cols, body=(
            Let(acc, S.Num(0.0)),
            Loop(keys.var, keys.start, keys.stop, (Update(acc, "+", value),)),
            Store(self.name, scaled.index, S.Local(acc))))
        added = replace(cols, body=(
            Store(scaled.array, scaled.index,
                  S.Bin("+", scaled.value, S.Access(self.name, scaled.index))),))
        return body[:rescale] + body[rescale + 1:product] + (summed, added) + body[product + 1:]


def _rescale(s):
    """Whether s is `for c: X[idx] = X[idx] * a`."""
    if not (isinstance(s, Loop) and len(s.body) == 1 and isinstance(s.body[0], Store)):
        return False
    st = s.body[0]
    return st.accumulate is None and isinstance(st.value, S.Bin) and st.value.op == "*" and \
        st.value.left == S.Access(st.array, st.index) and isinstance(st.value.right, S.Local)


def _products(s, cols):
    """(the `let t = ...` before the inner loop or None, the inner loop) where s is `for j:
    [let t = p;] for c: X[idx] += v` over cols' range and X's element of cols' rescale."""
    if not isinstance(s, Loop) or not s.body:
        return None
    t = s.body[0] if len(s.body) == 2 and isinstance(s.body[0], Let) else None
    inner = s.body[-1]
    if len(s.body) != (2 if t else 1) or not isinstance(inner, Loop) or \
            (inner.var, inner.start, inner.stop) != (cols.var, cols.start, cols.stop) or \
            len(inner.body) != 1:
        return None
    st, scaled = inner.body[0], cols.body[0]
    if not (isinstance(st, Store) and st.accumulate == "+" and st.array == scaled.array
            and st.index == scaled.index):
        return None
    return t, inner

