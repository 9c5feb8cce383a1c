"""A tiny decoder-only character language model trained twice, once on moagen's operators
(moagen.torch) and once on PyTorch's, from the same initial weights on the same batches
(the two in lockstep, a step of each in turn, so that their step times meet the same
machine); then text generated through each one's KV-cache decode path with the same seed.

    python examples/train_tiny_lm.py [--steps 300] [--dtype float64 float32] [--out DIR]
    python examples/train_tiny_lm.py --memory 2048 4096   # attention's peak memory at these n
    python examples/train_tiny_lm.py --operators 30     # each operator timed at the model's sizes
    python examples/train_tiny_lm.py --compile          # moagen's model under torch.compile
    python examples/train_tiny_lm.py --device cuda      # on a GPU: moagen's CUDA kernels

The corpus is Python's own help text (pydoc_data.topics, in the standard library), its
first --chars characters. The model: token and position embeddings, --layers pre-norm
blocks (RMSNorm, grouped-query causal attention, RMSNorm, SwiGLU MLP), a final RMSNorm and
the tied embedding as the output layer. The two runs differ in one line (OPERATORS): which
attention, rms_norm and swiglu_mlp the model calls.

It checks, and exits non-zero otherwise: float64 losses equal to 1e-9 relative at every
step; the generated tokens equal. It reports float32's difference next to PyTorch's own
float32-vs-float64 difference (the noise of float32 training), the median step times, and
writes the loss curves (loss.png) and the numbers (results.json) into --out.

--operators N times, instead of training, each operator's forward + backward at the
model's sizes, moagen's against PyTorch's on the same inputs, alternating: medians of N
calls' wall time (on a GPU each call waits for the device, as a step's loss read does) and,
on a GPU, of the device time between two CUDA events; the two sides' outputs and gradients
are compared once (operators.json in --out).
"""
import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

import moagen.torch as mt

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def pytorch_ops():
    """PyTorch's operators, in moagen.torch's signatures."""
    return SimpleNamespace(
        attention=lambda q, k, v, causal: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True),
        rms_norm=lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
        swiglu_mlp=lambda x, wg, wu, wd: (F.silu(x @ wg) * (x @ wu)) @ wd,
        KVCache=TorchKVCache)


def moagen_ops(lang):
    return SimpleNamespace(
        attention=lambda q, k, v, causal: mt.attention(q, k, v, causal=causal, lang=lang),
        rms_norm=lambda x, w, eps: mt.rms_norm(x, w, eps, lang=lang),
        swiglu_mlp=lambda x, wg, wu, wd: mt.swiglu_mlp(x, wg, wu, wd, lang=lang),
        KVCache=lambda *sizes, dtype, device: mt.KVCache(*sizes, dtype=dtype, lang=lang,
                                                         device=device))


OPERATORS = {"moagen": moagen_ops, "pytorch": lambda lang: pytorch_ops()}


class TorchKVCache:
    """PyTorch's decode path with mt.KVCache's interface: rows written in place by
    indexing, SDPA over the valid rows (enable_gqa)."""

    def __init__(self, batch, kv_heads, capacity, head_dim, dtype, device):
        self.k = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.n = 0

    def append(self, k, v):
        self.k[:, :, self.n] = k[:, :, 0]
        self.v[:, :, self.n] = v[:, :, 0]
        self.n += 1

    def attend(self, q):
        return F.scaled_dot_product_attention(q, self.k[:, :, :self.n], self.v[:, :, :self.n],
                                              enable_gqa=True)


