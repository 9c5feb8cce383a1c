"""Dropout's random numbers in numpy: Philox4x32-10 (Salmon, Moraes, Dror and Shaw,
"Parallel random numbers: as easy as 1, 2, 3", SC'11), a counter-based generator, so that
the element at any position draws its number without drawing the ones before it, and the
backward regenerates the forward's mask from the same seed instead of storing it.

The generated kernels' helper (moagen_keep in C, CUDA and Fortran) computes the same
thing; this is what they are verified against, itself checked against Random123's
known-answer vectors (tests/test_dropout.py).

An element of the (batch, heads, n_q, n_k) probabilities is named by its row (the
row-major offset of its leading indices) and its key k (its last index). One Philox run
decides KEYS_PER_RUN = 8 keys of a row: the run of counter (its low word, its high word,
the row's low word, its high word) for group = k // 8, under the key seed (its low word,
its high word), cut into eight 16-bit pieces, piece k % 8 the low (even) or high (odd)
half of word (k % 8) // 2. The element is kept when its piece * 2**-16 >= p, compared in
float64: p counts at a resolution of 1 / 65536, as FlashAttention's counts at 1 / 256. A
kernel's loop over 8 consecutive keys of a row then makes one run, not 8."""
import numpy as np

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)  # the key's increments between rounds
ROUNDS = 10
WORD = 0xFFFFFFFF
KEYS_PER_RUN = 8  # a run's four words in 16-bit pieces


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


def keep_pieces(rows, keys, seed: int):
    """The 16-bit piece of each element (rows and keys: arrays broadcast together, below
    2**63), a uint64 array."""
    rows, keys = np.broadcast_arrays(np.asarray(rows, dtype=np.uint64),
                                     np.asarray(keys, dtype=np.uint64))
    seed = check_seed(int(seed))
    groups, piece = keys // np.uint64(KEYS_PER_RUN), keys % np.uint64(KEYS_PER_RUN)
    words = philox4x32((groups & np.uint64(WORD), groups >> np.uint64(32),
                        rows & np.uint64(WORD), rows >> np.uint64(32)),
                       (seed & WORD, seed >> 32))
    word = np.choose((piece // np.uint64(2)).astype(np.intp), words)
    return (word >> (np.uint64(16) * (piece % np.uint64(2)))) & np.uint64(0xFFFF)


def kept(pieces, p: float):
    """Whether dropout keeps the elements of these pieces (keep_pieces'): piece / 2**16 >= p,
    compared in float64."""
    return np.asarray(pieces).astype(np.float64) * 2.0 ** -16 >= float(p)


def keep_mask(shape, seed: int, p: float) -> np.ndarray:
    """Dropout's keep mask of an array of `shape` (at least one axis; booleans, True where
    kept)."""
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    pieces = keep_pieces(np.arange(rows)[:, None], np.arange(shape[-1])[None, :], seed)
    return kept(pieces, p).reshape(shape)
