"""Packaging hooks; all metadata lives in pyproject.toml.

A plain build makes the pure-Python wheel (kernels JIT-compiled at run time by ``cula[jit]``). With
``CULA_WHEEL_KERNELS=<scope>`` (``wheel``, ``full`` or ``smoke``, see ``cula.variants``) the wheel also carries every
variant of that scope compiled ahead of time (``cula/_prebuilt``: shared objects and their manifest) and is tagged
for manylinux x86_64: from ``CULA_WHEEL_PREBUILT_DIR`` as it is when given with a manifest (a finished build, as
``scripts/build_wheel.sh`` hands it over right after compiling), else from ``build/prebuilt-<scope>`` brought up to
date by ``scripts/build_wheel.py compile`` with ``CULA_WHEEL_PYTHON`` (a Python with torch and nvidia-cutlass-dsl;
default: this one), which compiles only what this checkout's sources and tools have not built yet.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
SCOPE = os.environ.get("CULA_WHEEL_KERNELS")
PLATFORM = os.environ.get("CULA_WHEEL_PLATFORM", "manylinux_2_28_x86_64")


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if not SCOPE:
            return
        given = os.environ.get("CULA_WHEEL_PREBUILT_DIR")
        prebuilt = Path(given or HERE / "build" / f"prebuilt-{SCOPE}")
        if not (given and (prebuilt / "manifest.json").is_file()):
            python = os.environ.get("CULA_WHEEL_PYTHON", sys.executable)
            subprocess.run(
                [python, str(HERE / "scripts" / "build_wheel.py"), "compile", "--scope", SCOPE, "--out",
                 str(prebuilt)],
                check=True, env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"),
            )  # fmt: skip
        target = Path(self.build_lib) / "cula" / "_prebuilt"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for item in prebuilt.iterdir():  # the libraries and the manifest; not the objects they were linked from
            if item.is_file() and (item.suffix == ".so" or item.name == "manifest.json"):
                shutil.copy2(item, target / item.name)


class WithBinaries(Distribution):
    """Binaries inside: a platform wheel, its files at the root (platlib), not under .data/purelib."""

    def has_ext_modules(self):
        return bool(SCOPE)


class WheelForPlatform(bdist_wheel):
    def get_tag(self):
        if not SCOPE:
            return super().get_tag()
        # the binaries call no CPython API (TVM-FFI's C ABI only): one wheel serves every Python 3
        return "py3", "none", PLATFORM


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": WheelForPlatform}, distclass=WithBinaries)
