"""The Jinja2 file skeletons: each package keeps its own in a templates/ folder (a target's
kernel file, the bench's job scripts), named here by the package: "c/kernel.c.j2" is
moagen/targets/c/templates/kernel.c.j2."""
from pathlib import Path

import jinja2

PACKAGE = Path(__file__).resolve().parent
FOLDERS = {folder.parent.name: folder for folder in sorted(PACKAGE.glob("**/templates"))
           if folder.is_dir()}
_env = jinja2.Environment(
    loader=jinja2.PrefixLoader({name: jinja2.FileSystemLoader(str(folder))
                                for name, folder in FOLDERS.items()}),
    undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
    lstrip_blocks=True)


def render(template: str, **context) -> str:
    return _env.get_template(template).render(**context)
