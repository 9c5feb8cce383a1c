"""The skeletons live in templates/ at the top of the checkout, outside the package; the wheel
must carry them (setup.py copies them into moagen/_templates). Built, installed into a fresh
venv and run from outside the checkout, the wheel emits a kernel in C, Fortran and CUDA the
same as generated/ holds it."""
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = sorted(p.relative_to(ROOT / "templates").as_posix()
                   for p in (ROOT / "templates").rglob("*") if p.is_file())
# what the wheel is built from; the rest of the checkout (generated/, tests/) it does not ship
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in", "moagen",
           "templates")
KERNEL = "rmsnorm_fwd"
VARIANT = "dnf"
EXTENSIONS = {"c": "c", "fortran": "f90", "cuda": "cu"}


def run(*command, cwd):
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # a copy of the sources: setuptools' build/lib would otherwise be the checkout's build/
    # (the kernels' cache), and a file left there by an earlier build would ship too
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--quiet", "-w", str(out),
        cwd=out)
    (built,) = out.glob("moagen-*.whl")
    return built


def test_the_top_level_holds_the_templates_and_the_package_none():
    assert {"c/kernel.c.j2", "fortran/module.f90.j2", "cuda/kernel.cu.j2",
            "cuda/emulation/cuda_runtime.h", "bench/stream.c"} <= set(TEMPLATES)
    assert not [p for p in (ROOT / "moagen").rglob("*") if p.suffix == ".j2"]


def test_the_wheel_carries_every_template(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"moagen/_templates/{t}" for t in TEMPLATES} <= names


def test_the_installed_wheel_emits_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet",
        str(wheel), cwd=tmp_path)
    # the pinned dependencies, already installed here, shared rather than downloaded again: a
    # .pth line adds this environment's site-packages after the new venv's own (its .pth files,
    # the editable install's among them, are not read, so the checkout stays off sys.path)
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                    cwd=tmp_path).strip())
    (site / "shared-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")

    where = run(python, "-c", "import moagen.templates as t; print(t.__file__); print(t.ROOT)",
                cwd=tmp_path).split()
    assert all(Path(p).is_relative_to(site / "moagen") for p in where), where
    for lang, extension in EXTENSIONS.items():
        text = run(venv / "bin" / "moagen", "emit", KERNEL, "--variant", VARIANT, "--lang", lang,
                   cwd=tmp_path)
        assert text == (ROOT / "generated" / f"{KERNEL}_{VARIANT}.{extension}").read_text(), lang
