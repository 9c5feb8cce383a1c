"""moagen's kernels as PyTorch operators (torch.library custom ops, each with an autograd
formula and a fake implementation, so torch.compile(fullgraph=True) traces through them;
an eager call on CPU tensors runs the same code without the dispatcher: operator.py).
Public as `moagen.torch`:

    from moagen import torch as mt
    o = mt.attention(q, k, v, causal=True)     # for F.scaled_dot_product_attention(q, k, v,
                                               #                 is_causal=True)
    o = mt.attention(q, k, v, causal="lower_right")  # attn_mask=causal_lower_right(n_q, n)
    o = mt.attention(q, k, v, attn_mask)       # SDPA's attn_mask, boolean or float
    o = mt.attention(q, k, v, dropout_p=0.1)   # SDPA's dropout, moagen's random numbers
    o = mt.attention_varlen(q, k, v, cu_q, cu_k)  # packed sequences, FlashAttention's varlen
    z = mt.rms_norm(x, weight, eps)            # for F.rms_norm(x, (d,), weight, eps)
    f = mt.swiglu_mlp(x, w_gate, w_up, w_down) # (silu(x w_gate) * (x w_up)) w_down
    cache = mt.KVCache(batch, kv_heads, capacity, d); cache.append(k, v); o = cache.attend(q)
    block = mt.Block(d_model, heads, d_head, d_ff)
    mt.register_hf()   # then attn_implementation="moagen" in transformers (hf.py)

CPU or CUDA tensors, float32 or float64 (the kernels' dtype follows the tensors). On CPU
tensors lang="c" or "fortran" picks the kernels' language; they run on OpenMP threads from
the same libgomp as PyTorch's, so torch.set_num_threads sets theirs too. On CUDA tensors the
CUDA kernels run, queued on PyTorch's current stream, with no copy to or from the host.

Refused rather than answered wrong (moagen.torch_ops.operator): differentiating a gradient
(create_graph=True gives the first-order gradients, whose own backward raises: the backward
kernels build no graph; use PyTorch's operator there), torch.func's differentiating
transforms (grad, jacrev, jvp, ...: take gradients by torch.autograd.grad), tensors on
different devices (a meta tensor among real ones: the kernels would read memory it does not
have), and KVCache calls on tensors that require grad (inference only). torch.func.vmap runs
(an operator call per mapped slice); an empty batch, head count or length gives empty outputs
and PyTorch's gradients."""
from moagen.torch_ops.attention import attention
from moagen.torch_ops.block import Block
from moagen.torch_ops.decode import KVCache
from moagen.torch_ops.hf import register_hf
from moagen.torch_ops.norm_and_mlp import rms_norm, swiglu_mlp
from moagen.torch_ops.varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "rms_norm", "swiglu_mlp", "KVCache", "Block", "register_hf"]
