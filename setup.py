"""Only what pyproject.toml cannot say: the wheel ships ``aiak-auto.pth`` at site-packages' root.

That one line runs at every interpreter start and, only with ``AIAK_AUTO=1``, activates aiak
(``aiak.launch._boot``): the same start-up hook aiakrun puts on PYTHONPATH, for processes that
other launchers start. Editable installs do not get it (see docs/launch.md).
"""

import os
import warnings

from setuptools import setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 69
    from setuptools.warnings import InformationOnly
except ImportError:  # pragma: no cover - older setuptools emits no such notice
    InformationOnly = None

# An editable install of a package-dir layout always gets setuptools' "Editable installation."
# notice, information that setuptools sends as a warning (pypa/packaging-problems#558); pip
# then prints it as a build warning. It says nothing about this project: keep it out.
if InformationOnly is not None:
    warnings.filterwarnings("ignore", "Editable installation", InformationOnly)

PTH = "aiak-auto.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(os.path.join("launch", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
