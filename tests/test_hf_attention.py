"""attn_implementation="moagen" in Hugging Face transformers (#54, item 4;
moagen.torch_ops.hf): tiny random Llama, Qwen2 and Mistral models (no downloads) in float64
against the same models under "sdpa": logits and every parameter's gradient within 1e-12
(float32: 2e-5), unpadded and left-padded batches, 20 training steps' losses, and greedy
generation with the KV cache.

A padded batch is what a registration in AttentionInterface alone gets wrong: transformers
then builds no mask and passes attention_mask=None, so padded keys are attended."""
import copy
import subprocess
import sys

import pytest
import torch
# imported, not skipped where absent: the test extra pins it, so CI runs these
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import moagen.torch as mt
from moagen.torch_ops import hf
from moagen.torch_ops.hf import attention_forward, packed_offsets

F64 = torch.float64
VOCAB = 100
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)


def _models(config):
    """The same random model (float64, eval) under "sdpa" and under "moagen"."""
    mt.register_hf()
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    ref = transformers.AutoModelForCausalLM.from_config(config).to(F64).eval()
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("moagen")
    return ref, ours


def _batch(padded: bool):
    """Two rows of 9 tokens; padded: the second row's first 4 are padding (left-padded)."""
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
        ids[1, :4] = 0
    return ids, mask


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str, rtol=1e-12):
    """Normwise relative: max|ours - ref| <= rtol max|ref|."""
    err = (ours - ref).abs().max().item()
    assert err <= rtol * ref.abs().max().item(), f"{what}: error {err:.3g}"


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_llama_logits_and_gradients(padded):
    ref, ours = _models(transformers.LlamaConfig(**SIZES))
    ids, mask = _batch(padded)
    weight = torch.randn(2, 9, VOCAB, dtype=F64, generator=torch.Generator().manual_seed(2))
    logits = {}
    for name, model in (("sdpa", ref), ("moagen", ours)):
        logits[name] = model(input_ids=ids, attention_mask=mask).logits
        (logits[name] * weight).sum().backward()
    _close(logits["moagen"], logits["sdpa"], "logits")
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref.parameters()):
        _close(p_ours.grad, p_ref.grad, f"{name}'s gradient")


def test_llama_float32_logits_and_gradients():
    """float32, a left-padded batch: within 2e-5 of sdpa's, normwise."""
    ref, ours = _models(transformers.LlamaConfig(**SIZES))
    ref, ours = ref.float(), ours.float()
    ids, mask = _batch(True)
    outs = {}
    for name, model in (("sdpa", ref), ("moagen", ours)):
        outs[name] = model(input_ids=ids, attention_mask=mask, labels=ids).logits
        outs[name].square().mean().backward()
    _close(outs["moagen"], outs["sdpa"], "logits", 2e-5)
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref.parameters()):
        _close(p_ours.grad, p_ref.grad, f"{name}'s gradient", 2e-5)


def test_llama_training_steps_give_the_same_losses():
    """20 AdamW steps on a left-padded batch (padding left out of the loss), in train mode:
    each step's loss within 1e-12 of sdpa's, and so the parameters after them."""
    ref, ours = _models(transformers.LlamaConfig(**SIZES))
    ids, mask = _batch(True)
    labels = ids.masked_fill(mask == 0, -100)
    losses = {}
    for name, model in (("sdpa", ref), ("moagen", ours)):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses[name].append(loss.detach())
    _close(torch.stack(losses["moagen"]), torch.stack(losses["sdpa"]), "losses")
    assert losses["sdpa"][-1] < 0.9 * losses["sdpa"][0]  # the steps train: the loss falls
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref.parameters()):
        _close(p_ours.detach(), p_ref.detach(), f"{name} after 20 steps")


# two rows of packed sequences (5 + 7 and 3 + 9 tokens), as padding-free collators give them
PACKED = torch.tensor([[*range(5), *range(7)], [*range(3), *range(9)]])


def test_llama_packed_sequences_run_varlen(monkeypatch):
    """Packed rows (position_ids starting again, no attention_mask, no cache: transformers
    looks for packing only then): transformers builds a
    block-diagonal causal mask; moagen runs each row by attention_varlen, never the masked
    kernels, and its logits and gradients equal sdpa's (float64, 1e-12)."""
    ref, ours = _models(transformers.LlamaConfig(**SIZES))
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    varlen_calls = []
    monkeypatch.setattr(hf, "attention_varlen",
                        lambda *a, **k: varlen_calls.append(a[3]) or mt.attention_varlen(*a, **k))
    monkeypatch.setattr(hf, "attention", lambda *a, **k: pytest.fail("masked kernels ran"))
    logits = {}
    for name, model in (("sdpa", ref), ("moagen", ours)):
        logits[name] = model(input_ids=ids, position_ids=PACKED, use_cache=False).logits
        logits[name].square().sum().backward()
    assert varlen_calls[:2] == [[0, 5, 12], [0, 3, 12]]  # the first layer's two rows
    _close(logits["moagen"], logits["sdpa"], "logits")
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref.parameters()):
        _close(p_ours.grad, p_ref.grad, f"{name}'s gradient")


