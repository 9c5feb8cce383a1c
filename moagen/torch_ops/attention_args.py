"""What moagen.torch's attention operators share (moagen.torch_ops.attention, and .dropout,
which the public function calls): the argument checks, the flash kernels' schedule fitted
to the sizes, and the grouped view of the queries."""
from functools import lru_cache

import torch
from torch import Tensor

from moagen.kernels.attention import flash_params
from moagen.request import resolve
from moagen.torch_ops.native import DTYPES, check_dims, check_lang, check_size, check_tensors

SHAPE = "(batch, heads, n, d)"


@lru_cache(maxsize=None)
def fitted(name: str, lang: str, dtype: str, n: int, d: int, causal: bool) -> tuple:
    """The schedule parameters of a flash kernel fitted to the sequence length and head size,
    as pairs: every parameter where flash_params changes one of this machine's defaults
    (a backward has no key blocks of its own), () where they stand."""
    here = dict(resolve(name, "flash", lang, dtype).params)
    changed = {key: value for key, value in flash_params(n, d, causal, here["lanes"]).items()
               if key in here and here[key] != value}
    return tuple(sorted({**here, **changed}.items())) if changed else ()


def fitted_params(name: str, q: Tensor, k: Tensor, causal: bool, lang: str) -> tuple:
    if not q.is_cpu:  # fitted to a CPU's registers and caches; a GPU's stand
        return ()
    return fitted(name, lang, DTYPES[q.dtype], k.shape[2], q.shape[3], causal)


def check_attention(op, q, k, v, lang, mask=None):
    """mask: None, one of q's dtype, or a boolean one (n_q, n) (the `_bool2d` kernels')."""
    check_lang(op, lang)
    flags = mask is not None and mask.dtype == torch.bool
    check_tensors(op, q=q, k=k, v=v, **({} if mask is None or flags else {"mask": mask}))
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dims(op, name, t, 4, SHAPE)
    if flags:
        check_dims(op, "a boolean mask", mask, 2, "(n_q, n), shared by every batch and head")
        if mask.device != q.device:
            raise ValueError(f"{op}: the mask is on {mask.device}, q on {q.device}; they must "
                             "be on one device")
    if mask is not None:  # one for every batch and head, or each its own
        scores = (*q.shape[:3], k.shape[2])
        check_size(op, "the mask's shape", tuple(mask.shape),
                   scores[2:] if mask.dim() == 2 else scores)
    check_size(op, "k's shape", tuple(k.shape), tuple(v.shape))
    check_size(op, "k's batch", k.shape[0], q.shape[0])
    check_size(op, "k's head size", k.shape[3], q.shape[3])
    kv_heads, heads = k.shape[1], q.shape[1]
    whole_groups = heads % kv_heads == 0 if kv_heads else heads == 0  # 0 of 0: an empty call
    if not whole_groups:
        raise ValueError(f"{op}: k and v have {kv_heads} heads, which does not divide q's "
                         f"{heads} heads (grouped-query attention needs whole groups)")
    # an empty batch, heads or length gives an empty output (moagen.torch_ops.operator)
    if q.shape[3] == 0:
        raise ValueError(f"{op}: the head size d must be at least 1, got q of shape "
                         f"{tuple(q.shape)}")


def grouped(t: Tensor, kv_heads: int):
    """(batch, heads, ...) seen as the grouped kernels' (batch, kv_heads, group, ...): query
    head g * group + r as (g, r)."""
    return t, (t.shape[0], kv_heads, t.shape[1] // kv_heads, *t.shape[2:])
