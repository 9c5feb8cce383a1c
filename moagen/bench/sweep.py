"""Run benchmark jobs, one worker process per OpenMP setting, and append every measurement
to a JSON-lines file as soon as it arrives (so a failure later keeps what was measured).

The file holds a "run" record per run (the machine, the command), then the run's "result"
and "roof" records, each tagged with the run's id and the setting it ran under."""
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from moagen.bench import machine
from moagen.errors import MoagenError


@dataclass(frozen=True)
class Setting:
    """An OpenMP deployment: threads, binding and places (environment, read at process
    start), where inputs are first touched, and one or one-per-batch-entry calls."""
    threads: int
    bind: str = None  # OMP_PROC_BIND, e.g. "close" or "spread"; None leaves it unset
    places: str = None  # OMP_PLACES, e.g. "cores"
    touch: str = "serial"
    calls: str = "one"

    def env(self) -> dict:
        env = {name: str(self.threads) for name in
               ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        env.update({k: v for k, v in (("OMP_PROC_BIND", self.bind), ("OMP_PLACES", self.places)) if v})
        return env

    def label(self) -> str:
        return (f"t={self.threads} bind={self.bind or '-'} places={self.places or '-'} "
                f"touch={self.touch} calls={self.calls}")


@dataclass
class Job:
    setting: Setting
    groups: list  # [{"kernel", "dtype", "sizes", "impls": [[lang, variant], ...]}]
    warmup: int = 1
    repeats: int = 5
    roof: bool = False
    quick: bool = False
    triad_in_rounds: bool = False  # a triad timed in the groups' rounds (moagen.bench.worker)
    device: str = None  # the target whose device holds the arrays and times the calls
    measurements: int = field(init=False)

    def __post_init__(self):
        # a roof job's records: the host's roofs, and a device's copy bandwidth
        roofs = self.roof * (1 + (self.device is not None))
        self.measurements = sum(len(g["impls"]) for g in self.groups) + roofs


class Results:
    """The JSON-lines file: opened (and its folder made) before anything is measured, so
    that an unwritable path fails at once."""

    def __init__(self, path: Path, command):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        except OSError as error:
            raise MoagenError(f"cannot write results to {self.path}: {error.strerror}") from error
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
        self.machine = machine.describe()
        self.append(dict(record="run", command=command, machine=self.machine))

    def append(self, record: dict):
        self._file.write(json.dumps(dict(record, run=self.run_id)) + "\n")
        self._file.flush()


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, width=30):
        self.total, self.done, self.width, self.start = total, 0, width, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, label: str):
        self.done += 1
        filled = self.width * self.done // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:.0f} s  {label}")
        print(("\r" + line[:120].ljust(120)) if self.tty else line, file=sys.stderr,
              end="" if self.tty else "\n", flush=True)
        if self.tty and self.done == self.total:
            print(file=sys.stderr)


def run(jobs, results: Results):
    """Run every job in its own worker; returns the records appended, in order."""
    from moagen.bench.rates import predict_ahead, with_rates

    progress = Progress(sum(job.measurements for job in jobs))
    records = []
    for job in jobs:
        predict_ahead(job.groups)
        payload = dict(groups=job.groups, warmup=job.warmup, repeats=job.repeats, roof=job.roof,
                       quick=job.quick, touch=job.setting.touch, calls=job.setting.calls,
                       triad_in_rounds=job.triad_in_rounds, device=job.device)
        command = [sys.executable, "-m", "moagen.bench.worker", json.dumps(payload)]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **job.setting.env()}) as worker:
            for line in worker.stdout:
                record = dict(json.loads(line), threads=job.setting.threads,
                              setting=job.setting.__dict__)
                if record["record"] == "result":
                    record = with_rates(record)
                results.append(record)
                records.append(record)
                progress.step(f"{job.setting.label()} {_describe(record)}")
            error = worker.stderr.read()
        if worker.returncode != 0:
            raise MoagenError(f"benchmark worker failed under {job.setting.label()} "
                              f"(measurements so far are in {results.path}):\n{error[-3000:]}")
    return [dict(r, run=results.run_id) for r in records]


def _describe(record):
    if record["record"] == "roof":
        return (f"roof: triad {record['triad_gbs']:.1f} GB/s, GEMM {record['gemm_gflops']:.1f} "
                f"GFLOP/s, multiply-add peak {record['peak_gflops_by_dtype']['float64']:.1f}")
    if record["record"] == "device_roof":
        return f"{record['device']}: copy {record['copy_gbs']:.1f} GB/s"
    what = " ".join(filter(None, (record["kernel"], record["variant"], record["lang"])))
    return f"{what} n={record['sizes']['n']}: {record['median_s'] * 1e3:.2f} ms"
