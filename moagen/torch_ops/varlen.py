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

One call (one_call True; None, the default, where no gradient is to be taken, on the CPU):
the batch is one call of attention_varlen_fwd (`_causal`;
moagen.kernels.attention_varlen), the offsets passed to it as int64 arrays, each sequence's
loops reading their bounds from them; its flash variant on the CPU (0.09-0.65x the
per-sequence calls' time at 8 x 16 to 1024 + 64 rows with two threads; with one, 0.23-0.31x
at 8 x 16, 1.0-1.56x at 1024 + 64: docs/journal/2026-12-08-varlen-flash.md), its dnf on a
GPU; its gradient one call of attention_varlen_bwd (`_causal`, dnf), which reads the saved O
and lse (dQ packed as q, dK and dV as k, summed over each KV head's query heads). By default
a gradient to take (the dnf backward against the per-sequence flash ones unmeasured) and
CUDA tensors (the one call there unmeasured) take the per-sequence path, as do tensors
PyTorch traces (torch.compile's fake tensors) and an empty batch: the batch's kernel is
called directly, not as an operator, and takes sizes of at least 1. one_call=False: always
per sequence."""
import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from moagen.torch_ops.attention import attention
from moagen.torch_ops.native import (call, causal_name, check_dims, check_lang, check_size,
                                     check_tensors, int_list)

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
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{op}: k's {k.shape[1]} heads must divide q's {q.shape[1]} "
                         "(grouped-query attention)")


def _one_call(q, k, v, one_call):
    """Whether the batch is one call of the varlen kernels: asked for (True), or by default
    (None) on the CPU with no gradient to take; plain tensors with rows to attend."""
    if one_call is None:
        gradient = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        one_call = not gradient and q.device.type == "cpu"
    plain = all(type(t) is Tensor for t in (q, k, v))
    return one_call and plain and q.shape[0] > 0 and k.shape[0] > 0


def _grouped(q, k):
    """The kernels' shape (total_q, kv_heads, group, d) of q's (total_q, heads, d)."""
    return q.shape[0], k.shape[1], q.shape[1] // k.shape[1], q.shape[2]


class _Packed(torch.autograd.Function):
    """O by one call of attention_varlen_fwd (`_causal`), the offsets int64 tensors on q's
    device; dQ, dK, dV by one call of attention_varlen_bwd (`_causal`) on the saved O and
    lse."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, lang):
        variant = "flash" if q.device.type == "cpu" else "dnf"  # flash: CPU only
        out, lse = call(causal_name("attention_varlen_fwd", causal), variant, lang,
                        (q, _grouped(q, k)), k, v, cu_q, cu_k, scale=scale,
                        out_shapes=(q.shape, None))
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
        ctx.settings = causal, scale, lang
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
        causal, scale, lang = ctx.settings
        grouped = _grouped(q, k)
        grads = call(causal_name("attention_varlen_bwd", causal), "dnf", lang, (q, grouped),
                     k, v, cu_q, cu_k, (out, grouped), (grad_out, grouped), lse, scale=scale,
                     out_shapes=(q.shape, None, None))
        return (*grads, None, None, None, None, None)


def _packed(q, k, v, queries, keys, causal, scale, lang):
    """The batch by _Packed, the offsets as int64 tensors on q's device."""
    offsets = [torch.tensor(b, dtype=torch.int64, device=q.device) for b in (queries, keys)]
    return _Packed.apply(q, k, v, *offsets, causal, scale, lang)


def _one_sequence(t: Tensor) -> Tensor:
    """A sequence's rows (n, heads, d) as attention's (1, heads, n, d)."""
    return t.transpose(0, 1).unsqueeze(0)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor,
                     cu_seqlens_q: Union[Tensor, Sequence[int]],
                     cu_seqlens_k: Union[Tensor, Sequence[int]], *,
                     causal: bool = False, scale: Optional[float] = None,
                     lang: str = "c", one_call: Optional[bool] = None) -> Tensor:
    """softmax(scale q k^T) v within each packed sequence, as FlashAttention's
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ..., causal=causal) computes
    it (its max_seqlen arguments are not needed here): q (total_q, heads, d), k and v
    (total_k, kv_heads, d), kv_heads dividing heads (grouped-query attention); cu_seqlens_q
    and cu_seqlens_k the batch's cumulative offsets, as many of each (batch + 1), from 0 to
    total_q and total_k. causal: bottom-right within each sequence. Returns (total_q, heads,
    d), differentiable in q, k and v. scale 1/sqrt(d) unless given; lang as attention's.
    one_call: the batch by one kernel call and its gradient by another (True), per sequence
    (False), or the first where no gradient is to be taken on the CPU (None; see the
    module's docstring)."""
    op = "moagen.torch.attention_varlen"
    if not isinstance(causal, bool):
        raise ValueError(f"{op}: causal must be True (bottom-right within each sequence, as "
                         f"FlashAttention's) or False, got {causal!r}")
    _check(op, q, k, v, lang)
    queries = sequence_bounds(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    keys = sequence_bounds(op, "cu_seqlens_k", cu_seqlens_k, k.shape[0])
    check_size(op, "the number of cu_seqlens_k's offsets", len(keys), len(queries))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if _one_call(q, k, v, one_call):
        return _packed(q, k, v, queries, keys, causal, scale, lang)
    outs = []
    for (q0, q1), (k0, k1) in zip(zip(queries, queries[1:]), zip(keys, keys[1:])):
        out = attention(*(_one_sequence(t[start:stop]) for t, start, stop in
                          ((q, q0, q1), (k, k0, k1), (v, k0, k1))),
                        causal="lower_right" if causal else False, scale=scale, lang=lang)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(q.shape)
