"""A variant's steps in three layers, as a kernel module states them.

- algorithm: what is materialized and the algebraic rewrites (OnlineSoftmax, SplitKeys,
  Scatter, PartBuffers, PartialSums, InPlace), with the loop steps they apply to (the
  fusion and hoisting that put a row's max, sum and weighted sum in one nest);
- schedule: loop transformations only (tiling, unrolling, interchange, fusion); one for
  every target kind, or per kind where a GPU's tiles are not a CPU's (a kind not named
  takes the CPU's);
- mapping, per target kind: where the loops run (the CPU: OpenMP parallel loops; CUDA:
  GPU threads; OpenACC: gang vector loops, a vector lane per iteration, as many a gang as a
  CUDA block holds threads). A kind without a mapping of its own gets one derived from the
  CPU's: each parallel loop chain one GPU thread per iteration.

The layers are applied in that order; each refuses a step of a layer after its own."""
from dataclasses import dataclass, field
from typing import Mapping, Tuple, Union

from moagen.errors import ScheduleError
from moagen.onf.realize import CLOSING
from moagen.kinds import KINDS, gpu_threads
from moagen.steps.loop.parallel import GpuThreads


def threads_per_tile(cpu_steps: Tuple, tiles: Mapping[str, Tuple[str, ...]]) -> dict:
    """A mapping for the CPU and the GPU targets: the GPU's derived from the CPU's
    (gpu_threads), except that each nest named in `tiles` runs a GPU thread per iteration
    of the loops it names (a register tile's every tile, where the CPU runs a thread per
    column of tiles: too few threads to fill a GPU; docs/PERFORMANCE.md, "CUDA:
    FlashAttention-2's form for attention, judged without a GPU")."""
    gpu = tuple(GpuThreads(tiles[step.nest], nest=step.nest) if step.nest in tiles else step
                for step in gpu_threads(cpu_steps))
    return {"cpu": tuple(cpu_steps),
            **{name: gpu for name, kind in KINDS.items() if kind.derive_mapping}}


_ALLOWED = {"algorithm": ("algorithm", "schedule"), "schedule": ("schedule",),
            "mapping": ("mapping",)}


@dataclass(frozen=True)
class Layers:
    algorithm: Tuple = ()
    schedule: Union[Tuple, Mapping[str, Tuple]] = ()  # one, or target kind -> steps
    mapping: Mapping[str, Tuple] = field(default_factory=dict)  # target kind -> steps

    def __post_init__(self):
        schedules = self.schedule.values() if isinstance(self.schedule, Mapping) else (self.schedule,)
        if isinstance(self.schedule, Mapping) and "cpu" not in self.schedule:
            raise ScheduleError("a schedule per target kind names the CPU's at least")
        for layer, steps in (("algorithm", self.algorithm),
                             *(("schedule", s) for s in schedules),
                             *(("mapping", m) for m in self.mapping.values())):
            wrong = [str(s) for s in steps if s.layer not in _ALLOWED[layer]]
            if wrong:
                raise ScheduleError(f"the {layer} layer holds {', '.join(wrong)}, steps of "
                                    "another layer")
        if "cpu" not in self.mapping:
            raise ScheduleError("a variant maps its loops for the CPU at least")

    def mapping_for(self, target: str) -> Tuple:
        if target in self.mapping:
            return self.mapping[target]
        derive = KINDS[target].derive_mapping if target in KINDS else None
        if derive is None:
            raise ScheduleError(f"no mapping for target {target!r}: the variant gives "
                                f"{', '.join(self.mapping)}")
        return derive(self.mapping["cpu"])

    def schedule_for(self, target: str) -> Tuple:
        if isinstance(self.schedule, Mapping):
            return tuple(self.schedule.get(target, self.schedule["cpu"]))
        return tuple(self.schedule)

    def steps(self, target: str) -> Tuple:
        return tuple(self.algorithm) + self.schedule_for(target) + self.mapping_for(target)


def cpu(*steps) -> dict:
    """A mapping for the CPU only (CUDA's derived from it)."""
    return {"cpu": tuple(steps)}


def format_layers(layers: Layers, target: str, params: dict, upto=None) -> str:
    """The variant's steps for a target by layer, numbered as --upto counts them; the last
    are what every schedule ends with (moagen.onf.realize.CLOSING)."""
    lines = [f"target {target}"
             + (f", parameters {' '.join(f'{k}={v}' for k, v in params.items())}" if params
                else "")]
    number = 0
    for name, steps in (("algorithm", layers.algorithm), ("schedule", layers.schedule_for(target)),
                        ("mapping", layers.mapping_for(target)), ("always", CLOSING)):
        lines.append(f"  {name}:")
        for step in steps:
            number += 1
            mark = "  <- shown" if number == upto else ""
            lines.append(f"    {number:>2}. {step}{mark}")
    return "\n".join(lines) + "\n\n"
