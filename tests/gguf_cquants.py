"""llama.cpp's own K-quant quantizers (``quantize_row_q4_K_ref`` / ``q5_K`` / ``q6_K`` of ``ggml-quants.c``), compiled
once per machine into a shared library in the references' cache and called through ctypes: the reference the numpy
ports in ``peft_shardmerge.output.gguf_kquants`` are checked against byte for byte.

``ggml-quants.c`` is compiled alone, with a small shim defining the four ggml symbols it links against
(``ggml_abort``, ``ggml_row_size``, ``ggml_type_size``, ``ggml_type_name``), only reached by functions the tests do
not call. The flags are llama.cpp's release ones for that file (it is part of ``ggml-base``, which gets no
``-march``): ``-O2 -DNDEBUG``, plus ``-ffp-contract=off`` so that no compiler fuses a multiply-add (on x86-64
without ``-mfma`` there is nothing to fuse anyway; ``library(flags)`` builds other variants to compare).

Without a C compiler the tests that need it skip, saying so.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess

import numpy as np
import pytest
from filelock import FileLock

from tests import gguf_refs

#: llama.cpp's release flags for ggml-quants.c (ggml-base: no -march), without fused multiply-adds
DEFAULT_FLAGS = ("-O2", "-DNDEBUG", "-ffp-contract=off")

#: bytes per 256-value block
BLOCK_BYTES = {"q4_K": 144, "q5_K": 176, "q6_K": 210}

_SHIM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
/* the ggml symbols ggml-quants.c links against; only the functions the tests do not call reach them */
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "ggml_abort from %s:%d\n", file, line);
    abort();
}
size_t ggml_row_size(int type, int64_t ne) { (void) type; (void) ne; abort(); }
size_t ggml_type_size(int type) { (void) type; abort(); }
const char * ggml_type_name(int type) { (void) type; return "?"; }
"""

_libs: dict[tuple[str, ...], ctypes.CDLL] = {}


def compiler() -> str:
    """The system C compiler, or skip the test saying there is none."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc) to build llama.cpp's ggml-quants.c, the K-quants' reference")
    return cc


def library(flags: tuple[str, ...] = DEFAULT_FLAGS) -> ctypes.CDLL:
    """llama.cpp's ``ggml-quants.c`` compiled with ``flags`` (built on first use, cached per flag set)."""
    if flags in _libs:
        return _libs[flags]
    cc = compiler()
    src = gguf_refs.llama_cpp_source() / "ggml"
    tag = hashlib.sha256(" ".join((cc, *flags, str(src))).encode()).hexdigest()[:12]
    home = gguf_refs.cache_dir() / f"{gguf_refs.LLAMA_CPP_SDIST.replace('==', '-')}-ggml-quants-{tag}"
    so = home / "libggml-quants.so"
    with FileLock(str(home) + ".lock"):
        if not (home / ".ready").exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            (home / "shim.c").write_text(_SHIM)
            cmd = [cc, *flags, "-fPIC", "-shared", "-w", f"-I{src / 'include'}", f"-I{src / 'src'}"]
            cmd += [str(src / "src" / "ggml-quants.c"), str(home / "shim.c"), "-o", str(so), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode:
                pytest.skip(
                    f"llama.cpp's ggml-quants.c did not compile ({' '.join(cmd[:4])} ...): {done.stderr[-400:]}"
                )
            (home / "cmd.txt").write_text(" ".join(cmd) + "\n")
            (home / ".ready").touch()
    lib = ctypes.CDLL(str(so))
    for name in ("quantize_row_q4_K_ref", "quantize_row_q5_K_ref", "quantize_row_q6_K_ref"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    _libs[flags] = lib
    return lib


def quantize(kind: str, rows: np.ndarray, flags: tuple[str, ...] = DEFAULT_FLAGS) -> np.ndarray:
    """Rows of float32 (``(n, k)``, ``k`` a multiple of 256) quantized by llama.cpp's ``quantize_row_<kind>_ref``:
    ``(n, k // 256 * block bytes)`` uint8, the bytes llama-quantize writes for them."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] % 256:
        raise ValueError(f"rows must be (n, k) with k a multiple of 256, not {rows.shape}")
    out = np.zeros((rows.shape[0], rows.shape[1] // 256 * BLOCK_BYTES[kind]), dtype=np.uint8)
    if rows.size:
        getattr(library(flags), f"quantize_row_{kind}_ref")(rows.ctypes.data, out.ctypes.data, rows.size)
    return out


def quantize_q4_k(rows: np.ndarray, flags: tuple[str, ...] = DEFAULT_FLAGS) -> np.ndarray:
    """llama.cpp's Q4_K of ``rows`` (see ``quantize``)."""
    return quantize("q4_K", rows, flags)


def quantize_q5_k(rows: np.ndarray, flags: tuple[str, ...] = DEFAULT_FLAGS) -> np.ndarray:
    """llama.cpp's Q5_K of ``rows`` (see ``quantize``)."""
    return quantize("q5_K", rows, flags)


def quantize_q6_k(rows: np.ndarray, flags: tuple[str, ...] = DEFAULT_FLAGS) -> np.ndarray:
    """llama.cpp's Q6_K of ``rows`` (see ``quantize``)."""
    return quantize("q6_K", rows, flags)
