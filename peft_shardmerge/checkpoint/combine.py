"""Several adapters as one, on disk: PEFT's weighted combinations (``cat``, ``linear``) and the task-vector methods
(``ties``, ``dare_ties``, ``dare_linear``, ``magnitude_prune``) over their LoRA deltas."""

from __future__ import annotations

from typing import Sequence

from ..engine.maths import linear_factors
from ..engine.task_vectors import TaskVectorMethod
from ..errors import InputError
from ..io.safetensors_io import RowReader
from ..support.combinations import TASK_VECTOR_METHODS, combination_problems, task_vector_problems
from .adapter import AdapterSpec, LoraModule
from .adapter_files import AdapterTensor


def combine_adapters(
    specs: list[AdapterSpec],
    weights: list[float] | None = None,
    combination: str = "cat",
    *,
    density: float | None = None,
    majority_sign: str = "total",
    normalize: bool | None = None,
    seed: int = 0,
) -> AdapterSpec:
    """Several LoRA adapters as one: the weighted combination PEFT's ``add_weighted_adapter`` builds, or a
    task-vector method on their full deltas.

    ``"cat"`` gives exactly ``sum_i w_i * scaling_i * B_i @ A_i`` on every module (each adapter's factors are
    kept and applied with scaling ``w_i * scaling_i``; nothing is formed at full size). ``"linear"`` forms
    PEFT's combined factors ``A = sum_i sign_i sqrt(|w_i s_i|) A_i`` and ``B = sum_i sqrt(|w_i s_i|) B_i`` with
    scaling 1, which includes the cross terms ``B_i @ A_j``; it needs equal ranks. ``modules_to_save`` and other
    whole-tensor replacements are taken from the one adapter that has them. A task-vector method (``"ties"``,
    ``"dare_ties"``, ``"dare_linear"``, ``"magnitude_prune"``) keeps each adapter's factors and scaling and combines
    their deltas tensor by tensor (:mod:`~peft_shardmerge.engine.task_vectors`); it takes plain LoRA adapters only.

    Args:
        specs: the adapters (from :func:`~peft_shardmerge.checkpoint.adapter.load_adapter`), at least one.
        weights: one weight per adapter; None means 1.0 each.
        combination: one of :data:`~peft_shardmerge.support.combinations.COMBINATIONS`.
        density: the fraction of each delta a task-vector method keeps.
        majority_sign: ``"total"`` or ``"frequency"`` (``ties``, ``dare_ties``).
        normalize: divide by the weights kept per element; None: the method's default.
        seed: DARE's seed.

    Returns:
        A spec whose modules carry keys ``"<index>:<path>"`` (the path alone for one adapter with weight 1).

    Raises:
        InputError: weights of the wrong length or not finite, an unknown combination, unequal ranks with
            ``"linear"``, DoRA or IA3 adapters (:func:`~peft_shardmerge.support.combinations.combination_problems`),
            bad task-vector parameters, two adapters replacing the same tensor, or a task-vector method over
            anything but LoRA deltas. (The layout of each weight comes from the model class; adapters whose
            ``fan_in_fan_out`` flags differ are refused by the planner only where the class cannot be built.)
    """
    if not specs:
        raise InputError("no adapter given")
    weights, problems = combination_problems(
        [s.config for s in specs], [s.folder for s in specs], weights, combination
    )
    problems += task_vector_problems(combination, density, majority_sign, normalize, seed)
    if problems:
        raise InputError(problems)
    vectors = task_vector_method(combination, weights, density, majority_sign, normalize, seed)
    if len(specs) == 1 and weights[0] == 1.0 and vectors is None:
        return specs[0]
    others = [
        f"{s.folder} ({s.peft_type}{' on target_parameters' if s.peft_type == 'LORA' else ''})"
        for s in specs
        if s.needs_layers and s.peft_type != "IA3"
    ]  # IA3: refused above
    if others:
        problems.append(
            f"only LoRA adapters on modules (not on target_parameters) can be combined on disk: "
            f"{', '.join(others)}; combine them in process with merge_and_save(adapter_names=...)"
        )
    if vectors is not None:
        problems += _whole_tensor_problems(specs, combination)
    out = AdapterSpec(
        specs[0].folder,
        dict(specs[0].config),
        fan_in_fan_out=specs[0].fan_in_fan_out,
        folders=[f for s in specs for f in s.folders],
        combination=vectors.describe() if vectors else f"{combination} " + ", ".join(f"{w:g}" for w in weights),
        vectors=vectors,
    )
    out.tokenizer_files = next((s.tokenizer_files for s in specs if s.tokenizer_files), [])
    if out.tokenizer_files:
        out.folder = next(s.folder for s in specs if s.tokenizer_files)
    out.parts = list(specs)  # keeps the parts' scratch folders (legacy .bin conversions) alive
    problems += _take_whole_tensors(out, specs)
    if problems:
        raise InputError(problems)
    if combination != "linear":
        for i, (s, w) in enumerate(zip(specs, weights)):
            for path, m in s.modules.items():
                key = f"{i}:{path}"
                scaling = m.scaling if vectors else m.scaling * w  # a task-vector method weighs after sparsifying
                out.modules[key] = LoraModule(
                    m.path, m.kind, m.a, m.b, m.bias, m.rank, m.alpha, scaling, key=key, index=i
                )
        return out
    with RowReader() as reader:
        for path in sorted({p for s in specs for p in s.modules}):
            out.modules[path] = _linear_module(
                reader, path, [(s.modules[path], w) for s, w in zip(specs, weights) if path in s.modules]
            )
    return out


