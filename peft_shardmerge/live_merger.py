"""The in-process per-tensor merge: each output tensor of a walked model produced within the memory budget."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from .budget import MemoryBudget, free_accelerator_cache, is_out_of_memory
from .live import (
    LiveEntry,
    LiveModel,
    change_key,
    dequantize,
    materialized,
    offload_owner,
)
from .maths import (
    add_lora_checked_,
    dora_rescale_,
    ia3_multiplier,
    linear_factors,
    probe_rows,
    update_counts,
)
from .merger import check_probe_error, probe_vectors
from .options import DEFAULT_CHUNK_ELEMS
from .safetensors_io import row_blocks

log = logging.getLogger(__name__)


class LiveMerger:
    """Produces each output tensor of a walked model, within the memory budget."""

    def __init__(self, live: LiveModel, budget: MemoryBudget, out_dtype: torch.dtype = torch.float32,
                 weights: dict[str, float] | None = None, combination: str = "cat"):
        self.live = live
        self.weights = weights or {}
        self.combination = combination
        self.budget = budget
        self.out_dtype = out_dtype
        self.applied: Counter[str] = Counter()
        self.fallbacks = 0
        self.repacked: list[str] = []
        self.probe_err = 0.0
        self.swallowed: dict[str, tuple[int, int]] = {}

    def compute_device(self, entry: LiveEntry) -> torch.device:
        tensor = getattr(entry.holder, entry.attr, None)
        dev = tensor.device if tensor is not None and entry.kind in ("lora", "quantized", "delta", "ia3") \
            else torch.device("cpu")
        if dev.type == "meta":
            hook = getattr(offload_owner(self.live.model, entry.name, entry.holder), "_hf_hook", None)
            dev = torch.device(getattr(hook, "execution_device", None) or "cpu")
        need = entry.numel * 4 * 2
        if not self.budget.fits(need, dev):
            if dev.type != "cpu":
                log.info("%s: over the memory budget on %s; merging it on the CPU", entry.name, dev)
                return torch.device("cpu")
            # the CPU is the last resort: one module's fp32 copy is the least the merge can work with
            log.warning("%s needs about %d MiB, which goes over maximum_memory_usage of host RAM; merging it "
                        "anyway", entry.name, need >> 20)
        return dev

    def produce(self, entry: LiveEntry) -> torch.Tensor:
        """The tensor in the output layout (float32 for merged weights; as stored for plain tensors)."""
        with materialized(offload_owner(self.live.model, entry.name, entry.holder)):
            if entry.kind in ("plain", "saved"):
                return getattr(entry.holder, entry.attr) if "." not in entry.attr else \
                    entry.holder.state_dict(keep_vars=True)[entry.attr]
            if entry.kind == "tokens":
                out = entry.holder.weight.detach().to(torch.float32, copy=True)
                for a in entry.adapters:
                    index = torch.tensor(entry.module.token_indices[a], device=out.device)
                    out.index_copy_(0, index, entry.module.trainable_tokens_delta[a].detach().float().to(out.device))
                if entry.module.tied_adapter is None:
                    self.applied[change_key(entry)] += 1
                return out
            if entry.kind == "lora_bias":
                out = entry.holder.bias.detach().to(torch.float32, copy=True)
                for a in entry.adapters:
                    out += entry.module.lora_B[a].bias.detach().float().to(out.device) * (
                        entry.module.scaling[a] * self.weights.get(a, 1.0))
                return out
            dev = self.compute_device(entry)
            try:
                return self._merge_weight(entry, dev)
            except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
                if not is_out_of_memory(e):
                    raise
                free_accelerator_cache()
                self.fallbacks += 1
                log.warning("out of memory merging %s on %s; retrying on the CPU", entry.name, dev)
                return self._merge_weight(entry, torch.device("cpu"))

    def _add_peft_change(self, entry: LiveEntry, w: torch.Tensor) -> None:
        """Add PEFT's own delta of a LoHa/LoKr/VeRA layer or LoRA on a parameter to ``w``, or apply IA3's scaling."""
        layer = entry.module
        flat = w.reshape(w.shape[0], -1)  # a view: rows, as ia3_multiplier counts them
        for a in entry.adapters:
            if entry.kind == "ia3":
                mult, per_row = ia3_multiplier(layer.ia3_l[a].detach(), tuple(w.shape),
                                               feedforward=layer.is_feedforward, bias=entry.attr == "bias",
                                               fan_in_fan_out=getattr(layer, "fan_in_fan_out", False))
                flat *= (mult.reshape(flat.shape[0], -1) if per_row else mult).to(w.device)
            else:
                w += layer.get_delta_weight(a).detach().float().to(w.device) * self.weights.get(a, 1.0)
        if entry.adapters and not (entry.kind == "ia3" and entry.attr == "bias"):
            self.applied[change_key(entry)] += 1

    def _merge_weight(self, entry: LiveEntry, device: torch.device) -> torch.Tensor:
        if entry.attr == "weight":
            notes: list[str] = []
            w = dequantize(entry.holder, device, notes)
            if notes:
                self.repacked.append(entry.name)
        else:  # a bias, or a parameter such as fused experts' gate_up_proj
            w = getattr(entry.holder, entry.attr).detach().to(device=device, dtype=torch.float32, copy=True)
        if entry.kind in ("delta", "ia3"):
            self._add_peft_change(entry, w)
        if entry.kind == "lora":
            m = entry.module
            factors = []
            for a in entry.adapters:
                scaling = m.scaling[a] * self.weights.get(a, 1.0)
                if a in m.lora_A:  # convolution factors [r, in, *kernel] flatten like the weight's rows
                    factors.append((m.lora_A[a].weight.detach().flatten(1), m.lora_B[a].weight.detach().flatten(1),
                                    scaling))
                else:
                    factors.append((m.lora_embedding_A[a].detach(), m.lora_embedding_B[a].detach(), scaling))
            if self.combination == "linear" and len(factors) > 1:
                factors = [linear_factors([(a.to(device), b.to(device), s) for a, b, s in factors])]
            embedding = bool(entry.adapters) and entry.adapters[0] in m.lora_embedding_A
            transposed = embedding or bool(getattr(m, "fan_in_fan_out", False))
            magnitudes = [m.lora_magnitude_vector[a].weight.detach().reshape(-1) for a in entry.adapters
                          if getattr(m, "use_dora", {}).get(a)]
            by_column = transposed  # DoRA on an embedding or Conv1D: one norm per stored column
            flat = w.reshape(w.shape[0], -1)  # a view; convolution weights as [out, in * kernel]
            probes = probe_vectors(entry.name, flat.shape[1]) if factors else None
            changed = lost = 0
            for start, stop in row_blocks(tuple(flat.shape), DEFAULT_CHUNK_ELEMS):
                block = flat[start:stop]
                sample = probe_rows(stop - start, block.device)
                before = block[sample].clone() if probes is not None else None
                err = add_lora_checked_(block, factors, start, stop, transposed=transposed, probes=probes)
                self.probe_err = max(self.probe_err, err)
                check_probe_error(entry.name, start, stop, err)
                for magnitude in magnitudes if not by_column else ():  # DoRA, norms per output row
                    dora_rescale_(block, magnitude[start:stop])
                if before is not None and self.out_dtype != torch.float32:
                    c, lo = update_counts(before, block[sample], block[sample].to(self.out_dtype))
                    changed, lost = changed + c, lost + lo
            for magnitude in magnitudes if by_column else ():
                flat *= (magnitude.to(flat.device, torch.float32) / torch.linalg.norm(flat, dim=0)).unsqueeze(0)
            if changed:
                self.swallowed[entry.name] = (changed, lost)
            if entry.adapters:
                self.applied[change_key(entry)] += 1
        return w.T if entry.transpose_out else w
