"""`moagen.torch`: moagen's kernels as PyTorch operators with autograd (moagen.torch_ops).
The imports are absolute, so `import torch` anywhere in moagen is PyTorch, not this module."""
from moagen.torch_ops import (Block, KVCache, attention, attention_varlen, register_hf,
                              rms_norm, swiglu_mlp)

__all__ = ["attention", "attention_varlen", "rms_norm", "swiglu_mlp", "KVCache", "Block", "register_hf"]
