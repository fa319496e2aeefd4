"""The models the conformance matrix runs PEFT's cases on: tiny transformers models (with, for each, the module
names that stand for the layers of PEFT's small test models) and PEFT's small ``nn.Module`` test models rebuilt.

PEFT's custom cases target layers named ``lin0``, ``lin1``, ``emb``, ``conv1d``, ``conv2d``, ``conv3d``,
``layernorm0``... of small models (``tests/test_custom_models.py``). On a transformers model the same case
targets the layers of the same kind: :data:`ARCH_NAMES` gives, per tiny architecture, the module name standing
for each of PEFT's names, and :data:`MODEL_ARCHS` which architectures carry the layer kinds of each PEFT model.
"""

from __future__ import annotations

import torch
from torch import nn

from peft_shardmerge.testing import tiny_config

#: PEFT's module name -> the module (suffix) standing for it, per tiny architecture
ARCH_NAMES: dict[str, dict[str, str]] = {
    "llama": {"lin0": "mlp.up_proj", "lin1": "mlp.down_proj", "emb": "embed_tokens"},
    "qwen2": {"lin0": "mlp.up_proj", "lin1": "mlp.down_proj", "emb": "embed_tokens"},
    "gemma3": {"lin0": "mlp.up_proj", "lin1": "mlp.down_proj", "emb": "embed_tokens"},
    "opt": {
        "lin0": "fc1",
        "lin1": "fc2",
        "emb": "embed_tokens",
        "layernorm0": "self_attn_layer_norm",
        "layernorm1": "final_layer_norm",
    },
    "gptj": {"lin0": "mlp.fc_in", "lin1": "mlp.fc_out", "emb": "wte", "layernorm0": "ln_1", "layernorm1": "ln_f"},
    "gpt2": {"conv1d": "mlp.c_fc", "lin0": "lm_head", "emb": "wte", "layernorm0": "ln_1", "layernorm1": "ln_2"},
    "gpt2_tied": {"conv1d": "mlp.c_fc", "lin0": "lm_head", "emb": "wte"},
    "t5": {"lin0": "DenseReluDense.wi", "lin1": "DenseReluDense.wo", "emb": "shared"},
    "bart": {
        "lin0": "fc1",
        "lin1": "fc2",
        "emb": "shared",
        "layernorm0": "self_attn_layer_norm",
        "layernorm1": "final_layer_norm",
    },
    "bert": {
        "lin0": "intermediate.dense",
        "lin1": "output.dense",
        "emb": "word_embeddings",
        "layernorm0": "attention.output.LayerNorm",
        "layernorm1": "embeddings.LayerNorm",
    },
    "llava": {
        "conv2d": "patch_embedding",
        "lin0": "multi_modal_projector.linear_1",
        "lin1": "multi_modal_projector.linear_2",
    },
    "qwen2_vl": {"conv3d": "patch_embed.proj", "lin0": "mlp.up_proj", "lin1": "mlp.down_proj"},
}

#: PEFT's test model id -> the tiny architectures with the same layer kinds (a case takes one, by its index);
#: an empty tuple: no tiny transformers model has these layers (nn.Conv1d, grouped convolutions,
#: nn.MultiheadAttention), the case runs on PEFT's model only
MODEL_ARCHS: dict[str, tuple[str, ...]] = {
    "MLP": ("llama", "qwen2", "opt", "gptj", "gemma3", "t5", "bart", "bert"),
    "MLP2": ("llama", "opt"),
    "MLP_LayerNorm": ("opt", "gptj", "bart", "bert", "gpt2"),
    "EmbConv1D": ("gpt2", "gpt2_tied"),
    "Conv2d": ("llava",),
    "Conv2d2": ("llava",),
    "Conv2d1x1": ("llava",),
    "Conv3d": ("qwen2_vl",),
    "MlpUsingParameters": ("llama",),
    "Conv1d": (),
    "Conv1dBigger": (),
    "Conv1dGroups": (),
    "Conv2dGroups": (),
    "Conv2dGroups2": (),
    "MHA": (),
}

#: the decoder and encoder-decoder architectures PEFT's model tests use (OPT, GPT-2, GPT-J, Llama, Qwen2, Gemma3;
#: T5, BART)
DECODER_ARCHS = ("opt", "gpt2", "gptj", "llama", "qwen2", "gemma3")
ENCODER_DECODER_ARCHS = ("t5", "bart")


