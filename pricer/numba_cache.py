"""Where pricer's numba kernels are cached, with numba's configuration left as it is for everyone.

numba re-checks a cached kernel only against its own file, not against the kernels it calls in
other modules (the cpu engine and the GPU tail build on kernels.py's) or the constants it reads
from pricer.model: after an edit of one of those alone the cached kernels would still run the old
code. So pricer's kernels are cached in one folder per hash of the package's kernel sources
(pricer/engines, pricer/model, pricer/io), under $NUMBA_CACHE_DIR if set, else pricer's cache
folder (pricer.files.cache_dir: $XDG_CACHE_HOME/pricer/numba or ~/.cache/pricer/numba).

The folder is chosen by a cache locator of pricer's own, first in numba's list of locators, which
answers only for functions defined in pricer's files; numba.config (CACHE_DIR among it) is not
touched, so a program's own numba kernels are cached where numba would cache them without pricer.
Every module of pricer's that defines a cached kernel imports this one before its first decorator
(tests/test_architecture.py holds them to it).
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

from numba.core import caching

from pricer.files import cache_dir

PACKAGE = Path(__file__).resolve().parent
SOURCES = ("engines", "model", "io")       # the folders whose kernels call each other's code

# numba names these without the underscore from 0.60 on
_Locator = getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator
_Impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl


@functools.lru_cache(maxsize=1)
def _key() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for name in SOURCES for p in PACKAGE.joinpath(name).rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return f"kernels-{digest.hexdigest()[:16]}"


def folder() -> str:
    """The folder of this pricer's cached kernels: one per hash of its kernel sources."""
    base = os.environ.get("NUMBA_CACHE_DIR") or str(cache_dir("numba"))
    return os.path.join(base, _key())


def _fallback() -> str:
    """Where the kernels go when folder() cannot be written (no home folder, a read-only one):
    the temporary folder, keyed alike (numba's own fallback, beside the sources, is not keyed)."""
    return os.path.join(tempfile.gettempdir(), f"pricer-numba-{os.getuid()}", _key())


class PricerCacheLocator(_Locator):
    """numba's user-provided-folder locator, pointed at folder(), for pricer's own functions."""

    def __init__(self, py_func, py_file, base: str):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(base, self.get_suitable_cache_subpath(py_file))

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            if not Path(py_file).resolve().is_relative_to(PACKAGE):
                return None          # not pricer's: numba's own locators decide
        except (OSError, ValueError):
            return None
        for base in (folder(), _fallback()):
            self = cls(py_func, py_file, base)
            try:
                self.ensure_cache_path()
                return self
            except OSError:          # an unwritable folder: the next one
                continue
        return None


if PricerCacheLocator not in _Impl._locator_classes:
    _Impl._locator_classes.insert(0, PricerCacheLocator)


def _numba_without_scipy_at_start() -> None:
    """numba's NumPy implementations, loaded at its first compile or cache load, import
    scipy.linalg when scipy is installed (~0.5 s of an engine's start, holding the GIL beside the
    read of the input) only to learn whether np.convolve and np.correlate may call BLAS; no engine
    calls either. So they are loaded here with that import refused, and numba's answer then set
    to what it would have found (scipy is installed; numba imports its BLAS where a function needs
    it). The result is the same numba, without the import."""
    import importlib.util
    import sys

    blas = "scipy.linalg.cython_blas"
    if "numba.np.arraymath" in sys.modules or blas in sys.modules \
            or importlib.util.find_spec("scipy") is None:
        return
    sys.modules[blas] = None         # an import of it raises ImportError, importing nothing
    try:
        import numba.np.arraymath as arraymath
    finally:
        if sys.modules.get(blas, False) is None:
            del sys.modules[blas]
    if hasattr(arraymath, "_HAVE_BLAS"):
        arraymath._HAVE_BLAS = True


_numba_without_scipy_at_start()    # before any of pricer's kernels is compiled or loaded
