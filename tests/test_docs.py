"""The docs' commands exist: every `make` target that README.md or docs/ names has a rule in
the Makefile (a merge once dropped five rules the README still offered; being listed in
.PHONY alone, make runs them as doing nothing, silently)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# `make x y` in a code span, or a code block's line that starts with it
MAKE = re.compile(r"(?:`|^)make ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)", re.MULTILINE)
# a rule: targets, a colon, not ":=" (an assignment)
RULE = re.compile(r"^([^\s#.=:][^=:]*):(?!=)", re.MULTILINE)


def documented_targets():
    targets = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for words in MAKE.findall(doc.read_text()):
            targets.update(words.split())
    return sorted(targets)


def makefile_rules():
    return {target for line in RULE.findall((ROOT / "Makefile").read_text())
            for target in line.split()}


def test_the_docs_and_the_makefile_are_read():
    assert {"all", "test", "verify"} <= set(documented_targets())
    assert {"all", "test", "verify"} <= makefile_rules()
    assert ".PHONY" not in makefile_rules()


@pytest.mark.parametrize("target", documented_targets())
def test_a_documented_make_target_has_a_rule(target):
    assert target in makefile_rules(), f"the docs name `make {target}`; the Makefile has no rule"