class TinyLM(nn.Module):
    def __init__(self, vocab, context, d_model, heads, kv_heads, d_ff, layers, dtype, eps=1e-5):
        super().__init__()
        self.heads, self.kv_heads, self.d_head = heads, kv_heads, d_model // heads
        self.eps, self.context = eps, context
        self.embed = nn.Parameter(torch.randn(vocab, d_model, dtype=dtype) * 0.02)
        self.position = nn.Parameter(torch.randn(context, d_model, dtype=dtype) * 0.02)
        matrix = lambda rows, cols: nn.Parameter(torch.randn(rows, cols, dtype=dtype)
                                                 / math.sqrt(rows))
        kv = 2 * kv_heads * self.d_head
        self.layers = nn.ModuleList(nn.ParameterDict({
            "norm1": nn.Parameter(torch.ones(d_model, dtype=dtype)),
            "wq": matrix(d_model, d_model), "wkv": matrix(d_model, kv),
            "wo": matrix(d_model, d_model),
            "norm2": nn.Parameter(torch.ones(d_model, dtype=dtype)),
            "wg": matrix(d_model, d_ff), "wu": matrix(d_model, d_ff), "wd": matrix(d_ff, d_model),
        }) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(d_model, dtype=dtype))

    def _heads(self, h, layer):
        """q (batch, heads, t, d_head), k and v (batch, kv_heads, t, d_head)."""
        q = (h @ layer["wq"]).unflatten(-1, (self.heads, self.d_head)).transpose(1, 2)
        kv = (h @ layer["wkv"]).unflatten(-1, (2, self.kv_heads, self.d_head))
        k, v = kv.permute(2, 0, 3, 1, 4)
        return q, k, v

    def _block(self, ops, x, layer, attend):
        q, k, v = self._heads(ops.rms_norm(x, layer["norm1"], self.eps), layer)
        x = x + attend(q, k, v).transpose(1, 2).flatten(2) @ layer["wo"]
        h = ops.rms_norm(x, layer["norm2"], self.eps)
        return x + ops.swiglu_mlp(h, layer["wg"], layer["wu"], layer["wd"])

    def _logits(self, ops, x):
        return ops.rms_norm(x, self.norm, self.eps) @ self.embed.T

    def forward(self, ops, tokens):
        """Logits of every position of tokens (batch, t), attention causal."""
        x = self.embed[tokens] + self.position[:tokens.shape[1]]
        for layer in self.layers:
            x = self._block(ops, x, layer, lambda q, k, v: ops.attention(q, k, v, causal=True))
        return self._logits(ops, x)

    def caches(self, ops, batch):
        return [ops.KVCache(batch, self.kv_heads, self.context, self.d_head,
                            dtype=self.embed.dtype, device=self.embed.device)
                for _ in self.layers]

    def step(self, ops, token, position, caches):
        """Logits of the next token after `token` (batch,) at `position`, each layer's k and
        v appended to its cache and attended through it."""
        x = (self.embed[token] + self.position[position])[:, None]

        def attend(cache):
            def through_cache(q, k, v):
                cache.append(k, v)
                return cache.attend(q)
            return through_cache

        for layer, cache in zip(self.layers, caches):
            x = self._block(ops, x, layer, attend(cache))
        return self._logits(ops, x)[:, -1]


def corpus(chars):
    """Python's help topics (standard library), joined in sorted order: English prose,
    grammar and code; the first `chars` characters."""
    from pydoc_data.topics import topics
    text = "".join(topics[key] for key in sorted(topics))[:chars]
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return text, vocab, torch.tensor([index[c] for c in text])


def progress(step, total, losses, started, label, width=30):
    done = (step + 1) * width // total
    rate = (step + 1) / max(time.perf_counter() - started, 1e-9)
    shown = "  ".join(f"{name} {loss:.4f}" for name, loss in losses.items())
    print(f"\r{label:>8} [{'#' * done}{'.' * (width - done)}] {step + 1}/{total} "
          f"loss {shown}  {rate:.1f} steps/s", end="" if step + 1 < total else "\n",
          file=sys.stderr, flush=True)


