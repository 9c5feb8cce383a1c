"""GFLOP/s and GB/s of a measured call, from the flops F and bytes M the ONF predicts.

The one call to the cost model is `predicted`; it awaits moagen/cost.py (F and M from the
ONF), and until that exists records carry no rates."""


def predicted(kernel: str, variant: str, sizes: dict, dtype: str):
    """(F, M) of one call, or (None, None) where no cost model is available."""
    return None, None


def with_rates(record: dict) -> dict:
    flops, nbytes = (predicted(record["kernel"], record["variant"], record["sizes"], record["dtype"])
                     if record["variant"] else (None, None))  # baselines: ratios only
    time_s = record["median_s"]
    return dict(record, flops=flops, bytes=nbytes,
                gflops=flops / time_s / 1e9 if flops else None,
                gbs=nbytes / time_s / 1e9 if nbytes else None)
