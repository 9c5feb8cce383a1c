"""GFLOP/s and GB/s of a measured call, from the flops F and bytes M that the cost model
(moagen.cost) predicts from the variant's ONF at the call's sizes. M is the model's
traffic between memory and cache (moagen.cost.Cost.M), so GB/s is an effective bandwidth.
min GB/s counts each element the call must read or write once (Cost.M_min): what a GPU's
kernels are held to against the device's copy bandwidth, whose caches the CPU's cache
model does not describe."""


def predicted(kernel: str, variant: str, sizes: dict, dtype: str, params=None, lang=None):
    """(F, M, M_min) of one call with these schedule parameters: the one call to the cost
    model, a size the call chooses (decode grouped's w) chosen as on the device of `lang`'s
    kernels (the host where None)."""
    from moagen.cost import predict
    from moagen.targets import get_target
    cost = predict(kernel, variant, dtype, params)
    device = get_target(lang).device if lang and cost.chosen else None
    env = cost.sizes_from(sizes, device().multiprocessors if device else None)
    return _at(cost.flops, env), _at(cost.M, env), _at(cost.M_min, env)


def _at(expr, env):
    """The count at these sizes, or None where the model has no closed form for it (the
    causal flash's key blocks): the bench then reports the time alone."""
    from moagen.cost.model import SizeError, value
    try:
        return value(expr, env)
    except SizeError:
        return None


def with_rates(record: dict) -> dict:
    if not record["variant"]:  # baselines: compared by time only
        return dict(record, flops=None, bytes=None, gflops=None, gbs=None)
    flops, nbytes, least = predicted(record["kernel"], record["variant"], record["sizes"],
                                     record["dtype"], record.get("params"), record.get("lang"))
    per_second = lambda count: None if count is None else count / record["median_s"] / 1e9
    return dict(record, flops=flops, bytes=nbytes, gflops=per_second(flops),
                gbs=per_second(nbytes), min_bytes=least, min_gbs=per_second(least))


def predict_ahead(groups):
    """Run the cost model for each of our calls in these groups before their worker starts
    timing them: it takes seconds of sympy a variant (remembered afterwards), which, run
    while the worker timed the next group, took a core from the timed calls
    (docs/PERFORMANCE.md, "The bench"). The counts at the call's sizes are
    left to with_rates, cheap by then."""
    from moagen.bench import calls
    from moagen.cost import predict
    for group in groups:
        for lang, variant, *params in group["impls"]:
            if lang not in calls.BASELINES:
                chosen = calls.schedule(group["kernel"], variant, lang, group["dtype"], *params)
                predict(group["kernel"], variant, group["dtype"], chosen["params"])
