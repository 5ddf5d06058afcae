"""How the CPU kernels are compiled and cached: ``parallel_kernel`` for every kernel with a
``prange`` (only the ``prange`` loops run parallel; array expressions stay serial), and a disk
cache locator that stamps each kernel of this package with a digest of all its numba sources.

Invariants: importing this module registers the locator before any kernel is defined (every
kernel module imports it first), so an edit to any numba source of the package recompiles every
kernel once and a cached kernel never runs stale inlined helpers. Keep ``inline="always"``
helpers that take arrays and loop out of the arms of hot loops (numba then refcounts the array
on every iteration; ``PERFORMANCE.md`` has the measurements).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import stat
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numba as nb
from numba.core import caching
from numba.core.cpu_options import ParallelOptions
from numba.core.dispatcher import Dispatcher

# An options object, not the dict it is made of: numba pops the keys out of a dict when it
# compiles, so a kernel's second signature would be compiled with every transformation on.
PRANGE_ONLY = ParallelOptions({"prange": True, "numpy": False, "setitem": False, "reduction": False, "stencil": False,
                               "inplace_binop": False, "comprehension": False, "fusion": False})


@contextlib.contextmanager
def serial_kernels() -> Iterator[None]:
    """Run the parallel kernels this thread calls inside the block on this thread alone.

    For kernel work that overlaps other busy threads on the same cores (the publisher
    finishes a version's streams while the trainer's next step runs): a parallel region ends
    at a barrier, and one of its threads parked behind the other work holds up the whole
    region, every region. numba's thread count is per calling thread, so other threads'
    kernels keep theirs."""
    before = nb.get_num_threads()
    nb.set_num_threads(1)
    try:
        yield
    finally:
        nb.set_num_threads(before)


def kernel_signatures() -> frozenset[tuple[str, str]]:
    """Every (kernel, argument types) this process has compiled or loaded from the disk cache
    so far, over the numba functions of this package: what a warm-up (``weftboard.cuda.warmup``)
    is measured by. A kernel called with other argument types (a read-only buffer where it had
    a writable one, an int64 where it had a uint64) gets another entry, and another compile."""

    found = set()
    prefix = __name__.rsplit(".", 1)[0] + "."
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(prefix):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, Dispatcher) and value.__module__ == module_name:
                found.update((f"{module_name}.{attr}", str(sig)) for sig in value.signatures)
    return frozenset(found)


def _cache_probe() -> int:
    """Never compiled or called: ``kernel_cache_dir`` reads where numba would cache it."""
    return 0


def kernel_cache_dir() -> str:
    """Where the kernels' machine code is cached on disk (numba's choice: ``NUMBA_CACHE_DIR``,
    else the ``__pycache__`` beside this package where it is writable, else the user's cache)."""
    cache = getattr(nb.njit(cache=True)(_cache_probe), "_cache", None)  # numba's own attributes, not an API
    return str(getattr(cache, "_cache_path", "") or "numba's default location")


def parallel_kernel(fn: Callable[..., Any], *, cache: bool = True) -> Any:
    """``nb.njit`` with only the ``prange`` loops parallel; cached on disk, GIL released."""
    return nb.njit(parallel=PRANGE_ONLY, cache=cache, nogil=True)(fn)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def kernel_sources_digest() -> str:
    """sha256 over every module of this package that uses numba (name and content hash of
    each, in name order): the part of a kernel's cache stamp its own file does not cover.
    Raw bytes, so a comment's edit recompiles every kernel too: normalising the sources
    (their syntax trees without docstrings) took 0.1-0.2 s of every process's import."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(_PACKAGE_DIR)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(_PACKAGE_DIR, name), "rb") as f:
            data = f.read()
        if b"numba" in data:
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


class PackageStampedLocator(caching._CacheLocator):
    """numba's own locator for a function of this package (wherever numba would cache it:
    ``NUMBA_CACHE_DIR``, the ``__pycache__`` beside the file, the user's cache), with
    ``kernel_sources_digest`` added to its source stamp; no locator for other functions."""

    fallbacks: list[type] = []  # numba's locators, in numba's order (set at registration)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def ensure_cache_path(self) -> None:
        self._inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return self._inner.get_cache_path()

    def get_source_stamp(self) -> Any:
        return (self._inner.get_source_stamp(), kernel_sources_digest())

    def get_disambiguator(self) -> str:
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> PackageStampedLocator | None:
        if os.path.dirname(os.path.abspath(py_file)) != _PACKAGE_DIR:
            return None
        for fallback in cls.fallbacks:
            inner = fallback.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner)
        inner = PrivateTempLocator.from_function(py_func, py_file)
        return None if inner is None else cls(inner)


class PrivateTempLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """The last resort: a directory of this user's own under the temporary directory, used
    when none of numba's places is writable (an installed package's ``__pycache__`` and a home
    that a sandbox such as systemd's ``ProtectSystem=strict``/``ProtectHome=true`` or a
    read-only container keeps read-only). Without it numba refuses to define a cached kernel
    at all ("cannot cache function ...: no locator available"), and the codec does not
    import. The directory must be owned by this user and closed to others, since what is
    cached there is machine code that is loaded and run: a directory someone else made first
    is refused (and the codec then fails as before, rather than load another user's code).
    Set ``NUMBA_CACHE_DIR`` to a lasting writable directory instead where one exists."""

    def __init__(self, py_func: Any, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._root = os.path.join(tempfile.gettempdir(), f"weftboard-kernels-{os.getuid()}")
        self._cache_path = os.path.join(self._root, self.get_suitable_cache_subpath(py_file))

    def ensure_cache_path(self) -> None:
        os.makedirs(self._root, mode=0o700, exist_ok=True)
        st = os.lstat(self._root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{self._root} is not a directory of this user's alone")
        super().ensure_cache_path()

    def get_cache_path(self) -> str:
        return self._cache_path

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> PrivateTempLocator | None:
        """numba's own (source stamp and disambiguator too, from its mixin), saying where."""
        locator = super().from_function(py_func, py_file)
        if locator is None:
            return None
        warnings.warn(f"no writable place for the kernels' disk cache: using {locator._root}, which may not outlast "
                      "this machine's temporary files; set NUMBA_CACHE_DIR to a lasting writable directory",
                      RuntimeWarning, stacklevel=2)
        return locator


def _register_locator() -> None:
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list):
        warnings.warn("this numba has no cache locator list to extend: after an edit to a kernel helper, "
                      "clear the kernels' cache (cuda/__pycache__/*.nbi, *.nbc) by hand", RuntimeWarning, stacklevel=2)
        return
    if PackageStampedLocator not in classes:
        PackageStampedLocator.fallbacks = list(classes)
        classes.insert(0, PackageStampedLocator)


_register_locator()
