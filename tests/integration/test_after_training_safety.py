"""More of the first hour of a QLoRA user, as the user did it: the cases of issue 14 that
tests/integration/test_after_training.py covers another way (an unquantized model, a reachable Hub).

Tiny random Llama on the CPU; 4-bit through transformers' BitsAndBytesConfig with the real bitsandbytes.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from peft_shardmerge import InputError, merge_and_save, save_pretrained_merged
from peft_shardmerge.testing import build_base
from tests.helpers import tree
from tests.integration.test_after_training import peft_qlora


@pytest.fixture()
def base_with_tokenizer(tmp_path) -> str:
    """A bf16 tiny Llama folder holding its tokenizer, as a downloaded model does."""
    folder = build_base(str(tmp_path / "tiny-llama"), "llama", dtype=torch.bfloat16)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", pad_token="w1", eos_token="w2").save_pretrained(
        folder
    )
    return folder


def test_a_qlora_merge_never_writes_over_the_folder_the_model_was_loaded_from(base_with_tokenizer, tmp_path):
    """The issue's call: merge_and_save(model, <the folder it was loaded from>, base_precision="dequantized",
    overwrite=True) on a 4-bit model replaced the base folder and deleted its tokenizer files."""
    model = peft_qlora(base_with_tokenizer)
    before = tree(tmp_path)
    assert "tokenizer.json" in os.listdir(base_with_tokenizer)
    for precision in ("dequantized", "auto", "original"):
        with pytest.raises(InputError, match="is the model folder"):
            merge_and_save(model, base_with_tokenizer, base_precision=precision, overwrite=True, progress=False)
    with pytest.raises(InputError, match="is the model folder"):  # Unsloth's call, which replaces earlier saves
        save_pretrained_merged(model, base_with_tokenizer, None, save_method="merged_16bit", overwrite=True)
    with pytest.raises(InputError, match="is the model folder"):
        save_pretrained_merged(model, base_with_tokenizer, None, save_method="merged_4bit_forced")
    assert tree(tmp_path) == before  # the base, its tokenizer and everything beside it, byte for byte
    report = merge_and_save(model, str(tmp_path / "merged"), base_precision="dequantized", progress=False)
    assert report.base_precision == "dequantized"
    assert json.load(open(tmp_path / "merged" / "config.json"))["model_type"] == "llama"


class _RefusingHub:
    """A Hub that refuses every repository creation: 401 for a bad token, 403 for another user's namespace."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _refuse(self) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                bad_token = "hf_wrong" in self.headers.get("Authorization", "")
                status, error = (
                    (401, "Invalid credentials in Authorization header")
                    if bad_token
                    else (403, 'You don\'t have the rights to create a model under the namespace "other"')
                )
                raw = json.dumps({"error": error}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Error-Message", error)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_POST = do_GET = do_PUT = _refuse

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_push_to_a_repository_that_cannot_be_created_fails_before_merging(bf16_base_tok, tmp_path, monkeypatch):
    """A wrong token or another user's namespace: the Hub's answer within seconds, nothing merged, no temporary
    folder left or named, the token masked."""
    import tempfile

    import huggingface_hub.constants as hc

    from peft_shardmerge import push_to_hub_merged
    from peft_shardmerge.errors import ShardMergeError

    monkeypatch.chdir(tmp_path)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    model = peft_qlora(bf16_base_tok)
    hub = _RefusingHub()
    try:
        monkeypatch.setattr(hc, "ENDPOINT", hub.url)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        for token, repo, said in (("hf_wrong_secret", "me/tiny", "401"), ("hf_good_secret", "other/tiny", "403")):
            with pytest.raises(ShardMergeError, match="nothing was merged") as e:
                push_to_hub_merged(model, repo, token=token, progress=False)
            assert type(e.value).__name__ == "HubUploadError"
            assert said in str(e.value) and token not in str(e.value), str(e.value)
            assert "peft-shardmerge-push-" not in str(e.value) and str(temp) not in str(e.value)
            with pytest.raises(ShardMergeError, match="nothing was merged"):
                save_pretrained_merged(model, repo, None, push_to_hub=True, token=token, progress=False)
        assert "POST /api/repos/create" in hub.requests, hub.requests  # asked, and nothing sent for upload
        assert not [r for r in hub.requests if "/preupload/" in r or "/commit/" in r], hub.requests
    finally:
        hub.close()
    assert os.listdir(temp) == [] and not os.path.exists("me") and not os.path.exists("other")


@pytest.fixture()
def bf16_base_tok(base_with_tokenizer):
    return base_with_tokenizer


def test_python_errors_name_keywords_and_the_command_line_names_flags(make_base, make_adapter, tmp_path, capsys):
    """A Python caller is told ``overwrite=True`` (no flag); the command line's user ``--overwrite`` (no keyword)."""
    from peft_shardmerge import merge_checkpoint
    from peft_shardmerge.api.cli import main as cli_main

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    out = tmp_path / "out"
    merge_checkpoint(base, adapter, str(out), progress=False)  # an earlier output of ours: overwrite replaces it
    before = tree(out)
    with pytest.raises(InputError) as e:
        merge_checkpoint(base, adapter, str(out), progress=False)
    assert "pass overwrite=True to replace it" in str(e.value)
    assert "--" not in str(e.value)
    capsys.readouterr()
    assert cli_main(["merge", base, adapter, str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err
    assert "overwrite=True" not in err
    assert tree(out) == before


@pytest.mark.parametrize("save_method", ["merged_16bit", "merged_4bit_forced"])
def test_an_unsloth_style_resave_never_deletes_a_file_that_appears_before_the_lock(
    bf16_base_tok, tmp_path, monkeypatch, save_method
):
    """save_pretrained_merged replaces only its own earlier save. Checked before the merge and again under the output
    lock: a file another process puts into the folder in between is kept, and the save is refused."""
    import warnings

    from peft_shardmerge.output import lock as outlock

    model = peft_qlora(bf16_base_tok)
    out = tmp_path / "merged"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # merged_4bit's warning that it re-quantizes
        save_pretrained_merged(model, str(out), save_method=save_method)
        save_pretrained_merged(model, str(out), save_method=save_method)  # re-running the cell replaces it
        before = sorted(os.listdir(out))
        real = outlock.OutputLock.acquire

        def acquire(self):
            (out / "someone_elses.txt").write_text("precious")  # written after the first check, before the lock
            return real(self)

        monkeypatch.setattr(outlock.OutputLock, "acquire", acquire)
        with pytest.raises(InputError, match=r"is not an earlier save"):
            save_pretrained_merged(model, str(out), save_method=save_method)
    assert (out / "someone_elses.txt").read_text() == "precious"
    assert sorted(os.listdir(out)) == sorted(before + ["someone_elses.txt"])


def test_a_merge_and_unload_that_fails_part_way_says_so_and_the_model_is_refused_afterwards(bf16_base_tok, tmp_path):
    """A float16 overflow in a later layer stops merge_and_unload after earlier layers were replaced (it consumes the
    model, as PEFT's does): the error says the model is now half merged, and every later merge refuses it."""
    from peft_shardmerge import MergeCheckError, merge_and_unload

    model = AutoModelForCausalLM.from_pretrained(bf16_base_tok, dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        model.base_model.model.model.layers[1].mlp.down_proj.lora_B["default"].weight[3, 2] = 1e7
    with pytest.raises(
        MergeCheckError,
        match=r"(?s)beyond float16's range.*stopped after replacing [1-9]\d* of "
        r"\d+ merged modules.*must not be used or merged again",
    ):
        merge_and_unload(model, dtype="float16")
    for merge in (lambda: merge_and_unload(model), lambda: merge_and_save(model, str(tmp_path / "m"), progress=False)):
        with pytest.raises(InputError, match="mixes merged and unmerged layers"):
            merge()
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_every_python_spelling_the_command_line_rewrites_is_one_the_library_says(make_base, make_adapter, tmp_path):
    """cli.FLAGS rewrites exact message text: each key must still appear in a library message, or the rewrite would
    silently stop working; and the module run as a script reaches the rewrite."""
    import pathlib
    import subprocess
    import sys

    import peft_shardmerge
    from peft_shardmerge.api.cli import FLAGS

    sources = "".join(
        p.read_text() for p in pathlib.Path(peft_shardmerge.__file__).parent.rglob("*.py") if p.name != "cli.py"
    )
    for python in FLAGS:
        assert python in sources, python
    out = tmp_path / "out"
    peft_shardmerge.merge_checkpoint(make_base("llama"), make_adapter("llama", "default"), str(out), progress=False)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "peft_shardmerge.api.cli",
            "merge",
            make_base("llama"),
            make_adapter("llama", "default"),
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 2, run.stderr
    assert "pass --overwrite to replace it" in run.stderr and "Traceback" not in run.stderr


def test_merge_and_unload_of_an_offloaded_model_without_room_for_its_merged_weights_changes_nothing(
    base_with_tokenizer, tmp_path, monkeypatch
):
    """Room in the offload folder is checked before any layer is replaced: with too little free space the model is
    refused, left as it was (same modules, same outputs) and no folder is made beside the user's offload files."""
    import copy

    from accelerate import dispatch_model

    from peft_shardmerge import merge_and_unload
    from peft_shardmerge.model import in_place

    torch.manual_seed(0)
    ref = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_with_tokenizer, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    offload = tmp_path / "offload"
    device_map = {
        f"base_model.model.{k}": v
        for k, v in {
            "model.embed_tokens": "cpu",
            "model.layers.0": "disk",
            "model.layers.1": "cpu",
            "model.norm": "cpu",
            "model.rotary_emb": "cpu",
            "lm_head": "cpu",
        }.items()
    }
    model = dispatch_model(copy.deepcopy(ref), device_map=device_map, offload_dir=str(offload))
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    files, kinds = sorted(os.listdir(offload)), [type(m) for m in model.modules()]
    monkeypatch.setattr(in_place, "free_bytes", lambda folder: 0)
    with pytest.raises(InputError, match=r"(?s)nothing was changed.*has 0 MiB free; the merged offloaded weights "):
        merge_and_unload(model)
    assert sorted(os.listdir(offload)) == files and kinds == [type(m) for m in model.modules()]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
