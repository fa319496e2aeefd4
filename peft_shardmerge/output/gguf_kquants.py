"""llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) byte for byte (numba or numpy), the type llama-quantize gives a tensor."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import numpy as np

try:  # numba is optional (pip install 'peft-shardmerge[gguf]' brings it): without it the numpy port below runs
    from . import gguf_kquants_numba as numba_kernels
except ImportError:
    numba_kernels = None

__all__ = ["BLOCK_BYTES", "FTYPES", "kquant_tensor_types", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k"]

#: bytes of one 256-value super-block (``ggml-common.h``: ``block_q4_K``, ``block_q5_K``, ``block_q6_K``)
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

QK_K = 256
#: super-blocks quantized at once: the search's (32, 8 * _CHUNK) float32 arrays are 1 MiB each, near the caches
_CHUNK = 1024
_F32 = np.float32
_MAGIC = _F32(12582912.0)  # 1.5 * 2**23
_GROUP_MAX_EPS = _F32(1e-15)  # ggml-quants.c GROUP_MAX_EPS


# ---------------------------------------------------------------------------------------------------------------------
# helpers of ggml-quants.c / ggml-impl.h, elementwise over float32 arrays
# ---------------------------------------------------------------------------------------------------------------------


def _nearest_int(f: np.ndarray) -> np.ndarray:
    """``nearest_int``: adds 1.5 * 2**23 in float32 and reads the low mantissa bits (round half to even), giving
    the C's bits for any input, those outside the range it asserts (release builds do not check) included."""
    return ((f + _MAGIC).view(np.int32) & 0x007FFFFF) - 0x00400000


def _fp32_to_fp16(f: np.ndarray) -> np.ndarray:
    """``ggml_compute_fp32_to_fp16`` (ggml-impl.h), bit for bit: float32 -> the uint16 bits of a half."""
    f = np.ascontiguousarray(f, dtype=_F32)
    base = (np.abs(f) * _F32(2.0**112)) * _F32(2.0**-110)
    w = f.view(np.uint32)
    shl1_w = w + w
    sign = w & np.uint32(0x80000000)
    bias = np.maximum(shl1_w & np.uint32(0xFF000000), np.uint32(0x71000000))
    base = ((bias >> np.uint32(1)) + np.uint32(0x07800000)).view(_F32) + base
    bits = base.view(np.uint32)
    nonsign = ((bits >> np.uint32(13)) & np.uint32(0x00007C00)) + (bits & np.uint32(0x00000FFF))
    out = (sign >> np.uint32(16)) | np.where(shl1_w > np.uint32(0xFF000000), np.uint32(0x7E00), nonsign)
    return out.astype(np.uint16)


def _fp16_to_fp32(h: np.ndarray) -> np.ndarray:
    """``ggml_compute_fp16_to_fp32``: exact (a half widens to float32 without rounding)."""
    return h.view(np.float16).astype(_F32)


