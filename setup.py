"""Builds cadence's CPU kernels (kernels/cpu/, a C++ mlx extension) at install.

Everything else about the package is in pyproject.toml. The build is optional: with no
C++ compiler or CMake, or CADENCE_BUILD_KERNELS=0, the install still succeeds and the
runtime says in one log line that it uses mlx's own ops instead (kernels/cpu_extension.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path) -> None:
        super().__init__(name, sources=[])
        self.source_dir = source_dir


class OptionalCMakeBuild(build_ext):
    """Runs CMake for each extension; a failure is reported, never raised."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        if os.environ.get("CADENCE_BUILD_KERNELS", "1") == "0":
            self._skip(ext, "CADENCE_BUILD_KERNELS=0")
            return
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            _cmake(),
            "-S", str(ext.source_dir),
            "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={target.parent}",
        ]
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        build = [_cmake(), "--build", str(build_dir), "-j", jobs]
        try:
            for command in (configure, build):
                subprocess.run(command, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            self._skip(ext, detail.strip().splitlines()[-1] if detail.strip() else repr(exc))

    def copy_extensions_to_source(self) -> None:
        # An editable install copies what was built; a skipped extension has nothing to copy.
        build_py = self.get_finalized_command("build_py")
        built = [
            e for e in self.extensions
            if Path(self._get_inplace_equivalent(build_py, e)[1]).exists()
        ]
        self.extensions, everything = built, self.extensions
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = everything

    def get_outputs(self) -> list[str]:
        return [path for path in super().get_outputs() if Path(path).exists()]

    @staticmethod
    def _skip(ext: Extension, why: str) -> None:
        print(f"cadence: not building {ext.name} ({why}); mlx's own ops will be used", file=sys.stderr)


def _cmake() -> str:
    try:  # PyPI's cmake, a build requirement, when the build has it
        import cmake

        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        return "cmake"


setup(
    ext_modules=[CMakeExtension("kernels._cpu_ext", HERE / "kernels" / "cpu")],
    cmdclass={"build_ext": OptionalCMakeBuild},
)