def test_packed_offsets_only_for_the_mask_the_positions_imply():
    """The offsets where the mask is the packed rows' block-diagonal causal one; None where
    it says more (a padded key), the positions say one sequence a row or another packing,
    or there is no boolean mask."""
    sequence = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 9])
    mask = ((sequence[:, :, None] == sequence[:, None, :]) &
            (torch.arange(12)[:, None] >= torch.arange(12)))[:, None]
    assert packed_offsets(mask, PACKED, 12, 12) == [[0, 5, 12], [0, 3, 12]]
    assert packed_offsets(mask, PACKED[:1], 12, 12) is None  # row 0's packing for both
    padded = mask.clone()
    padded[1, :, :, 3] = False  # a key padded out as well: the masked kernels
    assert packed_offsets(padded, PACKED, 12, 12) is None
    assert packed_offsets(mask, torch.arange(12)[None].expand(2, 12), 12, 12) is None
    assert packed_offsets(None, PACKED, 12, 12) is None
    assert packed_offsets(mask.float(), PACKED, 12, 12) is None


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_llama_generate(padded, cache):
    ref, ours = _models(transformers.LlamaConfig(**SIZES))
    ids, mask = _batch(padded)
    tokens = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                             min_new_tokens=20, do_sample=False, cache_implementation=cache)
              for model in (ref, ours)]
    assert tokens[0].shape == (2, 29)
    assert torch.equal(tokens[1], tokens[0])


@pytest.mark.parametrize("config", [
    transformers.Qwen2Config(**SIZES),
    # a window shorter than the batch: the mask function's sliding pattern reaches moagen
    transformers.MistralConfig(**SIZES, sliding_window=4)], ids=["qwen2", "mistral"])
def test_other_architectures_logits(config):
    ref, ours = _models(config)
    ids, mask = _batch(True)
    with torch.no_grad():
        _close(ours(input_ids=ids, attention_mask=mask).logits,
               ref(input_ids=ids, attention_mask=mask).logits, "logits")


@pytest.mark.parametrize("n_q, n, mask", [
    (7, 7, None), (1, 12, None),
    # causal with no mask and fewer queries than keys: a prefill against an empty static
    # cache (as test_llama_generate's unpadded static), top-left as sdpa's, not bottom-right
    (7, 12, None),
    (7, 12, "bool"), (1, 12, "bool"), (7, 12, "float")])
def test_attention_forward_as_sdpas(n_q, n, mask):
    """The attention function itself against transformers' sdpa_attention_forward on the
    same arguments, a causal module with 4 query heads over 2 KV heads."""
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, heads, length, 8, dtype=F64, generator=g)
               for heads, length in ((4, n_q), (2, n), (2, n)))
    if mask is not None:
        seen = torch.rand(2, 1, n_q, n, generator=g) < 0.7
        mask = seen if mask == "bool" else torch.zeros(seen.shape, dtype=F64).masked_fill(
            ~seen, torch.finfo(F64).min)
    ours, none = attention_forward(module, q, k, v, mask, scaling=0.3)
    ref = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)[0]
    assert none is None and ours.shape == (2, n_q, 4, 8)
    _close(ours, ref, "output")


def test_attention_dropout_in_training():
    """The config's attention_dropout reaches moagen's dropout kernels in training: a seed
    gives one step's logits and gradients again, another seed others, neither the eval
    model's; eval drops nothing (sdpa's logits). A padded batch's mask with dropout is
    refused by name."""
    ref, ours = _models(transformers.LlamaConfig(**SIZES, attention_dropout=0.3))
    ids, mask = _batch(False)
    with torch.no_grad():
        _close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, "eval logits")
        evaluated = ours(input_ids=ids).logits
    ours.train()
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        logits = ours(input_ids=ids).logits
        grad, = torch.autograd.grad(logits.sum(), ours.model.layers[0].self_attn.q_proj.weight)
        runs.append((logits.detach(), grad))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.allclose(runs[0][0], runs[2][0])
    assert not torch.allclose(runs[0][0], evaluated)
    assert torch.isfinite(runs[0][1]).all()
    with pytest.raises(NotImplementedError, match="dropout_p with an attn_mask"):
        ours(input_ids=ids, attention_mask=_batch(True)[1])


def test_moagen_torch_does_not_import_transformers():
    code = "import sys, moagen.torch; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