def stepper(model, ops, args, compiled=False):
    """One training step of the model on a window of tokens: (loss, seconds it took).
    compiled: the model's forward (and so its backward) under torch.compile(fullgraph=True),
    Inductor; its first step includes the compile."""
    forward = lambda tokens: model(ops, tokens)
    if compiled:
        forward = torch.compile(forward, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def step(window):
        tick = time.perf_counter()
        logits = forward(window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item(), time.perf_counter() - tick

    return step


def train(steppers, data, args, label):
    """Losses and step times of each model (steppers: stepper by name), trained in lockstep:
    each batch, drawn from a generator seeded the same for every run, goes to every model in
    turn, the order alternating from step to step, so that the machine's changing speed
    (other work on it, its clock) reaches every model alike."""
    batches = torch.Generator().manual_seed(args.seed)
    losses = {name: [] for name in steppers}
    times = {name: [] for name in steppers}
    started = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(len(data) - args.context - 1, (args.batch,), generator=batches)
        window = torch.stack([data[s:s + args.context + 1] for s in starts.tolist()])
        window = window.to(args.device)
        order = list(steppers) if step % 2 == 0 else list(reversed(steppers))
        for name in order:
            loss, seconds = steppers[name](window)
            losses[name].append(loss)
            times[name].append(seconds)
        progress(step, args.steps, {name: losses[name][-1] for name in steppers}, started, label)
    return losses, times


@torch.no_grad()
def generate(model, ops, prompt, length, seed):
    """Tokens sampled from the model's softmax through the decode path: the prompt fed one
    position at a time into the caches, then `length` sampled tokens."""
    caches = model.caches(ops, batch=1)
    sampler = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    device = model.embed.device
    for position in range(min(len(prompt) + length - 1, model.context)):
        logits = model.step(ops, torch.tensor(tokens[position:position + 1], device=device),
                            position, caches)
        if position + 1 >= len(tokens):  # sampled on the CPU, with the CPU's generator
            probs = torch.softmax(logits.double(), -1).cpu()
            tokens.append(torch.multinomial(probs, 1, generator=sampler).item())
    return tokens


def relative_gap(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def run(args):
    torch.set_num_threads(args.threads)
    text, vocab, data = corpus(args.chars)
    where = (f"{args.threads} threads" if args.device == "cpu"
             else torch.cuda.get_device_name(args.device))
    print(f"corpus: {len(text)} characters of pydoc_data.topics, {len(vocab)} symbols; "
          f"{args.steps} steps of {args.batch} x {args.context} tokens, on {where}")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results = {"args": settings, "runs": {}}
    for dtype in args.dtype:
        torch.manual_seed(args.seed)
        initial = TinyLM(len(vocab), args.context, args.d_model, args.heads, args.kv_heads,
                         args.d_ff, args.layers, DTYPES[dtype]).state_dict()
        models, steppers = {}, {}
        for name, operators in OPERATORS.items():
            models[name] = TinyLM(len(vocab), args.context, args.d_model, args.heads,
                                  args.kv_heads, args.d_ff, args.layers,
                                  DTYPES[dtype]).to(args.device)
            models[name].load_state_dict(initial)
            steppers[name] = stepper(models[name], operators(args.lang), args,
                                     compiled=args.compile and name == "moagen")
        losses, times = train(steppers, data, args, dtype)
        prompt = [vocab.index(c) for c in args.prompt]
        for name, model in models.items():
            tokens = generate(model, OPERATORS[name](args.lang), prompt, args.generate, args.seed)
            results["runs"][f"{name} {dtype}"] = {
                "losses": losses[name],
                "median_step_s": statistics.median(times[name][len(times[name]) // 5:]),
                "tokens": tokens, "text": "".join(vocab[t] for t in tokens),
                # the other operators' decode from this run's weights: the same tokens?
                "tokens_other_path": generate(model, OPERATORS["pytorch" if name == "moagen"
                                                                else "moagen"](args.lang),
                                              prompt, args.generate, args.seed)}
    return results


def check_and_report(results):
    runs, failures = results["runs"], []
    for key, run in runs.items():
        print(f"{key}: median step {run['median_step_s'] * 1e3:.2f} ms, final loss "
              f"{run['losses'][-1]:.4f}; generated:\n  {run['text']!r}")
        if run["tokens"] != run["tokens_other_path"]:
            failures.append(f"{key}: the other decode path generated other tokens")
    for dtype in ("float64", "float32"):
        if f"moagen {dtype}" not in runs:
            continue
        ours, theirs = runs[f"moagen {dtype}"], runs[f"pytorch {dtype}"]
        gap = relative_gap(ours["losses"], theirs["losses"])
        results[f"loss_gap_{dtype}"] = gap
        print(f"{dtype}: largest relative loss difference, moagen vs PyTorch, over the steps: "
              f"{gap:.3g}; step time moagen / PyTorch: "
              f"{ours['median_step_s'] / theirs['median_step_s']:.2f}")
        if dtype == "float64" and gap > 1e-9:
            failures.append(f"float64 losses differ by {gap:.3g} relative (> 1e-9)")
    if "pytorch float32" in runs and "pytorch float64" in runs:
        noise = relative_gap(runs["pytorch float32"]["losses"], runs["pytorch float64"]["losses"])
        results["loss_gap_pytorch_float32_vs_float64"] = noise
        print(f"the noise of float32 training: PyTorch float32 vs float64, largest relative "
              f"loss difference {noise:.3g}")
    return failures


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(7, 4))
    for key, run in results["runs"].items():
        axis.plot(run["losses"], label=key, linestyle="-" if "moagen" in key else "--")
    axis.set(xlabel="step", ylabel="cross-entropy loss", title="tiny character LM")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# -- each operator's forward + backward, both sides at the model's sizes --------------

def operator_cases(args, dtype):
    """name -> (how an operator set runs it, the inputs it differentiates), at the model's
    sizes: its attention's (causal, grouped-query), its norms', its MLP's."""
    new = lambda *shape: torch.randn(*shape, dtype=dtype, device=args.device).requires_grad_()
    d_head, rows = args.d_model // args.heads, (args.batch, args.context)
    q, k, v = (new(args.batch, heads, args.context, d_head)
               for heads in (args.heads, args.kv_heads, args.kv_heads))
    x, w = new(*rows, args.d_model), new(args.d_model)
    weights = (new(args.d_model, args.d_ff), new(args.d_model, args.d_ff),
               new(args.d_ff, args.d_model))
    return {"attention (causal, GQA)": (lambda ops, *t: ops.attention(*t, causal=True), (q, k, v)),
            "rms_norm": (lambda ops, *t: ops.rms_norm(*t, 1e-5), (x, w)),
            "swiglu_mlp": (lambda ops, *t: ops.swiglu_mlp(*t), (x, *weights))}


def _forward_backward(run, ops, inputs, grad):
    out = run(ops, *inputs)
    return (out, *torch.autograd.grad(out, inputs, grad))


def _timed(call, device):
    """(wall seconds, device seconds or None) of one call."""
    if device == "cpu":
        start = time.perf_counter()
        call()
        return time.perf_counter() - start, None
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    begin.record()
    call()
    end.record()
    end.synchronize()
    return time.perf_counter() - start, begin.elapsed_time(end) / 1e3


def _median(samples, which):
    """The median of the samples' wall (0) or device (1) seconds; None where not measured."""
    values = [sample[which] for sample in samples]
    return None if values[0] is None else statistics.median(values)


def time_operators(args, warmup=3):
    """Rows per dtype: each operator's median times on both sides and the largest relative
    gap between their outputs and gradients."""
    torch.set_num_threads(args.threads)
    results = {}
    for dtype in args.dtype:
        torch.manual_seed(args.seed)
        rows = results[dtype] = []
        sides = {side: operators(args.lang) for side, operators in OPERATORS.items()}
        for name, (run, inputs) in operator_cases(args, DTYPES[dtype]).items():
            grad = torch.randn_like(run(sides["pytorch"], *inputs))
            got, want = (_forward_backward(run, sides[side], inputs, grad)
                         for side in ("moagen", "pytorch"))
            gap = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
                      for a, b in zip(got, want))
            samples = {side: [] for side in sides}
            for repeat in range(warmup + args.operators):
                for side, ops in sides.items():
                    sample = _timed(lambda: _forward_backward(run, ops, inputs, grad), args.device)
                    if repeat >= warmup:
                        samples[side].append(sample)
            rows.append(dict(operator=name, max_relative_gap=gap,
                             wall_s={side: _median(s, 0) for side, s in samples.items()},
                             device_s={side: _median(s, 1) for side, s in samples.items()}))
    return results


def report_operators(results, args):
    where = (f"the CPU, {args.threads} threads" if args.device == "cpu"
             else torch.cuda.get_device_name(args.device))
    on_gpu = args.device != "cpu"
    for dtype, rows in results.items():
        print(f"forward + backward, {dtype}, {args.batch} x {args.context} tokens, d_model "
              f"{args.d_model}, {args.heads}/{args.kv_heads} heads, d_ff {args.d_ff}, on "
              f"{where}; medians of {args.operators} calls")
        header = "| operator | moagen ms | PyTorch ms | PyTorch / moagen |"
        header += " moagen device ms | PyTorch device ms |" if on_gpu else ""
        print(header + "\n|" + " --- |" * (header.count("|") - 1))
        for r in rows:
            wall, dev = r["wall_s"], r["device_s"]
            line = (f"| {r['operator']} | {wall['moagen'] * 1e3:.3f} | "
                    f"{wall['pytorch'] * 1e3:.3f} | {wall['pytorch'] / wall['moagen']:.2f} |")
            line += f" {dev['moagen'] * 1e3:.3f} | {dev['pytorch'] * 1e3:.3f} |" if on_gpu else ""
            print(line)
        print("largest relative gap between the two sides' outputs and gradients: "
              + ", ".join(f"{r['operator']} {r['max_relative_gap']:.1e}" for r in rows))


# -- attention's peak memory, each side in a fresh process ------------------------------

def _resident_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def attention_peak(name, n, heads, d, dtype, lang):
    """The process's peak resident memory over what it held before attention's forward and
    backward at length n: Linux's high-water mark (VmHWM) reset just before (clear_refs
    5), after a warm-up on n = 64 (kernels loaded, allocator primed). Inputs and the output
    gradient are allocated before; O, dQ, dK, dV and every temporary count."""
    torch.set_num_threads(2)
    ops = OPERATORS[name](lang)

    def fwd_bwd(length):
        q, k, v = (torch.randn(1, heads, length, d, dtype=DTYPES[dtype], requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, heads, length, d, dtype=DTYPES[dtype])
        return lambda: ops.attention(q, k, v, causal=True).backward(grad)

    fwd_bwd(64)()
    run_it = fwd_bwd(n)
    before = _resident_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    run_it()
    return (_resident_kib("VmHWM") - before) / 1024


def measure_memory(args, heads=8, d=64):
    """Each side's peak at each length: O(n d) memory doubles with n, O(n^2) quadruples."""
    results = {}
    for dtype in args.dtype:
        for n in args.memory:
            peaks = results.setdefault(dtype, {})[n] = {}
            for name in OPERATORS:
                out = subprocess.run([sys.executable, __file__, "--peak-of", name, "--memory",
                                      str(n), "--lang", args.lang, "--dtype", dtype],
                                     capture_output=True, text=True, check=True)
                peaks[name] = float(out.stdout.split()[-1])
            size = DTYPES[dtype].itemsize
            outputs_mib = 4 * heads * n * d * size / 2 ** 20  # O, dQ, dK, dV
            scores_mib = heads * n ** 2 * size / 2 ** 20
            print(f"attention forward + backward, causal, {heads} heads x n = {n} x d = {d}, "
                  f"{dtype}: peak resident memory over the inputs: moagen "
                  f"{peaks['moagen']:.1f} MiB, PyTorch (SDPA) {peaks['pytorch']:.1f} MiB; for "
                  f"scale, the n x n scores of every head would take {scores_mib:.0f} MiB, the "
                  f"outputs O, dQ, dK, dV {outputs_mib:.0f} MiB")
    return results


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=["float64", "float32"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=160)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chars", type=int, default=200_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the models train; on cuda, moagen's CUDA kernels run")
    p.add_argument("--lang", choices=("c", "fortran"), default="c")
    p.add_argument("--prompt", default="The ")
    p.add_argument("--generate", type=int, default=56)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="train the moagen model under torch.compile(fullgraph=True)")
    p.add_argument("--out", type=Path, default=Path("bench-results/tiny-lm"))
    p.add_argument("--memory", type=int, nargs="+", metavar="N",
                   help="measure attention's peak memory at lengths N instead of training")
    p.add_argument("--operators", type=int, metavar="N",
                   help="time each operator's forward + backward, both sides, medians of N "
                        "calls, instead of training")
    p.add_argument("--peak-of", choices=OPERATORS, help=argparse.SUPPRESS)  # one side, in a child
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.peak_of:
        print(attention_peak(args.peak_of, args.memory[0], 8, 64, args.dtype[0], args.lang))
        return 0
    if args.memory:
        if args.device != "cpu":
            print("--memory measures the CPU's resident memory; run it without --device",
                  file=sys.stderr)
            return 2
        results = {"peak_mib": measure_memory(args)}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory.json").write_text(json.dumps(results, indent=1))
        return 0
    if args.operators:
        results = time_operators(args)
        report_operators(results, args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "operators.json").write_text(json.dumps(results, indent=1))
        return 0
    results = run(args)
    failures = check_and_report(results)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "loss.png")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"loss curves: {args.out / 'loss.png'}, numbers: {args.out / 'results.json'}")
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
