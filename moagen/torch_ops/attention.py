"""Attention as a PyTorch operator, in scaled_dot_product_attention's conventions: q of shape
(batch, heads, n_q, d), k and v of (batch, kv_heads, n, d) with kv_heads dividing heads
(grouped-query attention as SDPA's enable_gqa: query head h reads KV head h // group; MHA
when kv_heads = heads), scale 1/sqrt(d) unless given, optionally causal: True is SDPA's
is_causal (top-left: query i sees keys j <= i), "lower_right" a cache's (PyTorch's
causal_lower_right: j <= i + n - n_q).

    forward   O and the row logsumexp by attention_gqa_fwd's `flash` kernel (one pass over
              key blocks with both products register tiles, O(n d) memory)
    backward  dQ, dK, dV by attention_gqa_bwd's `flash` kernel (FlashAttention-2's backward:
              it reads the saved O and logsumexp; key rows own their dK and dV rows, summed
              over their group's query heads, so there are no atomics and the gradients are
              the same bits on any thread count).

Queries and keys of different lengths (or the bottom-right mask) take attention_cross's
`flash` kernels, forward and backward, the mask's offset given at call time; with more
queries than keys, bottom-right, the first n_q - n rows see no key, and get SDPA's zeros
(no gradient), the others being top-left attention over n rows. One query against several
keys where no gradient is taken, not causal or bottom-right, is decoding: the
attention_decode kernel (`split`; `grouped` on a GPU) over all the keys.

An attn_mask (SDPA's: boolean, True where a key is seen, or float, added to the scores;
broadcastable to (batch, heads, n_q, n)) takes attention_cross's masked `flash` kernels,
forward and backward. Where it is shared by every batch and head (SDPA's common (n_q, n) or
(1, 1, n_q, n) masks: one (n_q, n) array, never copied per head) or by each batch's heads
((batch, 1, n_q, n): a call a batch, each with its own), a boolean one takes `_bool2d`,
which reads its bytes (no float mask made), a float one `_masked2d`; otherwise `_masked`,
the mask made a float one of q's dtype (0 or -inf for a boolean one) of the full shape.
The kernels add the mask's tile to the score tile, or keep the scores where it is true,
every key block visited (a mask is not known to hide whole blocks). A row the mask hides
wholly gets SDPA's zeros and no gradient, as the bottom-right rows that see no key do:
from `_bool2d` itself (its softmax floored), else shown every key and zeroed after (a float
mask's hidden keys may be finite, where SDPA averages the row).

Padded keys (key_lengths, or a boolean attn_mask of shape (batch, 1, 1, n) that is True up
to each batch's length, moagen.torch_ops.padding) take attention_cross's `_padded` flash
kernels, a call a batch, each given its last valid key: the forward's loops stop at that
key's block. A batch with no valid key gets SDPA's zeros and no gradient.

The grouped kernels (moagen.kernels.attention_gqa) read each KV head for its whole group:
k and v are never repeated per query head, nor their gradients summed back in PyTorch. They
take q as (batch, kv_heads, group, n, d): the contiguous q's values under that shape. Both
kernels' schedules are fitted to the sequence length and head size
(moagen.kernels.attention.flash_params).

The backward alone rather than a fused forward + backward (attention_fwdbwd): the forward
has already computed O and the logsumexp, which the fused owner would compute again in a
pass of its own (docs/PERFORMANCE.md, "The owner and the flash backward")."""
import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from moagen.kernels import get_kernel
from moagen.targets import get_target
from moagen.torch_ops.attention_args import check_attention, fitted_params, grouped
from moagen.torch_ops.decode import attention_decode_op
from moagen.torch_ops.dropout import attention_with_dropout
from moagen.torch_ops.native import DTYPES, call, causal_name
from moagen.torch_ops.operator import Operator
from moagen.torch_ops.padding import key_lengths_of, padding_of

