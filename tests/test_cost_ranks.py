"""The cost model of the distributed kernels (moagen.cost.ranks) against counts made by hand."""
import pytest

from moagen.cost.model import SizeError
from moagen.cost.ranks import hiding_block, rank_cost

SIZES = dict(batch=1, heads=4, n=4096, d=64)


def test_ring_bytes_steps_and_memory():
    cost = rank_cost("ring_attention_fwd", SIZES, 4, rate=1e10, bandwidth=1e9, latency=0)
    rows = 4096 // 4
    block = 1 * 4 * rows * 64  # elements of one K (or V) block
    assert cost.steps == 3 and cost.bytes_step == 2 * block * 8
    assert cost.transfer_step_s == pytest.approx(2 * block * 8 / 1e9)
    # Q K V O, two slots of K and V, two parts of O; lse and its two parts; the local
    # kernel's scratch row of 64 scores a query row
    elements = (4 + 4 + 2) * block + 3 * 4 * rows + 4 * rows * 64
    assert cost.memory_bytes == elements * 8
    # time: three overlapped steps and the last one alone
    assert cost.time_s == pytest.approx(3 * max(cost.compute_step_s, cost.transfer_step_s)
                                        + cost.compute_step_s)


def test_the_causal_ring_halves_the_work_of_a_step():
    ring = rank_cost("ring_attention_fwd", SIZES, 4, rate=1e10, bandwidth=1e9, latency=0)
    causal = rank_cost("ring_attention_fwd_causal", SIZES, 4, rate=1e10, bandwidth=1e9, latency=0)
    assert causal.block["n"] == 4096 // 8 and causal.bytes_step == ring.bytes_step
    assert causal.compute_step_s == pytest.approx(ring.compute_step_s / 2, rel=0.02)


def test_a_step_hides_its_transfer_from_r_itemsize_over_2_bw_rows():
    """4 B H n^2 d flops against 2 B H n d elements: n >= R * 8 / (2 BW), plus the lower
    terms (exponentials, the merge) that the exact counts add."""
    for rate, bandwidth in ((5e10, 25e9), (5e13, 25e9)):
        rows = hiding_block("ring_attention_fwd", SIZES, rate, bandwidth, 0)
        bound = rate * 8 / (2 * bandwidth)
        assert 0.95 * bound - 1 <= rows <= bound + 1


def test_owner_backward_sends_the_sums_home():
    cost = rank_cost("ring_attention_bwd", SIZES, 4, rate=1e10, bandwidth=1e9, latency=0)
    sums = 2 * 1 * 4 * 1024 * 64 * 8 / 1e9
    assert cost.time_s == pytest.approx(3 * (max(cost.compute_step_s, cost.transfer_step_s) + sums)
                                        + cost.compute_step_s + sums)


def test_missing_size_is_a_clear_error():
    with pytest.raises(SizeError, match="give the whole n"):
        rank_cost("ring_attention_fwd", dict(batch=1, heads=1, d=8), 2, 1e9, 1e9, 0)
