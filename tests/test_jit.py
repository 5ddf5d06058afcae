"""The kernels' compile options: only ``prange`` loops become parallel regions, for every
signature a kernel is compiled for; and their disk cache, stamped with every numba source of
the package (see ``weftboard.cuda.jit``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba as nb
import numpy as np

from weftboard.cuda import huffman, jit, tile_assembly, tile_decode, tile_scan
from weftboard.cuda.jit import PRANGE_ONLY, parallel_kernel


def _kernel(a):  # array expressions that parallel=True would each turn into a region
    out = np.zeros(a.size, np.int64)
    total = a[:4].sum()
    for i in nb.prange(a.size):
        out[i] = a[i] + total
    return out


def _parallel_regions(dispatcher, sig) -> int:
    return len(dispatcher.overloads[sig].metadata["parfor_diagnostics"].initial_parfors)


def test_only_the_prange_loop_is_parallel_for_every_signature() -> None:
    kernel = parallel_kernel(_kernel, cache=False)  # compiled here, so the diagnostics exist
    for dtype in (np.int64, np.int32, np.uint16):
        a = np.arange(100, dtype=dtype)
        assert kernel(a).tolist() == (np.arange(100) + 6).tolist()
    assert len(kernel.signatures) == 3
    assert [_parallel_regions(kernel, s) for s in kernel.signatures] == [1, 1, 1]


def test_the_same_function_with_parallel_true_has_more_regions() -> None:
    """The yardstick for the test above: numba's default makes a region of each expression."""
    kernel = nb.njit(parallel=True, cache=False)(_kernel)
    kernel(np.arange(100, dtype=np.int64))
    assert _parallel_regions(kernel, kernel.signatures[0]) > 1


def test_the_codec_kernels_use_those_options() -> None:
    for k in (tile_scan.scan_encode_tiles, tile_scan.scan_encode_tiles_packed, tile_scan.scan_encode_batch_packed,
              tile_assembly.rans_encode_tiles, tile_assembly.move_pieces, tile_assembly.compact_tiles, tile_decode._decode_tiles,
              huffman.encode_tiles, huffman.encode_tiles_by_row):
        assert k.targetoptions["parallel"] is PRANGE_ONLY
    assert not PRANGE_ONLY.numpy and not PRANGE_ONLY.setitem and PRANGE_ONLY.prange


_STALE_PROBE = r"""
import os, sys
from weftboard.cuda import jit
jit._PACKAGE_DIR = sys.argv[1]  # the probe package stands in for weftboard.cuda
jit.kernel_sources_digest.cache_clear()
sys.path.insert(0, sys.argv[1])
import kern
print(kern.kernel(), type(kern.kernel._cache._impl.locator).__name__)
"""