def _kernel(kind: str, q: Tensor, k: Tensor, mask: Optional[Tensor], causal: bool,
            offset: int, last_key: int, lang: str):
    """(kernel, variant, its schedule parameters, its given sizes) for the forward (kind
    "fwd") or the backward ("bwd"): the flash kernels, attention_gqa's where queries and keys
    are as many and the mask top-left, attention_cross's otherwise (offset: causal's, query
    i sees keys j <= i + offset); under a mask, attention_cross's `_bool2d` (a boolean one
    (n_q, n) shared by every batch and head), `_masked2d` (a float one so) or `_masked`
    (the full shape); last_key >= 0:
    keys past it padded out, attention_cross's `_padded` (-1: none). The variant: the
    kernel's default where it runs, if its module names one (CUDA's forwards on tensor
    cores), else flash."""
    if mask is not None:
        shared = "bool2d" if mask.dtype == torch.bool else "masked2d"
        name = f"attention_cross_{kind}_{shared if mask.dim() == 2 else 'masked'}"
        causal, given = False, {}
    elif last_key >= 0:
        name = f"attention_cross_{kind}_padded"
        causal, given = False, {"last": last_key}
    else:
        square = q.shape[2] == k.shape[2] and not offset
        name = causal_name(f"attention_{'gqa' if square else 'cross'}_{kind}", causal)
        given = {"offset": offset} if causal and not square else {}
    runs_on = "cuda" if q.is_cuda else get_target(lang).kind  # CUDA tensors: CUDA kernels
    variant = get_kernel(name).default_variant(runs_on, DTYPES[q.dtype], "flash")
    return name, variant, fitted_params(name, q, k, causal, lang), given


def _masks(mask: Optional[Tensor], kv_heads: int) -> tuple:
    """The kernel's mask argument where there is one: a full one grouped as q, a shared one
    (n_q, n) as it is."""
    if mask is None:
        return ()
    return (mask if mask.dim() == 2 else grouped(mask, kv_heads),)


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool,
               offset: int, last_key: int, scale: float,
               lang: str) -> tuple[Tensor, Tensor]:
    """O and the row logsumexp (kept for the backward); mask: a float mask of q's dtype of
    shape (batch, heads, n_q, n), a float or boolean one (n_q, n) (shared by every batch and
    head), or None;
    last_key: the last key seen (-1: every key)."""
    name, variant, params, given = _kernel("fwd", q, k, mask, causal, offset, last_key, lang)
    return call(name, variant, lang, grouped(q, k.shape[1]), k, v, *_masks(mask, k.shape[1]),
                scale=scale, params=params, out_shapes=(q.shape, q.shape[:-1]), **given)


def _attention_fake(q, k, v, mask, causal, offset, last_key, scale, lang):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1])


def _attention_backward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Tensor,
                        lse: Tensor, grad_out: Tensor, causal: bool, offset: int, last_key: int,
                        scale: float, lang: str) -> tuple[Tensor, Tensor, Tensor]:
    kv_heads = k.shape[1]
    name, variant, params, given = _kernel("bwd", q, k, mask, causal, offset, last_key, lang)
    return call(name, variant, lang, grouped(q, kv_heads), k, v, *_masks(mask, kv_heads),
                *(grouped(t, kv_heads) for t in (out, grad_out, lse)), scale=scale,
                params=params, out_shapes=(q.shape,), **given)


def _attention_backward_fake(q, k, v, mask, out, lse, grad_out, causal, offset, last_key,
                             scale, lang):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


attention_backward_op = Operator(
    "moagen::attention_backward", _attention_backward, _attention_backward_fake,
    check=lambda q, k, v, mask, out, lse, grad_out, causal, offset, last_key, scale, lang:
    check_attention("moagen::attention_backward", q, k, v, lang, mask))


def _setup(ctx, inputs, output):
    q, k, v, mask, ctx.causal, ctx.offset, ctx.last_key, ctx.scale, ctx.lang = inputs
    ctx.save_for_backward(q, k, v, mask, *output)
    ctx.mark_non_differentiable(output[1])
    # a gradient not given stays None (the logsumexp's: never read), not zeros
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, _grad_lse):
    if grad_out is None:
        return (None,) * 9
    dq, dk, dv = attention_backward_op(*ctx.saved_tensors, grad_out, ctx.causal, ctx.offset,
                                       ctx.last_key, ctx.scale, ctx.lang)
    # the mask takes no gradient (the public function refuses one that requires it)
    return dq, dk, dv, None, None, None, None, None, None


attention_op = Operator("moagen::attention", _attention, _attention_fake,
                        check=lambda q, k, v, mask, causal, offset, last_key, scale, lang:
                        check_attention("moagen::attention", q, k, v, lang, mask),
                        backward=_backward, setup_context=_setup,
                        instead="F.scaled_dot_product_attention")


