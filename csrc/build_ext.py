"""Build the comm core's C++ library: from setup.py, by hand, or on first use.

The library has a plain C ABI and is loaded with ctypes, so building it needs
a C++ compiler and nothing else: no torch, no pybind11, no GPU. That keeps
``pip install`` from pulling a torch wheel into an isolated build env.

- ``setup.py`` calls :func:`get_extensions` and :func:`get_cmdclass`. With no
  compiler the list is empty and the install still succeeds; giantmodel then
  delegates to gloo and says so once.
- ``python csrc/build_ext.py`` builds the library in place, into
  ``giantmodel/comm/``, for development.
- ``giantmodel.comm._lib`` calls :func:`compile_library` into a cache dir when
  no built library is found but a compiler is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent
SOURCES = ("giant_shm.cpp",)
DEPENDS = ("giant_kernels.inc",)
LIB_BASENAME = "_giant_shm"
CXX_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-Wall"]
LINK_LIBS = ["rt", "pthread"]


def find_cxx() -> str | None:
    """Path of a usable C++ compiler ($CXX first), or None."""
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    return None


def source_paths() -> list[Path]:
    return [CSRC / s for s in SOURCES]


def compile_library(out_path: str | os.PathLike, cxx: str | None = None,
                    verbose: bool = False, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the shared library to ``out_path`` atomically; returns the path.

    ``extra_flags`` go to the compiler after the defaults (tests build
    variants such as ``-DGIANT_HAVE_FLOAT16=0``). Raises RuntimeError with the
    compiler output when compilation fails.
    """
    cxx = cxx or find_cxx()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [*cxx.split(), *CXX_FLAGS, *extra_flags, "-shared", "-o", str(tmp),
           *map(str, source_paths()), *(f"-l{lib}" for lib in LINK_LIBS)]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building the comm library failed:\n{' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, out)  # ranks compiling at once never load a half-written file
    return out


def get_extensions() -> list:
    """setuptools Extensions for setup.py; [] when no C++ compiler exists."""
    if find_cxx() is None:
        print("giantmodel: no C++ compiler found; the comm core will delegate to gloo/NCCL",
              file=sys.stderr)
        return []
    from setuptools import Extension

    root = CSRC.parent
    return [Extension(
        f"giantmodel.comm.{LIB_BASENAME}",
        sources=[str((CSRC / s).relative_to(root)) for s in SOURCES],
        depends=[str((CSRC / s).relative_to(root)) for s in DEPENDS],
        extra_compile_args=[f for f in CXX_FLAGS if f != "-fPIC"],
        libraries=LINK_LIBS,
        language="c++",
    )]


def get_cmdclass() -> dict:
    """A build_ext that warns instead of failing the install on a compile error."""
    from setuptools.command.build_ext import build_ext

    class OptionalBuildExt(build_ext):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - any compiler failure
                print(f"giantmodel: building {ext.name} failed ({exc}); the comm core "
                      "will delegate to gloo/NCCL", file=sys.stderr)

        def get_export_symbols(self, ext):
            return []  # a ctypes library, not a Python module: no PyInit_ symbol

    return {"build_ext": OptionalBuildExt}


def main() -> int:
    out = CSRC.parent / "giantmodel" / "comm" / f"{LIB_BASENAME}.so"
    path = compile_library(out, verbose=True)
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
