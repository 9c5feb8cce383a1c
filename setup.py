"""The wheel carries the top-level templates/ inside the package, as moagen/_templates, where
moagen/templates.py looks first; everything else is declared in setup.cfg."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithTemplates(build_py):
    def run(self):
        super().run()
        # an editable install reads the checkout's templates/ itself, so nothing to copy
        if not self.editable_mode:
            self.copy_tree("templates", str(Path(self.build_lib, "moagen", "_templates")))


setup(cmdclass={"build_py": BuildWithTemplates})
