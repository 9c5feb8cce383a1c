"""The Jinja2 file skeletons, kept apart from the code in templates/ at the top of the
repository, one folder per user (c/, fortran/, cuda/, bench/): a skeleton is a file a person
reads and edits, the printers only fill it. A template's name starts with its folder, so
"c/kernel.c.j2" is templates/c/kernel.c.j2 and the folder is named once, where it is
rendered.

A checkout (an editable install) reads templates/ itself; a wheel carries a copy inside the
package, moagen/_templates (setup.py copies it in at build time)."""
from pathlib import Path

import jinja2

_PACKAGE = Path(__file__).resolve().parent
# the wheel's copy, else the checkout's folder: resolved once, the same for every caller
ROOT = _PACKAGE / "_templates"
if not ROOT.is_dir():
    ROOT = _PACKAGE.parent / "templates"
_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(ROOT)), undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def render(template: str, **context) -> str:
    return _env.get_template(template).render(**context)