def _probe(pkg: Path, cache_dir: Path) -> tuple[str, str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", _STALE_PROBE, str(pkg)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    value, locator = out.stdout.split()
    return value, locator


def test_an_edit_to_an_inlined_helper_recompiles_the_cached_kernels_that_use_it(tmp_path: Path) -> None:
    """numba stamps a cached kernel with its own file only: a kernel inlining a helper from
    another file kept its old machine code after the helper changed. The package's locator
    stamps it with every numba source of the package as well."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "helper.py").write_text("import numba\n\n@numba.njit(inline='always', cache=True)\ndef value():\n    return 1\n")
    (pkg / "kern.py").write_text("import numba\nfrom helper import value\n\n@numba.njit(cache=True)\ndef kernel():\n"
                                 "    return value() * 10\n")
    cache = tmp_path / "cache"
    assert _probe(pkg, cache) == ("10", "PackageStampedLocator")
    assert any(cache.rglob("*kernel*.nbi")), "the kernel should be cached on disk"
    (pkg / "helper.py").write_text((pkg / "helper.py").read_text().replace("return 1", "return 2"))
    assert _probe(pkg, cache)[0] == "20"


def test_the_sources_digest_covers_the_modules_that_use_numba_only(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a.py").write_text("import numba\n")
    (tmp_path / "b.py").write_text("x = 1\n")
    monkeypatch.setattr(jit, "_PACKAGE_DIR", str(tmp_path))

    def digest() -> str:
        jit.kernel_sources_digest.cache_clear()
        return jit.kernel_sources_digest()

    before = digest()
    (tmp_path / "b.py").write_text("x = 2\n")
    assert digest() == before
    (tmp_path / "a.py").write_text("import numba  # edited\n")
    assert digest() != before
    jit.kernel_sources_digest.cache_clear()


def test_every_cached_kernel_of_the_package_gets_the_package_locator() -> None:
    """Each kernel module imports ``jit`` before it defines a kernel, whichever is imported
    first (checked in a fresh interpreter per module)."""
    script = ("import importlib, sys, numba\n"
              "m = importlib.import_module(sys.argv[1])\n"
              "bad = [n for n, f in vars(m).items() if isinstance(f, numba.core.registry.CPUDispatcher)\n"
              "       and f.__module__ == m.__name__ and f._cache.__class__.__name__ != 'NullCache'\n"
              "       and type(f._cache._impl.locator).__name__ != 'PackageStampedLocator']\n"
              "print(len([f for f in vars(m).values() if isinstance(f, numba.core.registry.CPUDispatcher)]), bad)\n")
    checked = 0
    for name in ("bitops", "entropy", "huffman", "tile_blocks", "tile_scan", "tile_assembly", "tile_encode", "tile_decode",
                 "context_codec", "diff", "encode"):
        out = subprocess.run([sys.executable, "-c", script, f"weftboard.cuda.{name}"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        count, bad = out.stdout.split(" ", 1)
        assert bad.strip() == "[]", f"{name}: {bad}"
        checked += int(count)
    assert checked > 0, "no dispatcher was found to check: the test would pass on anything"


_READ_ONLY_PROBE = r"""
import sys
from weftboard.cuda import jit
jit._PACKAGE_DIR = sys.argv[1]  # the probe package stands in for weftboard.cuda
jit.kernel_sources_digest.cache_clear()
for place in jit.PackageStampedLocator.fallbacks:  # numba's own places, all read-only here
    place.from_function = classmethod(lambda cls, py_func, py_file: None)
sys.path.insert(0, sys.argv[1])
import kern
locator = kern.kernel._cache._impl.locator
print(kern.kernel(), type(locator._inner).__name__, locator.get_cache_path())
"""


def test_kernels_are_cached_in_a_private_temp_dir_where_nothing_else_is_writable(tmp_path: Path) -> None:
    """A sandboxed service (systemd's ProtectSystem=strict and ProtectHome=true, a read-only
    container) has no writable ``__pycache__`` and no writable home: numba then refused to
    define a cached kernel at all and the codec did not import. The kernels now go to a
    directory of this user's own under the temporary directory, and one that another user
    could have made is refused."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "kern.py").write_text("import numba\n\n@numba.njit(cache=True)\ndef kernel():\n    return 10\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | {"TMPDIR": str(tmp)}

    def probe() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _READ_ONLY_PROBE, str(pkg)], env=env, capture_output=True,
                              text=True, timeout=120)

    out = probe()
    assert out.returncode == 0, out.stderr[-2000:]
    value, inner, path = out.stdout.split()
    root = tmp / f"weftboard-kernels-{os.getuid()}"
    assert (value, inner) == ("10", "PrivateTempLocator") and Path(path).parent == root
    assert "set NUMBA_CACHE_DIR" in out.stderr  # said once, not left to be found
    assert (root.stat().st_mode & 0o777) == 0o700 and any(root.rglob("*kernel*.nbi"))

    for entry in sorted(root.rglob("*"), reverse=True):
        entry.unlink() if entry.is_file() else entry.rmdir()
    root.chmod(0o777)  # as if someone else had made it first, open to all
    refused = probe()
    assert refused.returncode != 0 and "no locator available" in refused.stderr