def _kernel_mask(op: str, attn_mask: Tensor, q: Tensor,
                 k: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """SDPA's attn_mask as the masked kernels take it, contiguous: of shape (n_q, n) where it
    is shared by every batch and head (its axes before the last two all 1), (batch, n_q, n)
    where each batch's is shared by its heads (batch, 1, n_q, n), boolean where it is (the
    `_bool2d` kernels read its bytes) or else added to the scores, of q's dtype; else of the
    full shape (batch, heads, n_q, n), added to the scores, of q's dtype. And whether each
    row sees a key (False at those rows), broadcastable to (batch, heads, n_q, 1), where the
    kernel leaves such rows to the caller (their keys then all shown: its softmax would give
    0 / 0); None where it gives them zeros itself (a boolean mask's `_bool2d`)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{op}: attn_mask must be a torch.Tensor, got "
                        f"{type(attn_mask).__name__}")
    if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise ValueError(f"{op}: attn_mask must be boolean (True: the key is seen) or float "
                         f"(added to the scores), as SDPA's, got dtype {attn_mask.dtype}")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: attn_mask requires grad; the masked kernels give no gradient "
                         "for the mask (detach it, or use F.scaled_dot_product_attention)")
    full = (*q.shape[:3], k.shape[2])
    try:
        broadcast = torch.broadcast_shapes(attn_mask.shape, full)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(full):
        raise ValueError(f"{op}: attn_mask of shape {tuple(attn_mask.shape)} does not "
                         f"broadcast to (batch, heads, n_q, n) = {full}")
    if all(size == 1 for size in attn_mask.shape[:-2]):
        full = full[2:]
        attn_mask = attn_mask.reshape(attn_mask.shape[-2:])
    elif attn_mask.dim() == 4 and attn_mask.shape[1] == 1:
        full = (full[0], *full[2:])
        attn_mask = attn_mask[:, 0]
    by_batch = len(full) == 3
    if attn_mask.dtype == torch.bool and len(full) < 4:
        # the `_bool2d` kernels read its bytes, a row hidden wholly theirs (floored)
        return attn_mask.expand(full).contiguous(), None
    # no branch on whether every row sees a key, which torch.compile could not trace
    if attn_mask.dtype == torch.bool:
        seen = attn_mask.any(-1, keepdim=True)
        # made a float one in one pass: it is as large as the scores (float32, n 4096, 8
        # heads, 1 thread: 157 -> 92 ms of a 721 ms masked call)
        zero, hidden = (torch.tensor(x, dtype=q.dtype, device=attn_mask.device)
                        for x in (0.0, float("-inf")))
        mask = torch.where(attn_mask | ~seen, zero, hidden)
    else:
        mask = attn_mask.to(q.dtype)
        seen = (mask > float("-inf")).any(-1, keepdim=True)
        mask = mask.masked_fill(~seen, 0)
    return mask.expand(full).contiguous(), seen.unsqueeze(1) if by_batch else seen


def _padded(q: Tensor, k: Tensor, v: Tensor, lengths: list, scale: float,
            lang: str) -> Tensor:
    """Attention over each batch's first lengths[b] keys: the `_padded` kernels, a call a
    batch (each its own last key); a batch with every key padded out gets SDPA's zeros and
    zero gradients, a batch with none padded the unpadded kernels."""
    n = k.shape[2]
    outs = []
    for b, length in enumerate(lengths):
        one = tuple(t[b:b + 1].contiguous() for t in (q, k, v))
        # no key: the attention over key 0 alone (one block) times 0, SDPA's zeros, in the
        # graph as SDPA's are (zero gradients, even where every batch has no key)
        last = length - 1 if 0 < length < n else 0 if length == 0 else -1
        out = attention_op(*one, None, False, 0, last, scale, lang)[0]
        outs.append(out * 0 if length == 0 else out)
    return torch.cat(outs)


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, *,
              causal: Union[bool, str] = False, scale: Optional[float] = None,
              dropout_p: float = 0.0, key_lengths: Union[Tensor, Sequence[int], None] = None,
              lang: str = "c") -> Tensor:
    """softmax(scale q k^T + mask) v per (batch, head), as F.scaled_dot_product_attention(q,
    k, v, attn_mask, is_causal=causal, scale=scale, enable_gqa=True) computes it, q's length
    n_q and k's n equal or not; differentiable in q, k, v (once: differentiating the
    gradients raises, moagen.torch_ops.operator). attn_mask: SDPA's, boolean (True: the key
    is seen) or float (added to the scores), broadcastable to (batch, heads, n_q, n); a row
    it hides wholly gives zeros and no gradient, as SDPA; it takes no gradient itself.
    causal: False, True (SDPA's is_causal, top-left: query i sees keys j <= i) or
    "lower_right" (PyTorch's causal_lower_right, a cache's: j <= i + n - n_q), not with
    attn_mask (SDPA refuses both). dropout_p: SDPA's, in [0, 1), applied whenever it is not
    0 (pass 0 outside training), with moagen's random numbers (moagen.torch_ops.dropout:
    reproducible under torch.manual_seed), for as many queries as keys and no attn_mask.
    key_lengths: one int a batch (a sequence or 1-D integer tensor), key j of batch b seen
    iff j < key_lengths[b] (a right-padded batch; SDPA's boolean attn_mask of shape (batch,
    1, 1, n) True before each length), the padded keys' blocks skipped by the kernels'
    loops, not computed; a boolean attn_mask of that form is taken so too; a batch with no
    key gets SDPA's zeros; not with causal or another attn_mask. lang: the CPU kernels'
    language, "c" or "fortran" (CUDA tensors run the CUDA kernels)."""
    op = "moagen.torch.attention"
    if not (isinstance(causal, bool) or causal == "lower_right"):
        raise ValueError(f"{op}: causal must be False, True (top-left, SDPA's is_causal) or "
                         f"'lower_right' (a cache's), got {causal!r}")
    check_attention(op, q, k, v, lang)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if dropout_p != 0:
        if key_lengths is not None:
            raise ValueError(f"{op}: dropout_p with key_lengths; the dropout kernels take no "
                             "padding")
        return attention_with_dropout(op, q, k, v, attn_mask, causal, scale, dropout_p, lang)
    batch, n = q.shape[0], k.shape[2]
    if key_lengths is not None:
        if causal or attn_mask is not None:
            raise ValueError(f"{op}: key_lengths with causal or attn_mask; the padded kernels "
                             "take neither")
        return _padded(q, k, v, key_lengths_of(op, key_lengths, batch, n), scale, lang)
    lengths = None if attn_mask is None or causal else padding_of(attn_mask, batch, n)
    if lengths is not None:
        return _padded(q, k, v, lengths, scale, lang)
    if attn_mask is not None:
        if causal:
            raise ValueError(f"{op}: attn_mask and causal together; as SDPA, give the causal "
                             "mask inside attn_mask")
        mask, seen = _kernel_mask(op, attn_mask, q, k)
        if mask.dim() == 3:  # a batch's mask shared by its heads: a call a batch, never copied
            out = torch.cat([attention_op(*(t[b:b + 1].contiguous() for t in (q, k, v)), mask[b],
                                          False, 0, -1, scale, lang)[0] for b in range(batch)])
        else:
            out = attention_op(q.contiguous(), k.contiguous(), v.contiguous(), mask, False, 0,
                               -1, scale, lang)[0]
        # SDPA's zeros where the mask hides every key; masked_fill's backward zeroes those
        # rows' dO, so they add nothing to any gradient
        return out if seen is None else out.masked_fill(~seen, 0)
    n_q = q.shape[2]
    offset = n - n_q if causal == "lower_right" else 0
    if offset < 0:
        # the first -offset query rows see no key: SDPA's zeros, no gradient; the others
        # are top-left causal attention over as many rows as keys
        out = attention(q[:, :, -offset:], k, v, causal=True, scale=scale, lang=lang)
        return F.pad(out, (0, 0, -offset, 0))
    if n_q == 1 < n and causal in (False, "lower_right") and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        # decoding: the one query sees every key; the decode kernel has no backward
        return attention_decode_op(q[:, :, 0], k, v, n, scale, lang).unsqueeze(2)
    # made contiguous here, not inside the operator: the operator saves its arguments for
    # the backward, which would otherwise copy a transposed q a second time
    return attention_op(q.contiguous(), k.contiguous(), v.contiguous(), None, bool(causal),
                        offset, -1, scale, lang)[0]
