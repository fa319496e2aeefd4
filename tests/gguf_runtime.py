"""llama.cpp at work on a GGUF file, through llama-cpp-python: run with the python of ``gguf_refs.llama_cpp_python()``
(its own environment), not imported by the tests.

    python tests/gguf_runtime.py quantize IN.gguf OUT.gguf q4_k_m
        ``llama_model_quantize`` with its default parameters (what ``llama-quantize IN OUT Q4_K_M`` does: no
        importance matrix), type given as ``outtype`` names it
    python tests/gguf_runtime.py logits MODEL.gguf '[12, 7, ...]'
        the logits at every position of the ids (evaluated as given: no BOS added), a JSON list of rows on stdout
"""

from __future__ import annotations

import json
import sys


def quantize(infile: str, outfile: str, outtype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{outtype.upper()}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(infile.encode(), outfile.encode(), params):
        sys.exit(f"llama_model_quantize failed on {infile} ({outtype})")


def logits(model: str, ids_json: str) -> None:
    import llama_cpp

    ids = json.loads(ids_json)
    llm = llama_cpp.Llama(model, logits_all=True, n_ctx=max(64, len(ids)), n_threads=2, verbose=False)
    llm.eval(ids)
    json.dump(llm.scores[: len(ids)].tolist(), sys.stdout)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"quantize": quantize, "logits": logits}[command](*args)
