"""Packed variable-length sequences, in FlashAttention's varlen conventions: the batch's
sequences laid end to end, q of shape (total_q, heads, d), k and v of (total_k, kv_heads, d),
sequence s's queries the rows cu_seqlens_q[s] to cu_seqlens_q[s + 1] and its keys
cu_seqlens_k[s] to cu_seqlens_k[s + 1]; no query sees another sequence's keys.

Each sequence is moagen.torch.attention on its own rows (attention_gqa's flash kernels where
its queries and keys are as many, attention_cross's where not, forward and backward), so the
blocks of other sequences' keys, which a packed batch's block-diagonal attn_mask would hide,
are never visited. Causal is bottom-right within each sequence, as FlashAttention's: query i
of a sequence of n_q queries and n keys sees keys j <= i + n - n_q; a query that sees no key
(a sequence with more queries than keys, or with no key) gets zeros and no gradient.

Not one kernel launch for the batch: the kernels take sizes, not integer arrays, so the
offsets cannot reach them; each sequence is a call of its own, its rows copied to the
kernels' (1, heads, n, d) layout and its output copied back."""
import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from moagen.torch_ops.attention import attention
from moagen.torch_ops.native import (check_dims, check_lang, check_size, check_tensors,
                                     int_list)

SHAPE = "(total, heads, d)"


def sequence_bounds(op: str, name: str, cu_seqlens: Union[Tensor, Sequence[int]],
                    total: int) -> list:
    """The cumulative offsets as ints; ValueError unless they start at 0, never decrease and
    end at the packed tensor's row count `total`."""
    bounds = int_list(op, name, cu_seqlens)
    if not bounds or bounds[0] != 0 or bounds[-1] != total or \
            any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{op}: {name} must start at 0, never decrease and end at the packed "
                         f"row count {total}, got {bounds}")
    return bounds


def _check(op, q, k, v, lang):
    check_lang(op, lang)
    check_tensors(op, q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dims(op, name, t, 3, SHAPE)
    check_size(op, "k's shape", tuple(k.shape), tuple(v.shape))
    check_size(op, "k's head size", k.shape[2], q.shape[2])


def _one_sequence(t: Tensor) -> Tensor:
    """A sequence's rows (n, heads, d) as attention's (1, heads, n, d)."""
    return t.transpose(0, 1).unsqueeze(0)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor,
                     cu_seqlens_q: Union[Tensor, Sequence[int]],
                     cu_seqlens_k: Union[Tensor, Sequence[int]], *,
                     causal: bool = False, scale: Optional[float] = None,
                     lang: str = "c") -> Tensor:
    """softmax(scale q k^T) v within each packed sequence, as FlashAttention's
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ..., causal=causal) computes
    it (its max_seqlen arguments are not needed here): q (total_q, heads, d), k and v
    (total_k, kv_heads, d), kv_heads dividing heads (grouped-query attention); cu_seqlens_q
    and cu_seqlens_k the batch's cumulative offsets, as many of each (batch + 1), from 0 to
    total_q and total_k. causal: bottom-right within each sequence. Returns (total_q, heads,
    d), differentiable in q, k and v. scale 1/sqrt(d) unless given; lang as attention's."""
    op = "moagen.torch.attention_varlen"
    if not isinstance(causal, bool):
        raise ValueError(f"{op}: causal must be True (bottom-right within each sequence, as "
                         f"FlashAttention's) or False, got {causal!r}")
    _check(op, q, k, v, lang)
    queries = sequence_bounds(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    keys = sequence_bounds(op, "cu_seqlens_k", cu_seqlens_k, k.shape[0])
    check_size(op, "the number of cu_seqlens_k's offsets", len(keys), len(queries))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    outs = []
    for (q0, q1), (k0, k1) in zip(zip(queries, queries[1:]), zip(keys, keys[1:])):
        out = attention(*(_one_sequence(t[start:stop]) for t, start, stop in
                          ((q, q0, q1), (k, k0, k1), (v, k0, k1))),
                        causal="lower_right" if causal else False, scale=scale, lang=lang)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(q.shape)
