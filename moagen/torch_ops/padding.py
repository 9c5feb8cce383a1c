"""Key padding for moagen.torch.attention: per-batch valid key lengths (key j of batch b seen
iff j < lengths[b], a right-padded batch's keys), given as `key_lengths` or read off a
boolean attn_mask of shape (batch, 1, 1, n) whose every row is a run of True then False.
The attention itself is attention_cross's `_padded` kernels, whose loops stop at the last
valid key's block (moagen.torch_ops.attention)."""
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from moagen.torch_ops.native import int_list


def key_lengths_of(op: str, lengths: Union[Tensor, Sequence[int]], batch: int,
                   n: int) -> list:
    """The valid key count of each batch as ints; ValueError unless there is one per batch,
    each from 0 to n."""
    lengths = int_list(op, "key_lengths", lengths, count=batch,
                       held=f"one int per batch ({batch})")
    if any(not 0 <= x <= n for x in lengths):
        raise ValueError(f"{op}: key_lengths must each be from 0 to k's length {n}, got "
                         f"{lengths}")
    return lengths


def padding_of(attn_mask: Tensor, batch: int, n: int) -> Optional[list]:
    """The key lengths a boolean mask of shape (batch or 1, 1, 1, n) says, where each of its
    rows is True up to a length and False after it; None for any other mask."""
    if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or \
            tuple(attn_mask.shape[1:]) != (1, 1, n) or attn_mask.shape[0] not in (1, batch):
        return None
    rows = attn_mask.reshape(attn_mask.shape[0], n)
    lengths = rows.sum(-1)
    prefix = torch.arange(n, device=rows.device) < lengths.unsqueeze(-1)
    if not torch.equal(rows, prefix):
        return None
    return lengths.expand(batch).tolist()
