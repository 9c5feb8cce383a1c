"""The tuning store: the schedule parameters `moagen tune` chose on a machine, kept in a
tuning file per machine (its host name and CPU) and per kernel variant, language, dtype and
the sizes set when it was tuned. moagen.request reads it; moagen tune writes it."""
import itertools
import json
import platform
import re
import sys
from pathlib import Path

from moagen.errors import MoagenError
from moagen.kernels import get_kernel

DEFAULT_FILE = Path("bench-results/tuning.json")


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    found = re.search(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
    return found.group(1) if found else platform.processor() or "unknown"


def machine_key() -> str:
    """Choices hold for one machine: its host name and CPU."""
    return f"{platform.node()} / {cpu_model()}"


def choice_key(kernel, variant, lang, dtype, sizes=None):
    """A choice's key: the variant, language and dtype, and the sizes set with --size when
    it was tuned (heads=8, d=128: a tile good at d 64 need not be at d 128)."""
    shape = ",".join(f"{k}={v}" for k, v in sorted((sizes or {}).items()))
    return f"{kernel}:{variant}:{lang}:{dtype}" + (f"@{shape}" if shape else "")


def kernel_sizes(kernel: str, sizes) -> dict:
    """The sizes set of those this kernel has (--size heads=8 means nothing to RMSNorm)."""
    return {k: v for k, v in (sizes or {}).items() if k in get_kernel(kernel).bench.sizes(1)}


def load_choices(path=DEFAULT_FILE) -> dict:
    """This machine's choices in a tuning file ({} when there is none)."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        machines = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise MoagenError(f"cannot read the tuning file {path}: {error}") from error
    return machines.get(machine_key(), {})


def chosen(choices: dict, kernel, variant, lang, dtype, sizes=None):
    """The parameters tuned for this kernel variant at the sizes set with --size, or at as
    many of them as a choice was tuned for (d=128, heads=8; else heads=8 or d=128; else
    none), or None (the defaults). A choice made for other parameters than the variant has
    now (its schedule changed since) is stale: it is left out, with a warning."""
    given = sorted(kernel_sizes(kernel, sizes).items())
    subsets = (dict(s) for k in range(len(given), -1, -1)
               for s in itertools.combinations(given, k))
    record = next((choices[key] for key in (choice_key(kernel, variant, lang, dtype, s)
                                            for s in subsets) if key in choices), None)
    if not record:
        return None
    if set(record["params"]) != set(get_kernel(kernel).variant(variant).defaults_for("cpu", dtype)):
        print(f"moagen: the tuned parameters of {kernel} {variant} {lang} {dtype} "
              f"({format_params(record['params'])}) are not the variant's parameters now: "
              "running its defaults; run `moagen tune` again", file=sys.stderr)
        return None
    return record["params"]


def save(records, path=DEFAULT_FILE):
    """Add the records to this machine's choices (other machines' are kept)."""
    path = Path(path)
    machines = json.loads(path.read_text()) if path.exists() else {}
    mine = machines.setdefault(machine_key(), {})
    for r in records:
        mine[choice_key(r["kernel"], r["variant"], r["lang"], r["dtype"], r.get("overrides"))] = r
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(machines, indent=1, sort_keys=True) + "\n")


def format_params(params) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())
