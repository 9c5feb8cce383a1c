"""Each moagen.torch operator's forward + backward against PyTorch's own, at a small model's
sizes (the tiny LM's by default: 16 x 64 tokens, d_model 64, 4 query and 2 KV heads, d_ff
160), on the CPU or a CUDA GPU: the median wall time of a call (on a GPU each call waits for
the device, as a training step's loss read does) and, on a GPU, the device time between two
CUDA events. Both sides run on the same inputs, alternating; their outputs are compared
once, as a check that the two computed the same thing.

    python examples/operator_times.py [--device cuda] [--dtype float32] [--repeats 30]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import moagen.torch as mt

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def cases(args, dtype, device):
    """name -> (moagen's function, PyTorch's, the inputs they differentiate)."""
    new = lambda *shape: torch.randn(*shape, dtype=dtype, device=device).requires_grad_()
    d_head, tokens = args.d_model // args.heads, (args.batch, args.context)
    q, k, v = (new(args.batch, heads, args.context, d_head)
               for heads in (args.heads, args.kv_heads, args.kv_heads))
    x, w = new(*tokens, args.d_model), new(args.d_model)
    wg, wu = new(args.d_model, args.d_ff), new(args.d_model, args.d_ff)
    wd = new(args.d_ff, args.d_model)
    return {
        "attention (causal, GQA)": (
            lambda *t: mt.attention(*t, causal=True),
            lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True),
            (q, k, v)),
        "rms_norm": (lambda *t: mt.rms_norm(*t, 1e-5),
                     lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-5), (x, w)),
        "swiglu_mlp": (mt.swiglu_mlp, lambda x, wg, wu, wd: (F.silu(x @ wg) * (x @ wu)) @ wd,
                       (x, wg, wu, wd)),
    }


def forward_backward(fn, inputs, grad):
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, grad))


def timed(call, device):
    """(wall seconds, device seconds or None) of one call."""
    if device.type != "cuda":
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


def measure(args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    rows = []
    for name, (ours, theirs, inputs) in cases(args, dtype, device).items():
        grad = torch.randn_like(ours(*inputs))
        got, want = forward_backward(ours, inputs, grad), forward_backward(theirs, inputs, grad)
        gap = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
                  for a, b in zip(got, want))
        samples = {"moagen": [], "pytorch": []}
        for repeat in range(args.warmup + args.repeats):
            for side, fn in (("moagen", ours), ("pytorch", theirs)):
                sample = timed(lambda: forward_backward(fn, inputs, grad), device)
                if repeat >= args.warmup:
                    samples[side].append(sample)
        rows.append(dict(operator=name, max_relative_gap=gap,
                         wall_s={side: _median(s, 0) for side, s in samples.items()},
                         device_s={side: _median(s, 1) for side, s in samples.items()}))
    return rows


def _median(samples, which):
    """The median of the samples' wall (0) or device (1) seconds; None where not measured."""
    values = [sample[which] for sample in samples]
    return None if values[0] is None else statistics.median(values)


def report(rows, args):
    where = torch.cuda.get_device_name(args.device) if args.device == "cuda" \
        else f"the CPU, {args.threads} threads"
    print(f"forward + backward, {args.dtype}, {args.batch} x {args.context} tokens, d_model "
          f"{args.d_model}, {args.heads}/{args.kv_heads} heads, d_ff {args.d_ff}, on {where}; "
          f"medians of {args.repeats} calls")
    header = "| operator | moagen ms | PyTorch ms | PyTorch / moagen |"
    if args.device == "cuda":
        header += " moagen device ms | PyTorch device ms |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for r in rows:
        wall, dev = r["wall_s"], r["device_s"]
        line = (f"| {r['operator']} | {wall['moagen'] * 1e3:.3f} | {wall['pytorch'] * 1e3:.3f} | "
                f"{wall['pytorch'] / wall['moagen']:.2f} |")
        if args.device == "cuda":
            line += f" {dev['moagen'] * 1e3:.3f} | {dev['pytorch'] * 1e3:.3f} |"
        print(line)
    print("largest relative gap between the two sides' outputs and gradients: "
          + ", ".join(f"{r['operator']} {r['max_relative_gap']:.1e}" for r in rows))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, help="also write the rows as JSON here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    rows = measure(args)
    report(rows, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()},
                                            rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
