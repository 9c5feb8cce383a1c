"""moagen.torch.attention as a Hugging Face transformers attention implementation:

    moagen.torch.register_hf()
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation="moagen")

transformers is imported here only, when register_hf is called (the `hf` extra), never by
`import moagen.torch`. The attention function mirrors transformers' own
sdpa_attention_forward (integrations/sdpa_attention.py) in deciding causality and reading the
mask, with moagen's kernels in place of F.scaled_dot_product_attention."""
from typing import Optional

from torch import Tensor, nn

from moagen.torch_ops.attention import attention

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


def register_hf() -> str:
    """Registers attn_implementation="moagen" in transformers, with sdpa's mask function:
    registered in AttentionInterface alone, transformers would build no mask for it and pass
    attention_mask=None, silently ignoring a padded batch's padding. Returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
