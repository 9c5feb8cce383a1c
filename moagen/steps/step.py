"""The contract of every schedule step.

A step is a named, frozen dataclass: called on an ONF it returns the next ONF, with itself
recorded in the ONF's schedule, or raises ScheduleError when its precondition does not
hold. No step changes the value computed (the tests check each against the untransformed
ONF). Two closing steps are not recorded, ApplyLayout and MarkSimd: every ONF ends with
them (moagen.onf.realize.CLOSING), and the schedule says what a variant chose.

Which nests it works on: a step's `nest` field names the nest it rewrites. A step that
may work on any nest declares `nest: Optional[str] = None`, None meaning every nest it
applies to, at least one. A nest that lacks what the step works on raises NotApplicable:
with nest None that nest is left as it is, and the step fails only where every nest
lacks it; a named nest that lacks it, or a name no nest has, is the step's error. A step
that rewrites each of its nests on its own implements `rewrite_nest` and inherits
__call__; one that adds nests or buffers, or works on several nests together, implements
__call__ and finds each nest it names with `nest_called`.

str(step) is how the schedule prints it (the ONF dump, the banner of every generated
file), derived from the step's fields by Step.__str__ and the field helpers below.

A step that creates loops or nests names them by moagen.onf.names' rule, or as its caller
says, and offers those names as properties, so that later steps (and the kernel modules)
never spell a name another step invented."""
import re
from dataclasses import MISSING, field, fields, replace

from moagen.errors import ScheduleError
from moagen.onf.loops import Nest, ONF
from moagen.onf.names import Names, kernel_names


class NotApplicable(ScheduleError):
    """The nest lacks what the step works on (as opposed to a violated precondition)."""


# ---- how a field is printed ------------------------------------------------------------
# A field without one of these is printed as its value (a tuple as its items, joined).

def shown(template: str, default=MISSING):
    """A field printed by a template that names the step's fields and properties:
    "{rows} x {cols}", "over=({over})"."""
    return field(default=default, metadata={"template": template})


def option(template: str, default):
    """A field printed by its template only where it is not its default."""
    return field(default=default, metadata={"template": template, "optional": True})


def flag(word: str, default=False):
    """A boolean field printed as a word where it is true."""
    return field(default=default, metadata={"flag": word})


def hidden(default=MISSING):
    """A field the printed form leaves out (another field's template shows it)."""
    return field(default=default, metadata={"hidden": True})


def _printed(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, tuple) else str(value)


class _Printed(dict):
    """The step's fields and properties as a template sees them."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def __missing__(self, name):
        return _printed(getattr(self.step, name))


class Step:
    # which layer of a variant the step belongs to: an algebraic rewrite or a choice of what
    # is materialized ("algorithm"), a loop transformation ("schedule"), or where loops run
    # on a target ("mapping")
    layer = "schedule"

    @property
    def printed_name(self) -> str:
        """The class name in snake_case: RegisterTile -> register_tile."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()

    def __str__(self):
        """name(fields, in order): each by its value, template or flag word, left out where
        hidden or an option at its default. The nest of a step that may work on every nest
        comes last, as nest=label, where one is named."""
        args, where = [], []
        for f in fields(self):
            value, how = getattr(self, f.name), f.metadata
            if f.name == "nest" and f.default is None:
                where = [f"nest={value}"] if value is not None else []
            elif "flag" in how:
                args += [how["flag"]] if value else []
            elif how.get("hidden") or (how.get("optional") and value == f.default):
                continue
            elif "template" in how:
                args.append(how["template"].format_map(_Printed(self)))
            else:
                args.append(_printed(value))
        return f"{self.printed_name}({', '.join(args + where)})"

    def __call__(self, onf: ONF) -> ONF:
        """Each nest the step works on rewritten by rewrite_nest (see the module's doc)."""
        chosen = [n for n in onf.nests if self.nest is None or n.label == self.nest]
        if not chosen:
            self.nest_called(onf)  # raises: no nest has that name
        names = kernel_names(onf)
        nests, misses = [], []
        for n in onf.nests:
            try:
                nests.append(replace(n, body=self.rewrite_nest(n, names)) if n in chosen else n)
            except NotApplicable as miss:
                if self.nest is not None:
                    raise
                misses.append(miss)
                nests.append(n)
        if len(misses) == len(chosen):
            raise misses[0]
        return onf.with_nests(nests, str(self))

    def rewrite_nest(self, nest: Nest, names: Names):
        """The nest's new body; `names` holds the kernel's names in use, and takes those
        the step creates."""
        raise NotImplementedError

    def nest_called(self, onf: ONF, label: str = None) -> Nest:
        """The nest called label (by default the step's own); ScheduleError naming the step
        and the nests there are otherwise."""
        label = self.nest if label is None else label
        for n in onf.nests:
            if n.label == label:
                return n
        raise ScheduleError(f"{self}: {onf.name} has no nest {label!r}; it has "
                            f"{', '.join(n.label for n in onf.nests)}")
