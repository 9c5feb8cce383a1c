"""The rank layer of a mapping: a dimension lifted over MPI ranks.

MoA's dimension lifting cuts an index over processors: n = ranks x n_local, the outer index
the rank, the inner one the rows a rank holds. Everything a rank does on its rows is an
existing kernel's final ONF at n_local (its algorithm, schedule and CPU mapping, printed by
the C and Fortran printers as on one node); what the rank layer adds lies around whole
kernel calls: which blocks meet on which rank at which step, the messages that bring them,
and the logsumexp merge (moagen.ranks.merge) of the partial results. The ONF's loop IR is a
list of nests, so a loop around nests that carries messages is not a step of it: the rank
layer is printed as a driver function (moagen.ranks.drivers) that calls the rank-local
kernels, in the same library.

Four patterns:
- ring: the lifted size is the sequence (queries and keys both); rank r holds query rows r
  and, at step t, key block (r - t) mod ranks. The blocks that travel go to rank r + 1 and
  come from rank r - 1 (MPI_Isend / MPI_Irecv, posted before the step's compute and waited
  for after it: the transfer hides behind the compute where the compute is longer). Each
  step's partial (O, lse) is merged into the running one.
- zigzag: the causal ring, balanced. The sequence is cut into 2 x ranks chunks and rank r
  holds chunks r and 2 ranks - 1 - r (its "low" and "high" rows), so every rank has as many
  keys before its queries as every other. At step t it holds the blocks of rank
  s = (r - t) mod ranks, and the causal mask decides whole chunk pairs: s = r, the
  `diagonal` kernel (causal) on low x low and high x high and the full one on high x low;
  s < r, low and high queries against s's low keys; s > r, the high queries against both of
  s's chunks. Two chunk-pair blocks a step on every rank.
- owner: the ring backward in owner form. Rank r holds its query rows' Q, O, dO and lse;
  K, V and the sums dK, dV of one key block travel together. At each step the local
  backward gives the block's dQ (added into the rank's own) and dK, dV (added into the
  travelling sums, which then go on to rank r + 1 after the step: the K, V transfer overlaps
  the compute, the sums' cannot, they are what it computed). After the last step one more
  pass brings every block's sums home. The additions happen in one order for a given
  number of ranks: the same bits on every run.
- gather: the lifted size is a KV cache's rows; each rank computes its partial (O, lse) over
  the rows it holds (none: lse = -inf, a part that weighs nothing), MPI_Allgather gives
  every rank every part, and the merge runs over the parts.
"""
from dataclasses import dataclass
from typing import Dict, Tuple

import sympy

from moagen.onf.signature import signature
from moagen.errors import UnknownNameError
from moagen.onf.signature import ArrayParam
from moagen.pipeline import onf_of
from moagen.ranks.merge import merge_onf

PATTERNS = ("ring", "zigzag", "owner", "gather")
RANKS = sympy.Symbol("ranks")  # a driver's scratch extent that the communicator decides


