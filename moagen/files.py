"""Writing the files a command produces, with an error a user can act on."""
from pathlib import Path

from moagen.errors import MoagenError


def write_text(path: Path, text: str):
    """Write text to path, making its folder; an unwritable path is a MoagenError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as error:
        raise MoagenError(f"cannot write {path}: {error.strerror}") from error
