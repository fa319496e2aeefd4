"""Demo: build a tiny random Llama and a trained-looking LoRA adapter, merge them, and prove the result.

Run with ``make demo`` (or ``python examples/demo.py [WORKDIR]``). Nothing is downloaded.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.testing import build_adapter, build_base, compare_logits


def main(workdir: str) -> int:
    logging.basicConfig(level=logging.WARNING)
    base = build_base(os.path.join(workdir, "tiny-llama"), "llama", max_shard_size="200KB")
    adapter = build_adapter(base, os.path.join(workdir, "tiny-adapter"), r=8, lora_alpha=16, use_rslora=True)
    out = os.path.join(workdir, "tiny-llama-merged")
    print(f"base:    {base}\nadapter: {adapter}\n")

    report = merge_checkpoint(base, adapter, out, dtype="float32", max_shard_size="500KB")
    print(report.summary())
    print("files:", ", ".join(sorted(os.listdir(out))))

    err = compare_logits(base, adapter, out)
    ok = err < 1e-4
    print(f"\nmax |logits(merged) - logits(base + adapter)| = {err:.2e}  ->  {'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(sys.argv[1]))
    with tempfile.TemporaryDirectory(prefix="peft-shardmerge-demo-") as tmp:
        sys.exit(main(tmp))