def _seqsum(a: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """``s = 0; for (i...) s += a[i]`` over the first axis, in float32 and in that order (the C's order: numpy's
    own sums are pairwise, which rounds differently)."""
    acc = (a[0] + _F32(0)) if start is None else (start + a[0])
    for i in range(1, a.shape[0]):
        acc += a[i]
    return acc


def _seqmax(a: np.ndarray, b: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``m = 0; v = 0; for (i...) if (a[i] > m) { m = a[i]; v = b[i]; }`` over the first axis: the running maximum
    (the first of equal ones winning, NaN never) and ``b`` where it was found (``b`` defaults to ``a``)."""
    b = a if b is None else b
    m = np.zeros(a.shape[1:], dtype=a.dtype)
    v = np.zeros(a.shape[1:], dtype=b.dtype)
    for i in range(a.shape[0]):
        upd = a[i] > m
        m = np.where(upd, a[i], m)
        v = np.where(upd, b[i], v)
    return m, v


def _levels(t: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(t)))`` in place: ``t`` (float32 scratch) turns into the int32 levels, which
    are returned as a view of it."""
    t += _MAGIC
    li = t.view(np.int32)
    li &= 0x007FFFFF
    li -= 0x00400000
    np.clip(li, lo, hi, out=li)
    return li


def _make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad=false)`` over many
    groups at once. ``x`` and ``w`` are ``(n, G)``: row ``i`` holds element ``i`` of every group, so the C's
    sequential sums are ``n`` contiguous adds. Returns ``(scale, the_min, L)`` with ``L`` ``(n, G)`` int32."""
    f_nmax = _F32(nmax)
    mn = x[0].copy()  # if (x[i] < min) min = x[i]; if (x[i] > max) max = x[i]; (a NaN never replaces)
    mx = x[0].copy()
    for i in range(1, x.shape[0]):
        np.copyto(mn, x[i], where=x[i] < mn)
        np.copyto(mx, x[i], where=x[i] > mx)
    t = np.empty_like(x)  # scratch, then the levels (as int32, in place)
    lf = np.empty_like(x)  # the levels as float
    wl = np.empty_like(x)
    tmp = np.empty_like(x)
    np.multiply(w, x, out=tmp)
    sum_w = _seqsum(w[1:], start=w[0])  # sum_w = weights[0]; sum_x = sum_w * x[0]; then += from i = 1
    sum_x = _seqsum(tmp[1:], start=tmp[0])
    mn[mn > 0] = 0
    flat = mx == mn
    flat_min = mn.copy()

    iscale = f_nmax / (mx - mn)
    scale = _F32(1) / iscale
    np.subtract(x, mn, out=t)
    t *= iscale
    L = _levels(t, 0, nmax).copy()
    lf[...] = L
    # diff = scale * L[i] + min - x[i]; best_error += w * diff * diff
    np.multiply(lf, scale, out=tmp)
    tmp += mn
    tmp -= x
    tmp *= tmp
    tmp *= w
    best_error = _seqsum(tmp)
    for step in range(nstep + 1):
        iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + f_nmax) / (mx - mn)
        np.subtract(x, mn, out=t)
        t *= iscale
        laux = _levels(t, 0, nmax)
        lf[...] = laux
        np.multiply(w, lf, out=wl)
        sum_l = _seqsum(wl)
        np.multiply(wl, lf, out=tmp)
        sum_l2 = _seqsum(tmp)
        np.multiply(wl, x, out=tmp)
        sum_xl = _seqsum(tmp)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clamp = this_min > 0
        this_min[clamp] = 0
        this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        np.multiply(lf, this_scale, out=tmp)
        tmp += this_min
        tmp -= x
        tmp *= tmp
        tmp *= w
        cur_error = _seqsum(tmp)
        upd = (D > 0) & (cur_error < best_error)
        np.copyto(L, laux, where=upd)
        best_error = np.where(upd, cur_error, best_error)
        scale = np.where(upd, this_scale, scale)
        mn = np.where(upd, this_min, mn)
    # max == min: L = 0, the_min = -min, scale 0 (the C returns before any of the above)
    L[:, flat] = 0
    scale = np.where(flat, _F32(0), scale)
    return scale, -np.where(flat, flat_min, mn), L


def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL)`` over many groups (``x`` ``(n, G)`` as above).
    Returns ``(scale, L)``, ``L`` holding ``nmax + l`` (int32)."""
    amax, mx = _seqmax(np.abs(x), x)
    zero = amax < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    t = np.empty_like(x)
    lf = np.empty_like(x)
    tmp = np.empty_like(x)

    def attempt(iscale):  # l = MAX(-nmax, MIN(nmax-1, nearest_int(iscale*x[i]))); sumlx += w*x[i]*l; suml2 += w*l*l
        np.multiply(x, iscale, out=t)
        levels = _levels(t, -nmax, nmax - 1)
        lf[...] = levels
        np.multiply(wx, lf, out=tmp)
        sumlx = _seqsum(tmp)
        np.multiply(w, lf, out=tmp)
        np.multiply(tmp, lf, out=tmp)
        return levels, sumlx, _seqsum(tmp)

    levels, sumlx, suml2 = attempt(_F32(-nmax) / mx)
    L = levels + nmax
    scale = np.where(suml2 != 0, sumlx / suml2, _F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        levels, sumlx, suml2 = attempt(-(_F32(nmax) + _F32(0.1) * _F32(step)) / mx)
        upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels += nmax
        np.copyto(L, levels, where=upd)
        scale = np.where(upd, sumlx / suml2, scale)
        best = np.where(upd, scale * sumlx, best)
    L[:, zero] = 0
    return np.where(zero, _F32(0), scale), L


def _quantize(rows: np.ndarray, kind: str, quantize_blocks, numba: bool = True) -> np.ndarray:
    """Rows ``(n, k)`` -> ``(n, k // 256 * block bytes)``: by the numba kernels where numba imports and ``numba``,
    else by the numpy port ``quantize_blocks``, the super-blocks quantized a chunk at a time."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] % QK_K:
        raise ValueError(f"rows must be a 2-D array whose rows are a multiple of {QK_K} long, not {rows.shape}")
    blocks = np.ascontiguousarray(rows, dtype=_F32).reshape(-1, QK_K)
    if numba and numba_kernels is not None:
        out = numba_kernels.quantize_blocks(blocks, kind)
        return out.reshape(rows.shape[0], rows.shape[1] // QK_K * BLOCK_BYTES[kind])
    out = np.empty((blocks.shape[0], BLOCK_BYTES[kind]), dtype=np.uint8)
    with np.errstate(all="ignore"):  # the C divides by zero and overflows too; the lanes it would skip are masked
        for start in range(0, blocks.shape[0], _CHUNK):
            out[start : start + _CHUNK] = quantize_blocks(blocks[start : start + _CHUNK])
    return out.reshape(rows.shape[0], rows.shape[1] // QK_K * BLOCK_BYTES[kind])


# ---------------------------------------------------------------------------------------------------------------------
# Q4_K and Q5_K: quantize_row_q4_K_ref / quantize_row_q5_K_ref
# ---------------------------------------------------------------------------------------------------------------------


def _q45_scales(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """The part Q4_K and Q5_K share: per 32-value group the weighted min/scale search, the 6-bit scales and mins,
    and the final per-value levels. ``x`` is ``(B, 256)``; returns ``(d, dmin, packed scales (B, 12), L (B, 256))``."""
    B = x.shape[0]
    xt = np.ascontiguousarray(x.reshape(B * 8, 32).T)  # (32, groups)
    sum_x2 = _seqsum(xt * xt)
    av_x = np.sqrt(sum_x2 / _F32(32))
    weights = av_x + np.abs(xt)
    scales, mins, Lt = _make_qkx2_quants(xt, weights, nmax, rmin, 0.1, nstep)
    scales = scales.reshape(B, 8)
    mins = mins.reshape(B, 8)
    L = np.ascontiguousarray(Lt.T).reshape(B, 256)

    max_scale, _ = _seqmax(scales.T)
    max_min, _ = _seqmax(mins.T)
    inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
    inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    # uint8_t ls = nearest_int(...); ls = MIN(63, ls): the int wraps to 8 bits first
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.empty((B, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    d = _fp32_to_fp16(max_scale / _F32(63))
    dmin = _fp32_to_fp16(max_min / _F32(63))

    # get_scale_min_k4 gives back ls and lm (6 bits each) unchanged
    dq = _fp16_to_fp32(d)[:, None] * ls.astype(_F32)  # (B, 8)
    dmq = _fp16_to_fp32(dmin)[:, None] * lm.astype(_F32)
    xg = x.reshape(B, 8, 32)
    requant = np.clip(_nearest_int((xg + dmq[:, :, None]) / dq[:, :, None]), 0, nmax)
    L = np.where((dq != 0)[:, :, None], requant, L.reshape(B, 8, 32)).reshape(B, 256)  # if (!d) continue;
    return d, dmin, packed, L


def _q4_k_blocks(x: np.ndarray) -> np.ndarray:
    d, dmin, packed, L = _q45_scales(x, 15, -1.0, 20)
    B = x.shape[0]
    out = np.empty((B, 144), dtype=np.uint8)
    out[:, 0:2] = d.astype("<u2").view(np.uint8).reshape(B, 2)
    out[:, 2:4] = dmin.astype("<u2").view(np.uint8).reshape(B, 2)
    out[:, 4:16] = packed
    L = L.reshape(B, 4, 2, 32).astype(np.uint8)  # 64 values per 32 bytes: low nibble first 32, high the next 32
    out[:, 16:144] = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(B, 128)
    return out


def _q5_k_blocks(x: np.ndarray) -> np.ndarray:
    d, dmin, packed, L = _q45_scales(x, 31, -0.5, 15)
    B = x.shape[0]
    out = np.empty((B, 176), dtype=np.uint8)
    out[:, 0:2] = d.astype("<u2").view(np.uint8).reshape(B, 2)
    out[:, 2:4] = dmin.astype("<u2").view(np.uint8).reshape(B, 2)
    out[:, 4:16] = packed
    L = L.reshape(B, 4, 2, 32).astype(np.uint8)
    high = (L >> 4).astype(np.uint8)  # bit 4 of each level, into qh: bit 2c (first 32) and 2c+1 (next 32) of byte j
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    qh = np.bitwise_or.reduce((high[:, :, 0] << shifts) | (high[:, :, 1] << (shifts + 1)), axis=1)
    out[:, 16:48] = qh
    low = L & 0xF
    out[:, 48:176] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(B, 128)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Q6_K: quantize_row_q6_K_ref
# ---------------------------------------------------------------------------------------------------------------------


def _q6_k_blocks(x: np.ndarray) -> np.ndarray:
    B = x.shape[0]
    xt = np.ascontiguousarray(x.reshape(B * 16, 16).T)  # (16, groups)
    scales, Lt = _make_qx_quants_rmse1(xt, 32)
    scales = scales.reshape(B, 16)
    L = np.ascontiguousarray(Lt.T).reshape(B, 16, 16)

    max_abs, max_scale = _seqmax(np.abs(scales.T), scales.T)
    zero = max_abs < _GROUP_MAX_EPS

    iscale = _F32(-128) / max_scale
    d = _fp32_to_fp16(_F32(1) / iscale)
    # int8_t scales[ib] = MIN(127, nearest_int(...)): the int wraps to 8 bits
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    dq = _fp16_to_fp32(d)[:, None] * sc.astype(_F32)  # (B, 16)
    xg = x.reshape(B, 16, 16)
    requant = np.clip(_nearest_int(xg / dq[:, :, None]), -32, 31) + 32
    L = np.where((dq != 0)[:, :, None], requant, L).reshape(B, 2, 4, 32).astype(np.uint8)  # if (!d) continue;

    out = np.empty((B, 210), dtype=np.uint8)
    low = L & 0xF
    # per half of 128 values: ql[l] = q1 | q3 << 4, ql[l + 32] = q2 | q4 << 4 (q1..q4 the four runs of 32)
    out[:, 0:128] = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(B, 128)
    high = L >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out[:, 128:192] = qh.reshape(B, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.astype("<u2").view(np.uint8).reshape(B, 2)
    out[zero] = 0  # memset(&y[i], 0, sizeof(block_q6_K)); d = fp16(0) is 0 too
    return out


# ---------------------------------------------------------------------------------------------------------------------
# public quantizers
# ---------------------------------------------------------------------------------------------------------------------


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Quantize rows to GGUF Q4_K exactly as llama.cpp's ``quantize_row_q4_K_ref`` (ggml-quants.c) does: what
    llama-quantize writes for a Q4_K tensor when no importance matrix is given. Runs the numba kernels
    (:mod:`~peft_shardmerge.output.gguf_kquants_numba`, every numba thread) where numba is installed, else numpy.

    Args:
        rows: ``(n, k)`` values (made float32, as llama.cpp dequantizes F16/BF16 to float32 before quantizing),
            ``k`` a multiple of 256.

    Returns:
        ``(n, k // 256 * 144)`` uint8: per 256 values, the half ``d`` and ``dmin``, 12 bytes of 6-bit scales and
        mins, and 128 bytes of 4-bit levels (``block_q4_K``).

    Example:
        >>> import numpy as np
        >>> q = quantize_q4_k(np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256))
        >>> q.shape, q.dtype.name
        ((2, 144), 'uint8')
    """
    return _quantize(rows, "Q4_K", _q4_k_blocks)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    """Quantize rows to GGUF Q5_K exactly as llama.cpp's ``quantize_row_q5_K_ref`` does.

    Args:
        rows: ``(n, k)`` values (made float32), ``k`` a multiple of 256.

    Returns:
        ``(n, k // 256 * 176)`` uint8 (``block_q5_K``: ``d``, ``dmin``, 12 bytes of scales and mins, 32 bytes of
        fifth bits, 128 bytes of low nibbles).

    Example:
        >>> import numpy as np
        >>> quantize_q5_k(np.zeros((3, 256), dtype=np.float32)).shape
        (3, 176)
    """
    return _quantize(rows, "Q5_K", _q5_k_blocks)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Quantize rows to GGUF Q6_K exactly as llama.cpp's ``quantize_row_q6_K_ref`` does.

    Args:
        rows: ``(n, k)`` values (made float32), ``k`` a multiple of 256.

    Returns:
        ``(n, k // 256 * 210)`` uint8 (``block_q6_K``: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
        scales, the half ``d``).

    Example:
        >>> import numpy as np
        >>> quantize_q6_k(np.ones((1, 512), dtype=np.float32)).shape
        (1, 420)
    """
    return _quantize(rows, "Q6_K", _q6_k_blocks)


# ---------------------------------------------------------------------------------------------------------------------
# the type of each tensor: llama-quant.cpp, llama_tensor_get_type and what it calls
# ---------------------------------------------------------------------------------------------------------------------

#: ``llama_ftype_get_default_type``: the type most tensors get, per file type (llama-quantize's names, lowercase)
FTYPES = {
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q5_0": "Q5_0",
    "q5_1": "Q5_1",
    "q8_0": "Q8_0",
    "q4_k_s": "Q4_K",
    "q4_k_m": "Q4_K",
    "q5_k_s": "Q5_K",
    "q5_k_m": "Q5_K",
    "q6_k": "Q6_K",
}

#: ``ggml_blck_size``
_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}

#: substrings that keep a tensor unquantized (``tensor_allows_quantization``), after its n_dims/"weight"/norm checks
_NOT_QUANTIZED = (
    "ffn_gate_inp.weight",  # expert gating (router)
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    *(f"time_mix_{t}.weight" for t in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2")),
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)

#: ``llama_model::type == LLM_TYPE_70B`` (only that size matters to the choice): architecture -> block count
_70B_LAYERS = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}


def _category(name: str) -> str:
    """``tensor_get_category``: the first of these substrings a name holds (order matters: ``attn_qkv`` before
    ``attn_v``, ``ffn_up`` before ``ffn_gate`` before ``ffn_down``)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (
        ("attn_qkv.weight", "attn_qkv"),
        ("attn_kv_b.weight", "attn_kv_b"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if key in name:
            return cat
    return "other"


def _layer_of(name: str) -> int:
    """``sscanf(name, "blk.%d.", &layer)``, -1 where the name has no layer (``weight_name_comparer``)."""
    m = re.match(r"blk\.\s*([+-]?\d+)", name)
    return int(m.group(1)) if m else -1


def _n_dims(shape: tuple[int, ...]) -> int:
    """``ggml_n_dims``: 1 + the last axis longer than 1."""
    return max((i + 1 for i, n in enumerate(shape) if n > 1), default=1)


def _allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """``tensor_allows_quantization`` with llama-quantize's defaults (``quantize_output_tensor``, no
    ``only_copy``; GLM5-next's own exclusions left out)."""
    if _n_dims(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return False
    if name in ("position_embd.weight", "token_types.weight"):  # LLM_TN(arch)(POS_EMBD / TOKEN_TYPES, "weight")
        return False
    return not any(key in name for key in _NOT_QUANTIZED)


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The ``use_more_bits`` lambda: the first and last eighth of the layers, and every third one between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or math.fmod(i_layer - n_layers // 8, 3) == 2


def kquant_tensor_types(
    ftype: str,
    tensors: Iterable[tuple[str, tuple[int, ...]]],
    n_layer: int,
    n_expert: int = 0,
    *,
    arch: str = "llama",
    n_head: int | None = None,
    n_head_kv: int | None = None,
    source_types: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The GGML type llama.cpp's ``llama-quantize`` (no importance matrix, no overrides) gives each tensor of a
    model for a file type: a port of ``llama_tensor_get_type`` (src/llama-quant.cpp) for the rules the file types
    below reach, with the counters it keeps over the tensors in llama.cpp's order (layer number, then name).

    Args:
        ftype: the file type, llama-quantize's name in any case: ``q4_k_m``, ``q4_k_s``, ``q5_k_m``, ``q5_k_s``,
            ``q6_k``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q8_0``.
        tensors: every tensor of the GGUF file, as ``(name, shape)`` with GGUF names (``blk.3.attn_v.weight``)
            and GGUF shapes (``ne``: the row length first, the reverse of numpy's shape).
        n_layer: the model's block count (``{arch}.block_count``).
        n_expert: its expert count (``{arch}.expert_count``; 0 for a dense model).
        arch: ``general.architecture`` (``llama`` for Mistral and Mixtral too); ``falcon`` has rules of its own,
            and a 70B-sized model (llama/qwen2 with 80 blocks) gets Q5_K ``attn_v`` where it would get Q4_K.
        n_head: ``{arch}.attention.head_count``; only needed for an 80-block ``llama`` (70B with grouped-query
            attention, 65B without).
        n_head_kv: ``{arch}.attention.head_count_kv``, likewise.
        source_types: the types of the tensors in the unquantized GGUF llama-quantize reads; those it does not
            quantize (1-D tensors, norms, expert routers, ...) keep theirs. Default: F32 for all of them, which is
            what llama.cpp's converter writes for each of these in the architectures above.

    Returns:
        name -> type name as ``gguf.GGMLQuantizationType`` spells it (``Q4_K``, ``Q6_K``, ``Q8_0``, ``F32``, ...).

    Example:
        >>> types = kquant_tensor_types(
        ...     "q4_k_m",
        ...     [("token_embd.weight", (256, 1000)), ("output_norm.weight", (256,))]
        ...     + [(f"blk.{i}.attn_v.weight", (256, 64)) for i in range(8)],
        ...     n_layer=8,
        ... )
        >>> types["token_embd.weight"], types["output_norm.weight"], types["blk.0.attn_v.weight"]
        ('Q6_K', 'F32', 'Q6_K')
        >>> [types[f"blk.{i}.attn_v.weight"] for i in range(1, 8)]
        ['Q4_K', 'Q4_K', 'Q6_K', 'Q4_K', 'Q4_K', 'Q6_K', 'Q6_K']
    """
    ftype = ftype.lower()
    if ftype not in FTYPES:
        raise ValueError(f"unknown file type {ftype!r}: one of {', '.join(FTYPES)}")
    default = FTYPES[ftype]
    tensors = [(name, tuple(int(n) for n in shape)) for name, shape in tensors]
    falcon = arch == "falcon"
    moe8 = n_expert == 8  # hparams.n_expert == 8 (Mixtral): its own rules
    if arch == "llama" and n_layer == 80 and n_expert != 8 and (n_head is None or n_head_kv is None):
        raise ValueError("an 80-block llama model needs n_head and n_head_kv (70B and 65B get different types)")
    is_70b = _70B_LAYERS.get(arch) == n_layer and (arch != "llama" or (n_expert != 8 and n_head != n_head_kv))

    # init_quantize_state_counters: over every tensor of the file
    categories = {name: _category(name) for name, _ in tensors}
    n_attention_wv = sum(cat in ("attn_v", "attn_qkv", "attn_kv_b") for cat in categories.values())
    tied = "output" not in categories.values()  # has_tied_embeddings: until output.weight is seen
    n_ffn_down = n_layer  # qs.n_ffn_down = hparams.n_layer_all
    i_attention_wv = i_ffn_down = 0

    types: dict[str, str] = {}
    # llama_model_loader::weights_map order (weight_name_comparer): layer number (-1 without), then the name
    for name, shape in sorted(tensors, key=lambda t: (_layer_of(t[0]), t[0])):
        if not _allows_quantization(name, shape):
            types[name] = (source_types or {}).get(name, "F32")
            continue
        cat = categories[name]
        new = default
        # --- llama_tensor_get_type_impl, the branches these file types reach ---
        if cat == "output" or (tied and cat == "token_embd"):
            # the output (or the token embeddings it shares): Q6_K unless Q8_0 or the rows do not fit the default
            if falcon or shape[0] % _BLOCK[new]:
                new = "Q8_0"
            elif new != "Q8_0":
                new = "Q6_K"
        elif cat == "token_embd":
            pass  # untied token embeddings: only the IQ/TQ file types change them
        elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):  # category_is_attn_v (attn_qkv never reaches its own branch)
            if ftype in ("q4_k_m", "q5_k_m") and _use_more_bits(i_attention_wv, n_attention_wv):
                new = "Q6_K"
            elif ftype == "q4_k_s" and i_attention_wv < 4:
                new = "Q5_K"
            if is_70b and new in ("Q3_K", "Q4_K"):
                new = "Q5_K"
            if moe8:
                new = "Q8_0"
            i_attention_wv += 1
        elif cat == "attn_k":
            if moe8:
                new = "Q8_0"
        elif cat == "ffn_down":
            # layer_info: with experts the layer comes from the name, else from the counter
            i_layer = i_ffn_down
            if max(1, n_expert) > 1:
                i_layer = _layer_of(name)
                if not 0 <= i_layer < n_ffn_down:
                    raise ValueError(f"bad layer {i_layer} for tensor {name}: must be in [0, {n_ffn_down})")
            if ftype == "q4_k_m":
                if falcon:
                    new = (
                        "Q6_K"
                        if i_layer < n_ffn_down // 16
                        else "Q5_K"
                        if _use_more_bits(i_layer, n_ffn_down)
                        else "Q4_K"
                    )
                elif _use_more_bits(i_layer, n_ffn_down):
                    new = "Q6_K"
            elif ftype == "q5_k_m" and _use_more_bits(i_layer, n_ffn_down):
                new = "Q6_K"
            elif ftype == "q4_k_s" and not falcon and i_layer < n_ffn_down // 8:
                new = "Q5_K"
            # (q4_0 / q5_0 change here only with an importance matrix)
            i_ffn_down += 1
        elif cat == "attn_output":
            if not falcon and moe8 and ftype in ("q4_k_s", "q4_k_m"):
                new = "Q5_K"
        # (attn_q, ffn_gate, ffn_up: only the IQ file types change them)

        # --- tensor_type_fallback: rows that do not fit the type's block ---
        ncols = shape[0]
        if ncols % _BLOCK[new]:
            new = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(new, new)
            if ncols % _BLOCK[new]:
                new = "F16"
        types[name] = new
    return types
