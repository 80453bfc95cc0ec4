"""One build step beyond pyproject.toml: the exercise notebooks go into the wheel.

They live in ``exercises/`` at the root of the clone, where the book's table of contents and
``make test`` find them; an installed package carries a copy in ``fa_lab/exercises/notebooks``,
from which ``fa-lab exercises fetch DIR`` copies them for the learner.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

NOTEBOOKS = Path("exercises")
PACKAGED = Path("fa_lab", "exercises", "notebooks")


class build_py_with_exercises(build_py):
    def run(self):
        super().run()
        for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
            target = Path(self.build_lib) / PACKAGED / nb.name
            self.mkpath(str(target.parent))
            self.copy_file(str(nb), str(target))

    def get_outputs(self, include_bytecode=True):
        extra = [str(Path(self.build_lib) / PACKAGED / nb.name) for nb in sorted(NOTEBOOKS.glob("*.ipynb"))]
        return super().get_outputs(include_bytecode) + extra


setup(cmdclass={"build_py": build_py_with_exercises})
