"""The innermost loops of a function's SASS and the instructions in them.

A loop is a backward branch: a `BRA` (predicated or not) to a lower address of the same
function spans [target, branch]. Branches to one target are one loop (the farthest
branch ends it); a `BRA` to its own address (the trap after EXIT) is none. An innermost
loop contains no other loop. The counts are static (instructions in the listing, not
executed ones): an unrolled body counts each copy, a branch skipping part of the body is
not taken into account.
"""
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

# `/*0de0*/  @P2 BRA 0xb00 ;` -> address, opcode with its modifiers, operands
INSTRUCTION = re.compile(r"/\*([0-9a-fA-F]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)"
                         r"([^;]*);")
ATOMICS = ("ATOM", "ATOMG", "RED", "REDG", "ATOMS")
# what is counted: the opcode (before its first '.') in each class
CLASSES = {"FFMA": ("FFMA",), "DFMA": ("DFMA",), "FMUL": ("FMUL",), "FADD": ("FADD",),
           "DMUL": ("DMUL",), "DADD": ("DADD",), "HMMA": ("HMMA",), "DMMA": ("DMMA",),
           "LDG": ("LDG",), "STG": ("STG",), "LD": ("LD",), "ST": ("ST",),
           "LDS": ("LDS",), "STS": ("STS",), "LDL": ("LDL",), "STL": ("STL",),
           "SHFL": ("SHFL",), "BAR": ("BAR",), "atomics": ATOMICS,
           "integer": ("IMAD", "IADD3", "LEA", "SHF", "LOP3")}
KINDS = {op: kind for kind, ops in CLASSES.items() for op in ops}


@dataclass(frozen=True)
class LoopMix:
    start: int  # the branch target: the loop's first instruction's address
    end: int  # the address of its last backward branch
    instructions: int
    counts: Dict[str, int]  # per CLASSES key (every key, zeros too)
    ldg_128: int  # LDG with a .128 modifier
    lds_128: int  # LDS with a .128 modifier

    @property
    def fma(self) -> int:
        return self.counts["FFMA"] + self.counts["DFMA"]

    @property
    def global_loads(self) -> int:
        """LDG, and generic LD (moagen's kernels have no local arrays and name shared memory
        explicitly: a generic load is a global one)."""
        return self.counts["LDG"] + self.counts["LD"]

    @property
    def global_stores(self) -> int:
        return self.counts["STG"] + self.counts["ST"]

    @property
    def fma_per_global_load(self) -> Optional[float]:
        return self.fma / self.global_loads if self.global_loads else None

    @property
    def fma_per_shared_load(self) -> Optional[float]:
        return self.fma / self.counts["LDS"] if self.counts["LDS"] else None

    def as_dict(self) -> dict:
        return dict(start=self.start, end=self.end, instructions=self.instructions,
                    counts=dict(self.counts), ldg_128=self.ldg_128, lds_128=self.lds_128,
                    fma=self.fma, global_loads=self.global_loads,
                    global_stores=self.global_stores,
                    fma_per_global_load=self.fma_per_global_load,
                    fma_per_shared_load=self.fma_per_shared_load)


@dataclass(frozen=True)
class LoopSummary:
    """A kernel's innermost loops: `hot`, the one with the most FMA (then the most
    instructions; None where there is no loop), and `total`, their counts added."""
    loops: Tuple[LoopMix, ...]
    hot: Optional[LoopMix]
    total: Optional[LoopMix] = field(default=None)


def instructions(sass: str) -> List[Tuple[int, str, str]]:
    """(address, opcode with modifiers, operands) of each instruction of one function."""
    return [(int(a, 16), op, rest.strip()) for a, op, rest in INSTRUCTION.findall(sass)]


def loops(sass: str) -> List[Tuple[int, int]]:
    """(start, end) of every loop, by its backward branches, in address order."""
    ends: Dict[int, int] = {}
    for address, op, rest in instructions(sass):
        if op.split(".")[0] != "BRA":
            continue
        target = re.search(r"0x([0-9a-fA-F]+)", rest)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            ends[start] = max(ends.get(start, address), address)
    return sorted(ends.items())


def innermost_loops(sass: str) -> List[LoopMix]:
    """The instruction mix of each innermost loop of one function's SASS."""
    spans = loops(sass)
    inner = [(s, e) for s, e in spans
             if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in spans)]
    listing = instructions(sass)
    out = []
    for s, e in inner:
        body = [op for address, op, _ in listing if s <= address <= e]
        counts = Counter(KINDS.get(op.split(".")[0]) for op in body)
        out.append(LoopMix(start=s, end=e, instructions=len(body),
                           counts={kind: counts.get(kind, 0) for kind in CLASSES},
                           ldg_128=sum(1 for op in body if op.startswith("LDG") and ".128" in op),
                           lds_128=sum(1 for op in body if op.startswith("LDS") and ".128" in op)))
    return out


def summarize(mixes: List[LoopMix]) -> LoopSummary:
    if not mixes:
        return LoopSummary((), None, None)
    hot = max(mixes, key=lambda m: (m.fma, m.instructions))
    total = LoopMix(start=min(m.start for m in mixes), end=max(m.end for m in mixes),
                    instructions=sum(m.instructions for m in mixes),
                    counts={k: sum(m.counts[k] for m in mixes) for k in CLASSES},
                    ldg_128=sum(m.ldg_128 for m in mixes), lds_128=sum(m.lds_128 for m in mixes))
    return LoopSummary(tuple(mixes), hot, total)
