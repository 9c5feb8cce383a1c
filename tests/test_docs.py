"""The docs say what is true of the tree.

- Every `make` target that README.md or docs/ names has a rule in the Makefile (a merge once
  dropped five rules the README still offered; being listed in .PHONY alone, make runs them
  as doing nothing, silently).
- Every `moagen/...` path docs/ARCHITECTURE.md names in backquotes exists, so the page a
  newcomer reads first names the files they will open (a `<name>` in a path stands for any
  one name: `moagen/targets/<language>/`).
- The README and docs/PERFORMANCE.md stay short enough to be read: the dated studies go to
  docs/journal/, one file each, listed in its index.
- A comment in moagen/ that points into docs/PERFORMANCE.md names one of its headings
  (`docs/PERFORMANCE.md, "Build flags"`): the measurements live there, the code says why.
- CI runs the README's test command after the same system-packages script the README
  names."""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# `make x y` in a code span, or a code block's line that starts with it
MAKE = re.compile(r"(?:`|^)make ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)", re.MULTILINE)
# a rule: targets, a colon, not ":=" (an assignment)
RULE = re.compile(r"^([^\s#.=:][^=:]*):(?!=)", re.MULTILINE)
# a package path in a code span: `moagen/...` up to the closing backquote
PACKAGE_PATH = re.compile(r"`(moagen/[^`\s]*)`")
LIMITS = {"README.md": 300, "docs/PERFORMANCE.md": 400}
JOURNAL = ROOT / "docs" / "journal"
TEST_COMMAND = "make test"


def documented_targets():
    targets = set()
    for doc in DOCS:
        for words in MAKE.findall(doc.read_text()):
            targets.update(words.split())
    return sorted(targets)


def makefile_rules():
    return {target for line in RULE.findall((ROOT / "Makefile").read_text())
            for target in line.split()}


def architecture_paths():
    return sorted(set(PACKAGE_PATH.findall((ROOT / "docs" / "ARCHITECTURE.md").read_text())))


def exists(path: str) -> bool:
    """Whether the path (a folder when it ends in /) is in the tree; `<name>` is any name."""
    folder = path.endswith("/")
    pattern = re.sub(r"<[^>/]*>", "*", path.rstrip("/"))
    return any(p.is_dir() if folder else p.is_file() for p in ROOT.glob(pattern))


def test_the_docs_and_the_makefile_are_read():
    assert {"all", "test", "verify", "system-packages"} <= set(documented_targets())
    assert {"all", "test", "verify", "system-packages"} <= makefile_rules()
    assert ".PHONY" not in makefile_rules()


@pytest.mark.parametrize("target", documented_targets())
def test_a_documented_make_target_has_a_rule(target):
    assert target in makefile_rules(), f"the docs name `make {target}`; the Makefile has no rule"


def test_the_architecture_names_paths():
    paths = architecture_paths()
    assert {"moagen/request.py", "moagen/targets/__init__.py", "moagen/kernels/__init__.py"} <= set(paths)
    assert exists("moagen/") and exists("moagen/cli.py") and not exists("moagen/no_such_module.py")


@pytest.mark.parametrize("path", architecture_paths())
def test_a_path_the_architecture_names_exists(path):
    assert exists(path), f"docs/ARCHITECTURE.md names `{path}`; the tree has no such {'folder' if path.endswith('/') else 'file'}"


@pytest.mark.parametrize("doc", sorted(LIMITS))
def test_a_doc_stays_short(doc):
    lines = len((ROOT / doc).read_text().splitlines())
    assert lines < LIMITS[doc], (f"{doc} has {lines} lines (under {LIMITS[doc]}): dated studies "
                                 "go to docs/journal/, one file each")


def test_the_journal_index_lists_every_study():
    index = (JOURNAL / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)]+\.md)\)", index))
    studies = {p.name for p in JOURNAL.glob("*.md") if p.name != "README.md"}
    assert studies, "docs/journal/ holds no study"
    assert studies - linked == set(), "studies the index does not list"
    assert linked - studies == set(), "the index links files that do not exist"
    assert all(re.match(r"\d{4}-\d\d-\d\d-[a-z0-9-]+\.md$", name) for name in studies)


def test_the_docs_links_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links {target}"


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert f"\n{TEST_COMMAND} " in readme or f"\n{TEST_COMMAND}\n" in readme, "the README's test command"
    assert ci[-1] == TEST_COMMAND, "CI's last step is the README's test command"
    script = ROOT / "tools" / "system-packages.sh"
    assert any("tools/system-packages.sh" in line for line in ci[:-1]), \
        "CI installs through the same script, before the tests"
    assert os.access(script, os.X_OK)
    assert "tools/system-packages.sh" in (ROOT / "Makefile").read_text()


# docs/PERFORMANCE.md, "A heading" (the comment's lines joined, so a name may be wrapped)
POINTER = re.compile(r'docs/PERFORMANCE\.md,? \(?"([^"]+)"')


def performance_pointers():
    pointers = []
    for source in sorted((ROOT / "moagen").rglob("*.py")):
        lines = (line.strip().lstrip("#").strip() for line in source.read_text().splitlines())
        for heading in POINTER.findall(" ".join(lines)):
            pointers.append((str(source.relative_to(ROOT)), heading))
    return pointers


def test_code_points_into_the_performance_notes_by_heading():
    headings = {line[3:].strip() for line in (ROOT / "docs" / "PERFORMANCE.md").read_text().splitlines()
                if line.startswith("## ")}
    assert performance_pointers(), "no comment points into docs/PERFORMANCE.md"
    wrong = [f"{source}: {heading!r}" for source, heading in performance_pointers()
             if heading not in headings]
    assert not wrong, "comments point at headings docs/PERFORMANCE.md does not have: " + "; ".join(wrong)
