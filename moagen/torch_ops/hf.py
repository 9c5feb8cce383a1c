"""moagen.torch.attention as a Hugging Face transformers attention implementation:

    moagen.torch.register_hf()
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation="moagen")

transformers is imported here only, when register_hf is called (the `hf` extra), never by
`import moagen.torch`. The attention function mirrors transformers' own
sdpa_attention_forward (integrations/sdpa_attention.py) in deciding causality and reading the
mask, with moagen's kernels in place of F.scaled_dot_product_attention.

Packed sequences (several sequences laid end to end in a batch row, their position_ids
starting again, as transformers' data collators for padding-free training give them) reach
the attention function as a block-diagonal causal mask; where the mask is exactly the one
the position_ids imply, each row runs moagen.torch.attention_varlen, which visits no other
sequence's keys, in place of the masked kernels, which would compute every block."""
from typing import Optional

import torch
from torch import Tensor, nn

from moagen.torch_ops.attention import attention
from moagen.torch_ops.varlen import attention_varlen

NAME = "moagen"


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      **kwargs) -> tuple[Tensor, None]:
    """transformers' attention signature: query (batch, heads, n_q, d), key and value
    (batch, kv_heads, n, d) (fewer KV heads: moagen's GQA, never repeated), attention_mask
    the 4-d boolean mask of sdpa's mask function (registered with this one) or None; returns
    the output as (batch, n_q, heads, d) and no attention weights. dropout (transformers
    passes the config's attention_dropout in training, 0 in eval) is moagen's (dropout_p:
    not with a padded batch's mask)."""
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation={NAME!r}: {name} is not "
                                      "implemented; use 'sdpa' or 'eager'")
    n_q = query.shape[2]
    offsets = packed_offsets(attention_mask, kwargs.get("position_ids"), n_q, key.shape[2])
    if offsets is not None and not dropout:
        return torch.stack([
            attention_varlen(*(t[b].transpose(0, 1) for t in (query, key, value)), cu, cu,
                             causal=True, scale=scaling)
            for b, cu in enumerate(offsets)]), None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as sdpa's: the mask function returns None only where the mask is causal and pads
    # nothing, and then top-left is right (n_q = n, or a prefill against an empty static
    # cache whose keys past n_q are unwritten: not bottom-right); one query sees every key
    causal = n_q > 1 and attention_mask is None and is_causal
    if causal and key.shape[2] > n_q:
        # as sdpa: top-left, no query sees a key past n_q; n_q = n runs the flash kernels
        key, value = key[:, :, :n_q], value[:, :, :n_q]
    out = attention(query, key, value, attention_mask, causal=bool(causal), scale=scaling,
                    dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def packed_offsets(attention_mask: Optional[Tensor], position_ids: Optional[Tensor], n_q: int,
                   n: int) -> Optional[list]:
    """Each batch row's sequence offsets (cu_seqlens: 0, the starts, n) where the rows are
    packed sequences and the mask is exactly their block-diagonal causal mask; else None.
    A sequence starts where a position is not its predecessor's plus one (transformers'
    rule, masking_utils.find_packed_sequence_indices). None where nothing is packed (one
    sequence a row), where queries and keys differ in number (a cache), or where the mask
    says anything more (padding, a window): those run the masked kernels."""
    if attention_mask is None or position_ids is None or attention_mask.dtype != torch.bool \
            or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or n_q != n \
            or position_ids.dim() != 2 or position_ids.shape[-1] != n:
        return None
    positions = position_ids.expand(attention_mask.shape[0], n)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if not starts[:, 1:].any():
        return None
    sequence = starts.cumsum(-1)
    rows = torch.arange(n, device=positions.device)
    implied = (sequence[:, :, None] == sequence[:, None, :]) & (rows[:, None] >= rows[None, :])
    if not torch.equal(attention_mask[:, 0], implied.expand_as(attention_mask[:, 0])):
        return None
    return [[*row.nonzero().flatten().tolist(), n] for row in starts]


def register_hf() -> str:
    """Registers attn_implementation="moagen" in transformers, with sdpa's mask function:
    registered in AttentionInterface alone, transformers would build no mask for it and pass
    attention_mask=None, silently ignoring a padded batch's padding. Returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
