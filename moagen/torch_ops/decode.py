"""Decoding with a KV cache: `KVCache` holds preallocated K and V caches of shape
(batch, kv_heads, capacity, d) and the number n of valid rows; `append` writes the new
position's rows in place (kv_append, O(d) per head), `attend` runs one query position
against the n valid rows (attention_decode, `split`: the rows cut into slices run in
parallel, merged by their logsumexp; on a GPU `grouped`, a thread block a group of query
heads and slice, where d <= 128). Grouped-query attention by indexing: query head h
reads KV head h // (q_heads / kv_heads), with no copy of the cache.

Inference only: the operators have no autograd formula, so `append` and `attend` refuse a
tensor that requires grad while grad mode is on (their result would silently have no
gradient); call them under torch.no_grad() or torch.inference_mode(). Shapes follow SDPA's
with one position: k, v and q of shape (batch, heads, 1, d)."""
import math
from typing import Optional

import torch
from torch import Tensor

from moagen.kernels.attention import HEAD_DIM_BOUNDS
from moagen.torch_ops.native import call, check_dims, check_lang, check_size, check_tensors
from moagen.torch_ops.operator import Operator


def _kv_append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, n: int,
               lang: str) -> None:
    """Row n of both caches := k, v (batch, kv_heads, d)."""
    call("kv_append", "dnf", lang, k_cache, v_cache, k, v, n=n)


kv_append_op = Operator("moagen::kv_append", _kv_append, lambda *args: None,
                        mutates_args=("k_cache", "v_cache"))


def _attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, n: int, scale: float,
                      lang: str) -> Tensor:
    """O (batch, q_heads, d) of q (batch, q_heads, d) against the caches' first n rows."""
    out, _lse = call("attention_decode", _variant(q), lang, q, k_cache, v_cache, scale=scale,
                     n=n)
    return out


def _variant(q: Tensor) -> str:
    """On a GPU `grouped` (a block a KV head's group of query heads, each K and V row read
    once for them) where its compiled head dims allow; else `split`."""
    (_, compiled), = HEAD_DIM_BOUNDS
    return "grouped" if q.is_cuda and q.shape[-1] <= max(compiled) else "split"


attention_decode_op = Operator("moagen::attention_decode", _attention_decode,
                               lambda q, k_cache, v_cache, n, scale, lang: q.new_empty(q.shape))


class KVCache:
    """K and V caches with room for `capacity` positions, zero rows valid at first, on
    `device` (a CUDA device: the CUDA kernels; the CPU: lang's)."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype=torch.float32, lang: str = "c", device=None):
        check_lang("moagen.torch.KVCache", lang)
        shape = (batch, kv_heads, capacity, head_dim)
        if min(shape) < 1:
            raise ValueError(f"moagen.torch.KVCache: every size must be at least 1, got "
                             f"(batch, kv_heads, capacity, head_dim) = {shape}")
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        check_tensors("moagen.torch.KVCache", cache=self.k)  # the dtype and device
        self.n, self.lang = 0, lang

    @property
    def capacity(self):
        return self.k.shape[2]

    def _one_position(self, op, name, t, heads=None):
        """t (batch, heads, 1, d) as the kernels' (batch, heads, d)."""
        check_tensors(op, **{name: t, "the cache": self.k})
        if t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{op}: {name} requires grad, and the KV cache's kernels have "
                               "no backward (inference only); call it under torch.no_grad(), "
                               "or use F.scaled_dot_product_attention to train")
        check_dims(op, name, t, 4, "(batch, heads, 1, d)")
        batch, kv_heads, _, d = self.k.shape
        expected = (batch, kv_heads if heads is None else t.shape[1], 1, d)
        check_size(op, f"{name}'s shape", tuple(t.shape), expected)
        return t.reshape(t.shape[0], t.shape[1], d)

    def append(self, k: Tensor, v: Tensor) -> None:
        """Writes k and v (batch, kv_heads, 1, d) as the cache's row n, in place; n += 1."""
        op = "moagen.torch.KVCache.append"
        if self.n >= self.capacity:
            raise ValueError(f"{op}: the cache is full ({self.capacity} positions)")
        kv_append_op(self.k, self.v, self._one_position(op, "k", k),
                     self._one_position(op, "v", v), self.n, self.lang)
        self.n += 1

    def attend(self, q: Tensor, *, scale: Optional[float] = None) -> Tensor:
        """Attention of q (batch, q_heads, 1, d) over the n cached positions (the query is
        the newest position, so this is causal attention); (batch, q_heads, 1, d)."""
        op = "moagen.torch.KVCache.attend"
        if self.n == 0:
            raise ValueError(f"{op}: the cache is empty; append the position's k and v first")
        q3 = self._one_position(op, "q", q, heads=True)
        if q.shape[1] % self.k.shape[1]:
            raise ValueError(f"{op}: the cache's {self.k.shape[1]} KV heads do not divide q's "
                             f"{q.shape[1]} heads (grouped-query attention needs whole groups)")
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return attention_decode_op(q3, self.k, self.v, self.n, scale, self.lang).unsqueeze(2)
