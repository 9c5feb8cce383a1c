"""The command line: the stage dumps (golden files), emit, generate --check, and the errors
a user meets."""
import os
import re
import shutil
from pathlib import Path

import pytest

from moagen import kernels
from moagen.targets.cuda import loader as cuda
from moagen.cli import main
from moagen.commands.common import GENERATED
from moagen.emit import filename
from moagen.kernels import KERNELS
from moagen.targets import LANGS, get_target

GOLDEN = Path(__file__).parent / "golden"
DUMPS = ([(k.name, None, "shape") for k in KERNELS.values()]
         + [(k.name, v, stage) for k in KERNELS.values() for v in k.variants_on("cpu")
            for stage in ("dnf", "onf")])


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kernel,variant,stage", DUMPS)
def test_stage_dumps_match_golden(capsys, kernel, variant, stage):
    """Set MOAGEN_UPDATE_GOLDEN=1 to rewrite the files after a deliberate change."""
    argv = ["show", "--stage", stage, kernel] + (["--variant", variant] if variant else [])
    code, out, _ = run(capsys, *argv)
    assert code == 0
    golden = GOLDEN / f"{kernel}{'_' + variant if variant else ''}_{stage}.txt"
    if os.environ.get("MOAGEN_UPDATE_GOLDEN"):
        golden.write_text(out)
    assert out == golden.read_text()


def test_dnf_of_attention_applies_psi_only_to_q_k_v(capsys):
    code, out, _ = run(capsys, "show", "--stage", "dnf", "attention_fwd", "--variant", "dnf")
    assert code == 0
    body = out.split("output O", 1)[1]
    operands = re.findall(r"> psi (\w+)\)", body)
    assert operands and set(operands) == {"Q", "K", "V"}
    assert "temporary" not in out


def test_shape_dump_names_every_node_path(capsys):
    code, out, _ = run(capsys, "show", "--stage", "shape", "attention_fwd")
    assert code == 0
    assert re.search(r"Named scores\s+\(n, n\)\s+attention_fwd\.O\.body\.left\.value\.array", out)


def test_emit_writes_a_file(capsys, tmp_path):
    target = tmp_path / "k.f90"
    code, _, _ = run(capsys, "emit", "--lang", "fortran", "rmsnorm_fwd", "--variant", "dnf",
                     "--dtype", "float32", "-o", str(target))
    assert code == 0
    text = target.read_text()
    assert "module moagen_kernels" in text and "rmsnorm_fwd_dnf_f32" in text
    assert "_f64" not in text


def test_generate_check_reports_drift(capsys, tmp_path, monkeypatch):
    """On a copy of attention_fwd's sources in generated/, the generator knowing that kernel
    only (test_codegen checks every source in generated/ is what the generator emits; all
    of them take a third of a minute to emit)."""
    one = {"attention_fwd": KERNELS["attention_fwd"]}
    monkeypatch.setattr(kernels, "KERNELS", one)
    for lang in LANGS:
        for variant in one["attention_fwd"].variants_on(get_target(lang).kind):
            shutil.copy(GENERATED / filename("attention_fwd", variant, lang), tmp_path)
    (tmp_path / "attention_fwd_dnf.c").write_text("/* edited by hand */\n")
    (tmp_path / "stale_kernel.c").write_text("")
    code, out, err = run(capsys, "generate", "--check", "--out", str(tmp_path))
    assert code == 1  # the edited file and the extra one, and no other
    assert out.splitlines() == [f"differs from the generator: {tmp_path / 'attention_fwd_dnf.c'}",
                                f"not emitted by the generator: {tmp_path / 'stale_kernel.c'}"]
    assert "make generated" in err


def test_generate_removes_the_sources_it_no_longer_emits(capsys, tmp_path, monkeypatch):
    """A source the generator wrote for a kernel it no longer has goes; a file it did not
    write stays, whatever its name."""
    one = {"rmsnorm_fwd": KERNELS["rmsnorm_fwd"]}
    monkeypatch.setattr(kernels, "KERNELS", one)
    gone = tmp_path / "attention_fwd_dnf.c"
    shutil.copy(GENERATED / gone.name, gone)
    kept = tmp_path / "notes.c"
    kept.write_text("/* by hand */\n")
    code, out, _ = run(capsys, "generate", "--out", str(tmp_path))
    assert code == 0 and not gone.exists() and kept.exists()
    assert f"removed {gone}: no kernel, variant and language emits it now" in out.splitlines()
    emitted = {filename("rmsnorm_fwd", v, lang) for lang in LANGS
               for v in one["rmsnorm_fwd"].variants_on(get_target(lang).kind)}
    assert {p.name for p in tmp_path.iterdir()} == emitted | {kept.name}


@pytest.mark.parametrize("argv,message", [
    (["show", "flash_attention"], "unknown kernel 'flash_attention'; known kernels: attention_fwd"),
    (["show", "attention_fwd", "--variant", "flashy"],
     "has no variant 'flashy'; its variants: naive, dnf, online, flash"),
    (["verify", "nonsense"], "unknown kernel 'nonsense'"),
])
def test_errors_are_clear(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("moagen: error: ") and message in err


@pytest.mark.skipif(cuda.available(), reason="a GPU is here: CUDA verification runs")
def test_cuda_verification_without_a_gpu_is_a_clear_error(capsys):
    code, _, err = run(capsys, "verify", "--lang", "cuda", "rmsnorm_fwd")
    assert code == 2 and err.startswith("moagen: error: ")
    assert "CUDA kernels need cuda-python" in err or "no usable CUDA device" in err


def test_unknown_language_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["emit", "--lang", "rust", "attention_fwd"])
    assert exit_.value.code == 2
    assert "invalid choice: 'rust'" in capsys.readouterr().err


def test_unwritable_output_is_a_clear_error(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(capsys, "emit", "attention_fwd", "-o", str(blocker / "k.c"))
    assert code == 2 and "cannot write" in err
