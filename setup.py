"""Installs tgi_patch/fastload_tgi.pth into site-packages, for wheels and editable installs.

Everything else lives in pyproject.toml. A `.pth` must sit in site-packages to be read at
interpreter start (that is how FASTLOAD_TGI=1 reaches every TGI shard process);
`data-files` would put it under sys.prefix, where Python never looks.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "fastload_tgi.pth"
SOURCE = os.path.join("tgi_patch", PTH)


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    # setuptools has no public hook for extra files in an editable wheel; this one has been
    # stable since editable wheels appeared (setuptools 64). If it moves, the build fails loudly.
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        files, mapping = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(SOURCE, os.path.join(unpacked_wheel, PTH))
        return files, mapping


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
