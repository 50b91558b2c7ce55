"""Builds the native module with the project's CMake (the worker library is
C++), then packages it: `pip install --no-build-isolation ./python` from a
checkout. See docs/python.md."""

import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent.parent


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build = pathlib.Path(self.build_temp).resolve() / "cmake"
        subprocess.check_call([
            "cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            "-DLAYERCAST_BUILD_TESTS=OFF", "-DLAYERCAST_BUILD_BENCH=OFF",
            "-DLAYERCAST_WITH_CUDA=OFF", f"-DPython3_EXECUTABLE={sys.executable}"])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build), "--target", "layercast_python",
                               "-j", jobs])
        built = next((build / "python" / "layercast").glob("_layercast*.so"))
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)


setup(ext_modules=[Extension("layercast._layercast", sources=[])],
      cmdclass={"build_ext": CMakeBuild})
