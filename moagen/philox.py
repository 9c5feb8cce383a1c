"""Dropout's random numbers in numpy: Philox4x32-10 (Salmon, Moraes, Dror and Shaw,
"Parallel random numbers: as easy as 1, 2, 3", SC'11), a counter-based generator, so that
the element at any position draws its number without drawing the ones before it, and the
backward regenerates the forward's mask from the same seed instead of storing it.

The generated kernels' helper (moagen_keep in C, CUDA and Fortran) computes the same
thing; this is what they are verified against, itself checked against Random123's
known-answer vectors (tests/test_dropout.py).

An element at row-major offset `counter` (of the (batch, heads, n_q, n_k) probabilities) is
kept when the first 32-bit word of Philox4x32-10 of the counter (its low word, its high
word, 0, 0) under the key seed (its low word, its high word) is >= p * 2**32: compared in
float64, word * 2**-32 >= p."""
import numpy as np

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)  # the key's increments between rounds
ROUNDS = 10
WORD = 0xFFFFFFFF


def philox4x32(counter, key, rounds=ROUNDS):
    """The four 32-bit output words of Philox4x32 for counters (4 words, each an array of
    values below 2**32) under key (2 words): a tuple of four uint64 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.uint64(k) for k in key)
    for _ in range(rounds):
        # 32 x 32 -> 64-bit products: exact in uint64
        p0, p1 = np.uint64(MULTIPLIERS[0]) * c0, np.uint64(MULTIPLIERS[1]) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & np.uint64(WORD),
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & np.uint64(WORD))
        k0, k1 = (k0 + np.uint64(WEYL[0])) & np.uint64(WORD), \
            (k1 + np.uint64(WEYL[1])) & np.uint64(WORD)
    return c0, c1, c2, c3


def check_seed(seed: int) -> int:
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"a dropout seed is an integer in [0, 2**63), got {seed}")
    return seed


def keep_words(counters, seed: int):
    """The first output word for each counter (an array of element offsets, below 2**63)."""
    counters = np.asarray(counters, dtype=np.uint64)
    seed = check_seed(int(seed))
    zero = np.zeros_like(counters)
    return philox4x32((counters & np.uint64(WORD), counters >> np.uint64(32), zero, zero),
                      (seed & WORD, seed >> 32))[0]


def keep_mask(shape, seed: int, p: float) -> np.ndarray:
    """Dropout's keep mask of an array of `shape` (booleans, True where kept), element k of
    its row-major order drawn from counter k."""
    count = int(np.prod(shape, dtype=np.int64))
    words = keep_words(np.arange(count, dtype=np.uint64), seed)
    return (words.astype(np.float64) * 2.0 ** -32 >= float(p)).reshape(shape)