@dataclass(frozen=True)
class RankMapping:
    name: str  # the distributed kernel's name
    local: str  # the kernel each rank runs on its blocks (moagen.kernels)
    variant: str  # its variant
    pattern: str  # one of PATTERNS
    lifted: str  # the local size the ranks cut: the whole is ranks x chunks x this
    travel: Tuple[str, ...] = ()  # ring: the local kernel's inputs that go round the ring
    # the merge's sizes (lse_merge: parts, batch, heads, n, d) as the local kernel's
    merge_sizes: Tuple[Tuple[str, str], ...] = ()
    merged: Tuple[str, str] = ("O", "lse")  # the local kernel's outputs the merge combines
    empty_when_zero: str = ""  # gather: the given size whose 0 leaves a rank no rows
    per_rank: Tuple[str, ...] = ()  # the sizes that may differ from rank to rank
    diagonal: str = ""  # zigzag: the kernel (causal) for a chunk against itself

    @property
    def chunks(self) -> int:
        """The blocks of rows a rank holds (zigzag: its low and high chunks)."""
        return 2 if self.pattern == "zigzag" else 1

    @property
    def whole(self) -> str:
        """The single-process kernel the distributed one computes on the whole problem."""
        return self.diagonal or self.local

    def __post_init__(self):
        if self.pattern not in PATTERNS:
            raise UnknownNameError(f"{self.name}: unknown rank pattern {self.pattern!r}; "
                                   f"expected one of {', '.join(PATTERNS)}")

    @property
    def function(self) -> str:
        return f"{self.name}_{self.variant}"

    def local_signature(self, dtype):
        return signature(onf_of(self.local, self.variant, dtype=dtype), dtype)

    def diagonal_signature(self, dtype):
        return signature(onf_of(self.diagonal, self.variant, dtype=dtype), dtype)

    def merge_signature(self, dtype):
        return signature(merge_onf(), dtype)

    def merge_args(self) -> Dict[str, str]:
        """The merge's size arguments, each as an expression in the driver's names."""
        given = dict(self.merge_sizes)
        return {s.name: given.get(s.name, s.name) for s in self.merge_signature("float64").sizes}

    def driver_arrays(self, dtype) -> Tuple[ArrayParam, ...]:
        """The driver's arrays: the local kernel's inputs and outputs, the buffers of the
        rank layer (two slots of each travelling block, the parts the merge reads), then the
        local kernel's scratch."""
        local = self.local_signature(dtype)
        shape = {a.name: a.shape for a in local.arrays}
        two = sympy.Integer(2)
        chunks = (two,) if self.chunks == 2 else ()
        slots = RANKS if self.pattern == "gather" else two
        own = tuple(ArrayParam(a.name, chunks + a.shape, a.intent)
                    for a in local.inputs + local.outputs)
        buffers = [ArrayParam(f"{x}_ring", (two,) + chunks + shape[x], "scratch")
                   for x in self.travel]
        buffers += [ArrayParam(f"{x}_part", (slots,) + shape[x], "scratch") for x in self.merged]
        if self.pattern == "owner":  # a block's gradients before they are added in
            buffers += [ArrayParam(f"{a.name}_block", a.shape, "scratch") for a in local.outputs]
        return own + tuple(buffers) + local.scratch

    @property
    def carried(self) -> Tuple[str, ...]:
        """owner: the travelling sums (the local kernel's outputs that go round the ring)."""
        outputs = {a.name for a in self.local_signature("float64").outputs}
        return tuple(x for x in self.travel if x in outputs)

    def message_elements(self, sizes) -> Dict[str, int]:
        """The elements of each message a rank sends, by array: the ring's travelling blocks,
        the gather's partial O and lse."""
        shape = {a.name: a.shape for a in self.local_signature("float64").arrays}
        counted = self.merged if self.pattern == "gather" else self.travel
        return {x: self.chunks * int(sympy.prod(shape[x]).subs(
                    {s: sizes[s.name] for s in sympy.prod(shape[x]).free_symbols}))
                for x in counted}

    def bytes_sent(self, sizes, ranks, itemsize) -> int:
        """What one rank sends in one call: each message to its ring neighbour ranks - 1
        times, or (the gather) to each of the ranks - 1 others; the owner's sums once more
        (home)."""
        elements = self.message_elements(sizes)
        home = sum(elements[x] for x in self.carried) if ranks > 1 else 0
        return ((ranks - 1) * sum(elements.values()) + home) * itemsize


RANK_KERNELS = {m.name: m for m in (
    RankMapping("ring_attention_fwd", "attention_fwd", "online", "ring", lifted="n",
                travel=("K", "V"), merge_sizes=(("parts", "2"),)),
    RankMapping("ring_attention_fwd_causal", "attention_fwd", "online", "zigzag", lifted="n",
                travel=("K", "V"), merge_sizes=(("parts", "2"),),
                diagonal="attention_fwd_causal"),
    RankMapping("ring_attention_bwd", "attention_bwd", "dnf", "owner", lifted="n",
                travel=("K", "V", "dK", "dV"), merged=()),
    RankMapping("attention_decode_sharded", "attention_decode", "online", "gather",
                lifted="cap", merge_sizes=(("parts", "ranks"), ("heads", "q_heads"), ("n", "1")),
                empty_when_zero="n", per_rank=("n",)),
)}


def get_rank_kernel(name: str) -> RankMapping:
    if name not in RANK_KERNELS:
        raise UnknownNameError(f"unknown distributed kernel {name!r}; known: "
                               f"{', '.join(RANK_KERNELS)}")
    return RANK_KERNELS[name]
