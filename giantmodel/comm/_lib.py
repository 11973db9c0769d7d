"""Find, build on demand, and load the comm core's C++ library (ctypes).

Search order: ``$GIANTMODEL_COMM_LIB``; a library built into this package
(``python csrc/build_ext.py`` or ``setup.py build_ext``); then a copy compiled
on first use into ``$GIANTMODEL_CACHE`` (default ``~/.cache/giantmodel``) when
the ``csrc/`` sources and a C++ compiler are present. Without any of these,
:func:`load` returns None and the backend delegates to gloo/NCCL, warning once.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ABI_VERSION = 8
_PKG_DIR = Path(__file__).resolve().parent
_CSRC = _PKG_DIR.parent.parent / "csrc"

# Status codes returned by the C functions (see giant_shm.cpp).
OK, TIMEOUT, PEER_DIED, BAD_ARG, ABORTED, UNSUPPORTED = range(6)

_state: dict[str, object] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("GIANTMODEL_CACHE", Path.home() / ".cache" / "giantmodel"))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i64, i32, dbl, cp = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                             ctypes.c_double, ctypes.c_char_p)
    sigs = {
        "gm_abi_version": (i32, []),
        "gm_supports": (i32, [i32, i32]),
        "gm_isa": (cp, []),
        "gm_unlink": (i32, [cp]),
        "gm_open": (vp, [cp, i32, i32, i64, i32, i32, dbl, ctypes.c_char_p, i32]),
        "gm_close": (None, [vp]),
        "gm_abort": (None, [vp]),
        "gm_cancel": (None, [vp]),
        "gm_error": (cp, [vp]),
        "gm_set_timeout": (None, [vp, dbl]),
        "gm_set_spin": (None, [vp, i32, i32]),
        "gm_barrier": (i32, [vp]),
        "gm_allreduce": (i32, [vp, vp, vp, i64, i32, i32, dbl]),
        "gm_reduce_scatter": (i32, [vp, vp, vp, i64, i32, i32, dbl]),
        "gm_allgather": (i32, [vp, vp, vp, i64]),
        "gm_broadcast": (i32, [vp, vp, i64, i32]),
        "gm_alltoall": (i32, [vp, vp, vp, i64]),
        "gm_alltoallv": (i32, [vp, vp, vp, vp, vp, vp, vp]),
        "gm_sched_post": (i32, [vp, i64, i64]),
        "gm_sched_wait": (i64, [vp, i64]),
        "gm_stream": (dbl, [i64, i32, i32, i32]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


def _try_load(path: Path) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
        if lib.gm_abi_version() != ABI_VERSION:
            log.info("ignoring %s: ABI %d, want %d", path, lib.gm_abi_version(), ABI_VERSION)
            return None
        return _declare(lib)
    except (OSError, AttributeError) as exc:
        log.info("cannot load %s: %s", path, exc)
        return None


def _sources_digest() -> str | None:
    files = sorted(_CSRC.glob("giant_shm.cpp")) + sorted(_CSRC.glob("giant_kernels.inc"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _build_ext_module():
    """``csrc/build_ext.py`` as a module, or None in an install without sources."""
    if not (_CSRC / "build_ext.py").is_file():
        return None
    spec = importlib.util.spec_from_file_location("giantmodel_build_ext", _CSRC / "build_ext.py")
    if spec is None or spec.loader is None:
        return None
    build_ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_ext)
    return build_ext


def can_build() -> bool:
    """True where the sources and a C++ compiler are present: there a core
    that fails to build or load is a bug to report, not a reason to skip."""
    build_ext = _build_ext_module()
    return build_ext is not None and _sources_digest() is not None and build_ext.find_cxx() is not None


def skip_reason_for_tests() -> str | None:
    """Why tests of the C++ core should skip here, or None when they must run:
    they skip only where the core can be neither loaded nor built, so a
    failed build fails the suite instead of turning into skips."""
    if load() is not None or can_build():
        return None
    return f"C++ comm core unavailable and not buildable here ({load_error()})"


def load_error() -> str | None:
    """Why :func:`load` found no library (None when it found one or was not called)."""
    return _state.get("error")  # type: ignore[return-value]


def _jit_build() -> Path | None:
    digest = _sources_digest()
    build_ext = _build_ext_module()
    if digest is None or build_ext is None or build_ext.find_cxx() is None:
        return None
    out = cache_dir() / "comm" / f"libgiant_shm-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One rank compiles while the others on this host wait for the file.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            print(f"giantmodel.comm: compiling the shared-memory core into {out}", file=sys.stderr)
            build_ext.compile_library(out)
    return out


def candidates() -> list[Path]:
    env = os.environ.get("GIANTMODEL_COMM_LIB")
    found = [Path(env)] if env else []
    found += sorted(_PKG_DIR.glob("_giant_shm*.so"))
    return found


def load() -> ctypes.CDLL | None:
    """The loaded library, or None (after one warning) when none can be had."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    lib = None
    for path in candidates():
        lib = _try_load(path)
        if lib is not None:
            break
    if lib is None and os.environ.get("GIANTMODEL_COMM_NO_JIT", "0") != "1":
        try:
            path = _jit_build()
            lib = _try_load(path) if path is not None else None
            if path is not None and lib is None:
                _state["error"] = f"built {path} but could not load it (see the info log)"
        except Exception as exc:  # fall back to delegation, loudly
            _state["error"] = str(exc)
            log.warning("giantmodel.comm: could not build the C++ core: %s", exc)
    if lib is None:
        _state.setdefault("error", "no library found and none built (no compiler or sources, "
                                   "or GIANTMODEL_COMM_NO_JIT=1)")
        log.warning("giantmodel.comm: C++ shared-memory core unavailable (build it with "
                    "`python csrc/build_ext.py`); the 'giant' backend delegates every "
                    "collective to gloo/NCCL")
    _state["lib"] = lib
    return lib