def arch_config(arch: str):
    """A tiny transformers config of one of the matrix's architectures (with ``architectures`` set).

    Args:
        arch: a key of :data:`ARCH_NAMES`.

    Returns:
        The config.

    Raises:
        ValueError: unknown architecture.

    Example:
        >>> arch_config("opt").architectures
        ['OPTForCausalLM']
    """
    import transformers as tf

    common = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "opt":
        return tf.OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=128,
            architectures=["OPTForCausalLM"],
            **common,
        )
    if arch == "gptj":
        return tf.GPTJConfig(
            n_embd=64,
            n_layer=2,
            n_head=4,
            rotary_dim=8,
            n_positions=128,
            tie_word_embeddings=False,
            architectures=["GPTJForCausalLM"],
            **common,
        )
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
            sliding_window=16,
            architectures=["Gemma3ForCausalLM"],
            **common,
        )
    if arch == "bart":
        return tf.BartConfig(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=128,
            decoder_start_token_id=2,
            architectures=["BartForConditionalGeneration"],
            **common,
        )
    if arch in ("gpt2", "gpt2_tied"):
        return tiny_config(
            "gpt2", n_embd=64, tie_word_embeddings=arch == "gpt2_tied", architectures=["GPT2LMHeadModel"]
        )
    if arch == "llama":
        return tiny_config("llama", hidden_size=64, intermediate_size=128, architectures=["LlamaForCausalLM"])
    if arch == "qwen2":
        return tiny_config("qwen2", hidden_size=64, intermediate_size=128, architectures=["Qwen2ForCausalLM"])
    if arch in ("t5", "bert", "llava", "qwen2_vl"):
        return tiny_config(arch)
    raise ValueError(f"unknown architecture {arch!r}")


def build_arch(folder: str, arch: str, seed: int = 0) -> str:
    """Build a random tiny model of ``arch`` in fp32 and save it with ``save_pretrained``.

    Args:
        folder: where to save it.
        arch: a key of :data:`ARCH_NAMES`.
        seed: random seed.

    Returns:
        ``folder``.

    Raises:
        ValueError: unknown architecture.

    Example:
        >>> build_arch("/tmp/tiny-opt", "opt")   # doctest: +SKIP
        '/tmp/tiny-opt'
    """
    from peft_shardmerge.testing import model_class

    torch.manual_seed(seed)
    config = arch_config(arch)
    model = model_class(config)(config).float()
    model.save_pretrained(folder)
    return folder