def task_vector_method(
    combination: str,
    weights: Sequence[float],
    density: float | None,
    majority_sign: str = "total",
    normalize: bool | None = None,
    seed: int = 0,
) -> TaskVectorMethod | None:
    """The task-vector method a combination names, with its defaults resolved (checked parameters).

    Args:
        combination: one of :data:`~peft_shardmerge.support.combinations.COMBINATIONS`.
        weights: one weight per adapter.
        density: the fraction kept.
        majority_sign: ``"total"`` or ``"frequency"``.
        normalize: None for the method's default.
        seed: DARE's seed.

    Returns:
        The :class:`~peft_shardmerge.engine.task_vectors.TaskVectorMethod`, or None for ``"cat"`` and ``"linear"``.

    Example:
        >>> task_vector_method("ties", [1.0, 1.0], 0.5).normalized, task_vector_method("cat", [1.0], None)
        (True, None)
    """
    if combination not in TASK_VECTOR_METHODS:
        return None
    sparsification, elects, normalized = TASK_VECTOR_METHODS[combination]
    return TaskVectorMethod(
        combination,
        tuple(float(w) for w in weights),
        float(density),
        sparsification,
        elects,
        normalized if normalize is None else normalize,
        majority_sign,
        seed,
    )


def _whole_tensor_problems(specs: list[AdapterSpec], combination: str) -> list[str]:
    """Whole tensors and biases a task-vector method has no definition for (the configs' fields are checked by
    :func:`~peft_shardmerge.support.combinations.combination_problems`; these are the files' own)."""
    problems = []
    for s in specs:
        kinds = [f"whole tensors ({', '.join(sorted(s.replacements)[:3])})"] if s.replacements else []
        kinds += ["trainable-token rows"] if s.tokens else []
        kinds += ["lora_B biases"] if any(m.bias is not None for m in s.modules.values()) else []
        if kinds:
            problems.append(
                f"combination {combination!r} combines the LoRA deltas of modules only; the adapter {s.folder} also "
                f"saves {', '.join(kinds)}. Combine it with 'cat' (or 'linear', for adapters of equal rank), or save "
                "the adapter without them "
                "(an embedding layer PEFT saved beside a LoRA on it, with an unchanged vocabulary: "
                "save_pretrained(..., save_embedding_layers=False))"
            )
    return problems


def _take_whole_tensors(out: AdapterSpec, specs: list[AdapterSpec]) -> list[str]:
    """Gather the replacements and token rows of every adapter into ``out``; two adapters may not share one."""
    problems = []
    for s in specs:
        out.saved_copies |= s.saved_copies
        for name, t in s.replacements.items():
            if name in out.replacements:
                problems.append(f"two adapters replace {name!r} (modules_to_save or a trained bias); only one may")
            out.replacements[name] = t
        for path, tr in s.tokens.items():
            if path in out.tokens:
                problems.append(f"two adapters train tokens of {path!r}; their rows cannot be combined")
            out.tokens[path] = tr
    return problems


def _linear_module(reader: RowReader, path: str, members: list[tuple[LoraModule, float]]) -> LoraModule:
    """PEFT's ``linear`` combination of one module's factors, with scaling 1."""
    first = members[0][0]
    a, b, _ = linear_factors([(m.a.load(reader), m.b.load(reader), w * m.scaling) for m, w in members])
    bias = None
    for m, w in members:  # lora_bias terms add like the deltas: sum_i w_i * scaling_i * bias_i
        if m.bias is not None:
            t = m.bias.load(reader).float() * (w * m.scaling)
            bias = t if bias is None else bias + t
    if bias is not None:
        bias = AdapterTensor(f"{path}.lora_B.bias", tuple(bias.shape), "F32", None, bias)
    return LoraModule(
        path,
        first.kind,
        AdapterTensor(f"{path}.lora_A", tuple(a.shape), "F32", None, a),
        AdapterTensor(f"{path}.lora_B", tuple(b.shape), "F32", None, b),
        bias,
        first.rank,
        float(first.rank),
        1.0,
    )
