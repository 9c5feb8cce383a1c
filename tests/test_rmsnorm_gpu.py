"""RMSNorm's CUDA mapping (moagen/kernels/rmsnorm.py): the backward a thread block per part
of the rows, their threads over the features, then dweight merged from the parts' partial
sums in part order by a thread a feature, no atomics; the CPU keeps its own 16 parts. Run
on the host emulation (each block's threads at once), where the race check and every
variant's check sizes are `moagen verify --lang cuda --emulate --racecheck`'s."""
import numpy as np

from moagen import reference_block, runtime
from moagen.kernels.rmsnorm import EPS, GPU_PARTS, MERGE_THREADS, PART_THREADS, PARTS
from moagen.onf.loops import Loop, Store, walk
from moagen.pipeline import onf_of
from moagen.verify import normwise_error


def test_the_backward_is_a_block_a_part_then_a_thread_a_feature_merging_in_part_order():
    onf = onf_of("rmsnorm_bwd", "dnf", target="cuda")
    partial, merge = onf.nests
    parts = partial.body[0]
    assert parts.var.name == "i_part" and parts.stop == GPU_PARTS
    assert parts.per_block and parts.threads == PART_THREADS
    # the zeroing, the row's sum(dz * weight * x), dx and the part's dweight: the features
    shared = [lp.var.name for lp in walk(partial.body) if isinstance(lp, Loop) and lp.across_threads]
    assert shared == ["c", "c", "c"]
    features = merge.body[0]
    assert features.var.name == "c" and features.parallel == 1 and not features.per_block
    assert features.threads == MERGE_THREADS
    (in_order,) = [lp for lp in walk(features.body) if isinstance(lp, Loop)]
    assert in_order.var.name == "i_part" and not in_order.parallel and in_order.stop == GPU_PARTS
    assert not any(s.atomic for s in walk(onf.nests[0].body + onf.nests[1].body)
                   if isinstance(s, Store))
    assert onf_of("rmsnorm_bwd", "dnf", target="cpu").nests[0].body[0].stop == PARTS


def test_the_backward_on_the_emulation_gives_the_same_bits_every_run():
    """16 parts over 37 rows: parts of 3 rows, the 13th part one row, those after it none
    (the CUDA default's 528 parts and 1024-thread blocks, emulated, took 46 s of the suite
    for the same structure)."""
    backward = runtime.load("rmsnorm_bwd", "dnf", "cuda-emulated", "float64", {"parts": 16})
    rng = np.random.default_rng(5)
    x, dz = rng.standard_normal((2, 1, 37, 70))
    weight = rng.standard_normal(70)
    inv_rms = 1 / np.sqrt(np.mean(x * x, axis=-1) + EPS)
    first, second = (backward(x, weight, inv_rms, dz) for _ in range(2))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, second))
    expected = reference_block.rmsnorm_bwd_numpy(x, weight, inv_rms, dz)
    assert max(map(normwise_error, first, expected)) <= 1e-12