class _ParamLinear(nn.Module):
    """A linear layer whose weight is a bare ``[in, out]`` parameter (PEFT's ``_LinearUsingParameter``)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out))
        self.bias = nn.Parameter(torch.ones(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class CustomModel(nn.Module):
    """PEFT's small test models, same layer names and shapes: a stack of named layers applied in order, with
    reshapes between them (see ``tests/test_custom_models.py`` of PEFT)."""

    def __init__(self, model_id: str):
        super().__init__()
        self.model_id = model_id
        spec = CUSTOM_SPECS[model_id]
        self.steps = []
        for name, make in spec["layers"]:
            if make is None:
                self.steps.append(name)
            else:
                setattr(self, name, make())
                self.steps.append(name)

    def forward(self, X):
        spec = CUSTOM_SPECS[self.model_id]
        X = X if X.dtype == torch.long else X.float()
        for name in self.steps:
            if name.startswith("@"):
                X = spec["reshape"][name](X)
            elif name == "mha":
                X, _ = self.mha(X, X, X)
            else:
                X = getattr(self, name)(X)
        return torch.log_softmax(X, dim=-1)


def _conv1d_cls():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


#: model id -> layers in order ((name, factory) or ("@reshape", None)), reshapes, and an input maker
CUSTOM_SPECS: dict[str, dict] = {
    "MLP": {
        "layers": [("lin0", lambda: nn.Linear(10, 20)), ("relu", nn.ReLU), ("lin1", lambda: nn.Linear(20, 2))],
        "input": lambda g: torch.randn(4, 10, generator=g),
    },
    "MLP2": {
        "layers": [("lin0", lambda: nn.Linear(10, 32)), ("relu", nn.ReLU), ("lin1", lambda: nn.Linear(32, 2))],
        "input": lambda g: torch.randn(4, 10, generator=g),
    },
    "MLP_LayerNorm": {
        "layers": [
            ("layernorm0", lambda: nn.LayerNorm(10)),
            ("lin0", lambda: nn.Linear(10, 20)),
            ("relu", nn.ReLU),
            ("layernorm1", lambda: nn.LayerNorm(20)),
            ("lin1", lambda: nn.Linear(20, 2)),
        ],
        "input": lambda g: torch.randn(4, 10, generator=g),
    },
    "MlpUsingParameters": {
        "layers": [("lin0", lambda: _ParamLinear(10, 20)), ("relu", nn.ReLU), ("lin1", lambda: _ParamLinear(20, 2))],
        "input": lambda g: torch.randn(4, 10, generator=g),
    },
    "EmbConv1D": {
        "layers": [
            ("emb", lambda: nn.Embedding(100, 5)),
            ("conv1d", lambda: _conv1d_cls()(1, 5)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin0", lambda: nn.Linear(10, 2)),
        ],
        "input": lambda g: torch.randint(0, 100, (4, 10), generator=g),
    },
    "Conv1d": {
        "layers": [
            ("conv1d", lambda: nn.Conv1d(1, 1, 2)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin0", lambda: nn.Linear(9, 2)),
        ],
        "input": lambda g: torch.randn(4, 1, 10, generator=g),
    },
    "Conv1dBigger": {
        "layers": [
            ("conv1d", lambda: nn.Conv1d(64, 16, 2)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin0", lambda: nn.Linear(144, 2)),
        ],
        "input": lambda g: torch.randn(4, 64, 10, generator=g),
    },
    "Conv1dGroups": {
        "layers": [
            ("conv1d", lambda: nn.Conv1d(8, 8, 3, groups=2)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin0", lambda: nn.Linear(64, 2)),
        ],
        "input": lambda g: torch.randn(4, 8, 10, generator=g),
    },
    "Conv2d": {
        "layers": [
            ("conv2d", lambda: nn.Conv2d(5, 10, 3)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin0", lambda: nn.Linear(10, 2)),
        ],
        "input": lambda g: torch.randn(4, 5, 3, 3, generator=g),
    },
    "Conv2d2": {
        "layers": [
            ("lin0", lambda: nn.Linear(10, 72)),
            ("relu", nn.ReLU),
            ("@to8x3x3", None),
            ("conv2d", lambda: nn.Conv2d(8, 32, 3)),
            ("flat", nn.Flatten),
            ("lin1", lambda: nn.Linear(32, 2)),
        ],
        "reshape": {"@to8x3x3": lambda x: x.reshape(-1, 8, 3, 3)},
        "input": lambda g: torch.randn(4, 10, generator=g),
    },
    "Conv2d1x1": {
        "layers": [
            ("conv2d", lambda: nn.Conv2d(1, 10, 1)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin0", lambda: nn.Linear(90, 2)),
        ],
        "input": lambda g: torch.randn(4, 1, 3, 3, generator=g),
    },
    "Conv2dGroups": {
        "layers": [
            ("lin0", lambda: nn.Linear(90, 288)),
            ("@to16x3x3", None),
            ("conv2d", lambda: nn.Conv2d(16, 16, 3, groups=8)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin1", lambda: nn.Linear(16, 2)),
        ],
        "reshape": {"@to16x3x3": lambda x: x.reshape(-1, 16, 3, 3)},
        "input": lambda g: torch.randn(2, 90, generator=g),
    },
    "Conv2dGroups2": {
        "layers": [
            ("conv2d", lambda: nn.Conv2d(16, 32, 3, padding=1, groups=2)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin0", lambda: nn.Linear(800, 2)),
        ],
        "input": lambda g: torch.randn(3, 16, 5, 5, generator=g),
    },
    "Conv3d": {
        "layers": [
            ("conv3d", lambda: nn.Conv3d(5, 10, 3)),
            ("relu", nn.ReLU),
            ("flat", nn.Flatten),
            ("lin0", lambda: nn.Linear(10, 2)),
        ],
        "input": lambda g: torch.randn(4, 5, 3, 3, 3, generator=g),
    },
    "MHA": {
        "layers": [("mha", lambda: nn.MultiheadAttention(10, 2)), ("lin0", lambda: nn.Linear(10, 2))],
        "input": lambda g: torch.randn(4, 3, 10, generator=g),
    },
}


def custom_input(model_id: str, seed: int = 0) -> torch.Tensor:
    """A reproducible input for one of PEFT's small test models.

    Args:
        model_id: a key of :data:`CUSTOM_SPECS`.
        seed: random seed.

    Returns:
        The input tensor.

    Raises:
        KeyError: unknown model id.

    Example:
        >>> custom_input("MLP").shape
        torch.Size([4, 10])
    """
    return CUSTOM_SPECS[model_id]["input"](torch.Generator().manual_seed(seed))
