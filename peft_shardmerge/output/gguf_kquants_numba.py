"""llama.cpp's quantizers as numba kernels, bit-exact: the K-quants (``quantize_row_q4/5/6_K_ref`` of
``ggml-quants.c``) and Q8_0 (as gguf-py's numpy Q8_0, which the converter runs)."""

# ruff: noqa: E741 (the C's names are kept: ``l`` a level, ``L`` the levels)

# Line-by-line translations of the C: every float is a float32 (np.float32 constants, ints converted where the C
# converts them, so no expression widens to float64), no fastmath (no reassociation, no fused multiply-adds: LLVM
# fuses only what carries the ``contract`` flag, which numba sets with fastmath alone), and error_model="numpy" so a
# division by zero gives inf/NaN as in C instead of raising. The super-blocks are independent: prange over them.

from __future__ import annotations

import threading

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["quantize_blocks"]

QK_K = 256
#: super-blocks per prange iteration (each iteration allocates its own scratch, as the C's stack arrays)
_CHUNK = 16
_F32 = np.float32
_GROUP_MAX_EPS = _F32(1e-15)  # ggml-quants.c GROUP_MAX_EPS (1e-15f)

_jit = numba.njit(cache=True, error_model="numpy")
_jit_parallel = numba.njit(cache=True, error_model="numpy", parallel=True, nogil=True)
#: one kernel at a time: each already uses every numba thread, and numba's workqueue layer must not be re-entered
_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------------------------------
# bit casts (the C's memcpy / unions) and negation, as LLVM instructions
# ---------------------------------------------------------------------------------------------------------------------


@intrinsic
def _bits(typingctx, f):
    """``fp32_to_bits`` / ``memcpy(&i, &f, 4)``: a float32's 32 bits, as a non-negative int64."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


@intrinsic
def _from_bits(typingctx, w):
    """``fp32_from_bits``: the float32 whose bits are the low 32 bits of the integer ``w``."""
    if not isinstance(w, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        wide = context.cast(builder, args[0], sig.args[0], types.int64)
        return builder.bitcast(builder.trunc(wide, ir.IntType(32)), ir.FloatType())

    return types.float32(w), codegen


@intrinsic
def _fneg(typingctx, f):
    """C's unary minus on a float: flips the sign bit (NaN included; numba's ``-x`` is ``-0.0 - x``)."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fneg(args[0])

    return types.float32(types.float32), codegen


# ---------------------------------------------------------------------------------------------------------------------
# helpers of ggml-impl.h / ggml-quants.c
# ---------------------------------------------------------------------------------------------------------------------


@_jit
def _imin(a, b):
    """``MIN(a, b)`` on ints: ``((a) < (b) ? (a) : (b))``."""
    return a if a < b else b


@_jit
def _imax(a, b):
    """``MAX(a, b)`` on ints: ``((a) > (b) ? (a) : (b))``."""
    return a if a > b else b


@_jit
def _nearest_int(fval):
    """``nearest_int``: adds 1.5 * 2**23 in float32 and reads the low mantissa bits (its assert is compiled out)."""
    val = fval + _F32(12582912.0)
    i = _bits(val)
    return (i & 0x007FFFFF) - 0x00400000


@_jit
def _fp32_to_fp16(f):
    """``ggml_compute_fp32_to_fp16``: the bits of the half (an int in [0, 65536))."""
    scale_to_inf = _F32(2.0**112)  # 0x1.0p+112f
    scale_to_zero = _F32(2.0**-110)  # 0x1.0p-110f
    base = (abs(f) * scale_to_inf) * scale_to_zero

    w = _bits(f)
    shl1_w = (w + w) & 0xFFFFFFFF  # uint32_t arithmetic
    sign = w & 0x80000000
    bias = shl1_w & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000

    base = _from_bits((bias >> 1) + 0x07800000) + base
    bits = _bits(base)
    exp_bits = (bits >> 13) & 0x00007C00
    mantissa_bits = bits & 0x00000FFF
    nonsign = exp_bits + mantissa_bits
    return ((sign >> 16) | (0x7E00 if shl1_w > 0xFF000000 else nonsign)) & 0xFFFF  # ggml_fp16_t is uint16_t


@_jit
def _fp16_to_fp32(h):
    """``ggml_compute_fp16_to_fp32``: the float32 of a half's bits."""
    w = h << 16
    sign = w & 0x80000000
    two_w = (w + w) & 0xFFFFFFFF

    exp_offset = 0xE0 << 23
    exp_scale = _F32(2.0**-112)  # 0x1.0p-112f
    normalized_value = _from_bits((two_w >> 4) + exp_offset) * exp_scale

    magic_mask = 126 << 23
    magic_bias = _F32(0.5)
    denormalized_value = _from_bits((two_w >> 17) | magic_mask) - magic_bias

    denormalized_cutoff = 1 << 27
    result = sign | (_bits(denormalized_value) if two_w < denormalized_cutoff else _bits(normalized_value))
    return _from_bits(result)


@_jit
def _make_qkx2_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep):
    """``make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad=false)``: returns
    ``(scale, the_min)``, the levels in ``L``."""
    min_ = x[0]
    max_ = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < min_:
            min_ = x[i]
        if x[i] > max_:
            max_ = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if min_ > _F32(0):
        min_ = _F32(0)
    if max_ == min_:
        for i in range(n):
            L[i] = 0
        return _F32(0), _fneg(min_)
    iscale = _F32(nmax) / (max_ - min_)
    scale = _F32(1) / iscale
    best_error = _F32(0)
    for i in range(n):
        l = _nearest_int(iscale * (x[i] - min_))
        L[i] = _imax(0, _imin(nmax, l))
        diff = scale * _F32(L[i]) + min_ - x[i]
        diff = diff * diff
        w = weights[i]
        best_error += w * diff
    if nstep < 1:
        return scale, _fneg(min_)
    for is_ in range(nstep + 1):
        iscale = (rmin + rdelta * _F32(is_) + _F32(nmax)) / (max_ - min_)
        sum_l = _F32(0)
        sum_l2 = _F32(0)
        sum_xl = _F32(0)
        for i in range(n):
            l = _nearest_int(iscale * (x[i] - min_))
            l = _imax(0, _imin(nmax, l))
            Laux[i] = l
            w = weights[i]
            fl = _F32(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > _F32(0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > _F32(0):
                this_min = _F32(0)
                this_scale = sum_xl / sum_l2
            cur_error = _F32(0)
            for i in range(n):
                diff = this_scale * _F32(Laux[i]) + this_min - x[i]
                diff = diff * diff
                w = weights[i]
                cur_error += w * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                min_ = this_min
    return scale, _fneg(min_)


@_jit
def _make_qx_quants_rmse1(n, nmax, x, L):
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL)``: returns the scale, ``nmax + level`` in ``L``."""
    max_ = _F32(0)
    amax = _F32(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            max_ = x[i]
    if amax < _GROUP_MAX_EPS:  # all zero
        for i in range(n):
            L[i] = 0
        return _F32(0)
    iscale = _F32(-nmax) / max_
    sumlx = _F32(0)
    suml2 = _F32(0)
    for i in range(n):
        l = _nearest_int(iscale * x[i])
        l = _imax(-nmax, _imin(nmax - 1, l))
        L[i] = l + nmax
        w = x[i] * x[i]
        fl = _F32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != _F32(0) else _F32(0)  # suml2 ? ... : 0.0f (NaN is true)
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = _fneg(_F32(nmax) + _F32(0.1) * _F32(is_)) / max_
        sumlx = _F32(0)
        suml2 = _F32(0)
        for i in range(n):
            l = _nearest_int(iscale * x[i])
            l = _imax(-nmax, _imin(nmax - 1, l))
            w = x[i] * x[i]
            fl = _F32(l)
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > _F32(0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                l = _nearest_int(iscale * x[i])
                L[i] = nmax + _imax(-nmax, _imin(nmax - 1, l))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@_jit
def _get_scale_min_k4(j, q):
    """``get_scale_min_k4``: the 6-bit scale and min of group ``j`` from the 12 packed bytes ``q``."""
    if j < 4:
        d = np.int64(q[j]) & 63
        m = np.int64(q[j + 4]) & 63
    else:
        d = (np.int64(q[j + 4]) & 0xF) | ((np.int64(q[j - 4]) >> 6) << 4)
        m = (np.int64(q[j + 4]) >> 4) | ((np.int64(q[j - 0]) >> 6) << 4)
    return d, m  # the uint8_t reads widened to int64 (numba would mix uint8 and int64 into float64)


# ---------------------------------------------------------------------------------------------------------------------
# one super-block: quantize_row_q4_K_ref / quantize_row_q5_K_ref / quantize_row_q6_K_ref's loop bodies
# ---------------------------------------------------------------------------------------------------------------------


@_jit
def _q45_scales(x, y, nmax, rmin, nstep, L, Laux, weights, mins, scales):
    """What Q4_K and Q5_K share, for the super-block ``x``: ``y[0:16]`` (``d``, ``dmin``, ``scales``) written and
    the levels in ``L``."""
    max_scale = _F32(0)  # as we are deducting the min, scales are always positive
    max_min = _F32(0)
    for j in range(QK_K // 32):
        sum_x2 = _F32(0)
        for l in range(32):
            sum_x2 += x[32 * j + l] * x[32 * j + l]
        av_x = np.sqrt(sum_x2 / _F32(32))
        for l in range(32):
            weights[l] = av_x + abs(x[32 * j + l])
        scales[j], mins[j] = _make_qkx2_quants(
            32, nmax, x[32 * j : 32 * j + 32], weights, L[32 * j : 32 * j + 32], Laux, rmin, _F32(0.1), nstep
        )
        scale = scales[j]
        if scale > max_scale:
            max_scale = scale
        min_ = mins[j]
        if min_ > max_min:
            max_min = min_

    inv_scale = _F32(63) / max_scale if max_scale > _F32(0) else _F32(0)
    inv_min = _F32(63) / max_min if max_min > _F32(0) else _F32(0)
    ysc = y[4:16]
    for j in range(QK_K // 32):
        ls = _nearest_int(inv_scale * scales[j]) & 0xFF  # uint8_t ls = nearest_int(...)
        lm = _nearest_int(inv_min * mins[j]) & 0xFF
        ls = _imin(63, ls)
        lm = _imin(63, lm)
        if j < 4:
            ysc[j] = ls
            ysc[j + 4] = lm
        else:
            ysc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            ysc[j - 4] |= (ls >> 4) << 6
            ysc[j - 0] |= (lm >> 4) << 6
    d = _fp32_to_fp16(max_scale / _F32(63))
    dmin = _fp32_to_fp16(max_min / _F32(63))
    y[0] = d & 0xFF  # little-endian ggml_fp16_t
    y[1] = d >> 8
    y[2] = dmin & 0xFF
    y[3] = dmin >> 8

    for j in range(QK_K // 32):
        sc, m = _get_scale_min_k4(j, ysc)
        d_ = _fp16_to_fp32(d) * _F32(sc)
        if d_ == _F32(0):  # if (!d) continue;
            continue
        dm = _fp16_to_fp32(dmin) * _F32(m)
        for ii in range(32):
            l = _nearest_int((x[32 * j + ii] + dm) / d_)
            l = _imax(0, _imin(nmax, l))
            L[32 * j + ii] = l


@_jit
def _q4_k_block(x, y, L, Laux, weights, mins, scales):
    """``quantize_row_q4_K_ref``'s body: the 256 values ``x`` into the 144 bytes ``y``."""
    _q45_scales(x, y, 15, _F32(-1.0), 20, L, Laux, weights, mins, scales)
    q = y[16:144]
    for j in range(0, QK_K, 64):
        for l in range(32):
            q[l] = L[j + l] | (L[j + l + 32] << 4)
        q = q[32:]


@_jit
def _q5_k_block(x, y, L, Laux, weights, mins, scales):
    """``quantize_row_q5_K_ref``'s body: the 256 values ``x`` into the 176 bytes ``y``."""
    _q45_scales(x, y, 31, _F32(-0.5), 15, L, Laux, weights, mins, scales)
    qh = y[16:48]
    ql = y[48:176]
    qh[:] = 0  # memset(qh, 0, QK_K/8)

    m1 = 1
    m2 = 2
    for n in range(0, QK_K, 64):
        for j in range(32):
            l1 = np.int64(L[n + j])
            if l1 > 15:
                l1 -= 16
                qh[j] |= m1
            l2 = np.int64(L[n + j + 32])
            if l2 > 15:
                l2 -= 16
                qh[j] |= m2
            ql[j] = l1 | (l2 << 4)
        m1 <<= 2
        m2 <<= 2
        ql = ql[32:]


@_jit
def _q6_k_block(x, y, L, scales):
    """``quantize_row_q6_K_ref``'s body: the 256 values ``x`` into the 210 bytes ``y`` (``ql``, ``qh``,
    ``scales``, ``d``)."""
    max_scale = _F32(0)
    max_abs_scale = _F32(0)

    for ib in range(QK_K // 16):
        scale = _make_qx_quants_rmse1(16, 32, x[16 * ib : 16 * ib + 16], L[16 * ib : 16 * ib + 16])
        scales[ib] = scale

        abs_scale = abs(scale)
        if abs_scale > max_abs_scale:
            max_abs_scale = abs_scale
            max_scale = scale

    if max_abs_scale < _GROUP_MAX_EPS:
        y[:] = 0  # memset(&y[i], 0, sizeof(block_q6_K)); y[i].d = GGML_FP32_TO_FP16(0.f) is 0 too
        d = _fp32_to_fp16(_F32(0))
        y[208] = d & 0xFF
        y[209] = d >> 8
        return

    ysc = y[192:208]
    iscale = _F32(-128.0) / max_scale
    d = _fp32_to_fp16(_F32(1) / iscale)
    y[208] = d & 0xFF
    y[209] = d >> 8
    for ib in range(QK_K // 16):
        ysc[ib] = _imin(127, _nearest_int(iscale * scales[ib])) & 0xFF  # int8_t: the int wraps

    for j in range(QK_K // 16):
        sc = np.int64(ysc[j])
        if sc > 127:  # read back as int8_t
            sc -= 256
        d_ = _fp16_to_fp32(d) * _F32(sc)
        if d_ == _F32(0):
            continue
        for ii in range(16):
            l = _nearest_int(x[16 * j + ii] / d_)
            l = _imax(-32, _imin(31, l))
            L[16 * j + ii] = l + 32

    ql = y[0:128]
    qh = y[128:192]
    for j in range(0, QK_K, 128):
        for l in range(32):
            q1 = L[j + l + 0] & 0xF
            q2 = L[j + l + 32] & 0xF
            q3 = L[j + l + 64] & 0xF
            q4 = L[j + l + 96] & 0xF
            ql[l + 0] = q1 | (q3 << 4)
            ql[l + 32] = q2 | (q4 << 4)
            qh[l] = (
                (L[j + l] >> 4)
                | ((L[j + l + 32] >> 4) << 2)
                | ((L[j + l + 64] >> 4) << 4)
                | ((L[j + l + 96] >> 4) << 6)
            )
        ql = ql[64:]
        qh = qh[32:]


# ---------------------------------------------------------------------------------------------------------------------
# the kernels: super-blocks in parallel, _CHUNK per iteration
# ---------------------------------------------------------------------------------------------------------------------


@_jit_parallel
def _q4_k_kernel(blocks, out):
    nb = blocks.shape[0]
    for c in numba.prange((nb + _CHUNK - 1) // _CHUNK):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.uint8)
        weights = np.empty(32, np.float32)
        mins = np.empty(QK_K // 32, np.float32)
        scales = np.empty(QK_K // 32, np.float32)
        for i in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            _q4_k_block(blocks[i], out[i], L, Laux, weights, mins, scales)


@_jit_parallel
def _q5_k_kernel(blocks, out):
    nb = blocks.shape[0]
    for c in numba.prange((nb + _CHUNK - 1) // _CHUNK):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.uint8)
        weights = np.empty(32, np.float32)
        mins = np.empty(QK_K // 32, np.float32)
        scales = np.empty(QK_K // 32, np.float32)
        for i in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            _q5_k_block(blocks[i], out[i], L, Laux, weights, mins, scales)


@_jit_parallel
def _q6_k_kernel(blocks, out):
    nb = blocks.shape[0]
    for c in numba.prange((nb + _CHUNK - 1) // _CHUNK):
        L = np.empty(QK_K, np.uint8)
        scales = np.empty(QK_K // 16, np.float32)
        for i in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            _q6_k_block(blocks[i], out[i], L, scales)


@_jit_parallel
def _q8_0_kernel(blocks, out):
    """gguf-py's ``Q8_0.quantize_blocks``: ``d = max|x| / 127``, ``id = 1 / d`` (0 where ``d`` is), each value
    ``x * id`` rounded half away from zero (its ``np_roundf``), ``d`` stored as IEEE half (round to nearest even,
    as numpy's ``astype(float16)``, the C's ``GGML_FP32_TO_FP16``)."""
    nb = blocks.shape[0]
    for c in numba.prange((nb + _CHUNK * 16 - 1) // (_CHUNK * 16)):
        for i in range(c * _CHUNK * 16, min(nb, (c + 1) * _CHUNK * 16)):
            x = blocks[i]
            amax = _F32(0)
            for j in range(32):
                v = abs(x[j])
                if v > amax:
                    amax = v
            d = amax / _F32(127)
            inv = _F32(0) if d == _F32(0) else _F32(1) / d
            h = _fp32_to_fp16(d)
            out[i, 0] = h & 0xFF
            out[i, 1] = h >> 8
            for j in range(32):
                n = x[j] * inv
                a = abs(n)
                floored = np.floor(a)
                b = floored + np.floor(_F32(2) * (a - floored))
                q = int(b)
                out[i, 2 + j] = (-q if n < _F32(0) else q) & 0xFF


_KERNELS = {
    "Q4_K": (_q4_k_kernel, 144),
    "Q5_K": (_q5_k_kernel, 176),
    "Q6_K": (_q6_k_kernel, 210),
    "Q8_0": (_q8_0_kernel, 34),
}
#: values a block of each kind holds
BLOCK_VALUES = {"Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K, "Q8_0": 32}


def quantize_blocks(blocks: np.ndarray, kind: str) -> np.ndarray:
    """Quantize blocks as llama.cpp's ``quantize_row_<kind>_ref`` does (Q8_0: as gguf-py's numpy does, the same
    bytes), in parallel over the blocks (``numba.get_num_threads()`` threads; the first call of each type
    compiles, or loads the on-disk cache).

    Args:
        blocks: ``(n, 256)`` float32, C-contiguous: one super-block a row (``(n, 32)`` for Q8_0).
        kind: ``"Q4_K"``, ``"Q5_K"``, ``"Q6_K"`` or ``"Q8_0"``.

    Returns:
        ``(n, 144 | 176 | 210 | 34)`` uint8: one ``block_q4_K`` / ``block_q5_K`` / ``block_q6_K`` / ``block_q8_0``
        a row.

    Example:
        >>> import numpy as np
        >>> q = quantize_blocks(np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256), "Q6_K")
        >>> q.shape, q.dtype.name
        ((2, 210), 'uint8')
    """
    kernel, nbytes = _KERNELS[kind]
    size = BLOCK_VALUES[kind]
    if blocks.ndim != 2 or blocks.shape[1] != size or blocks.dtype != np.float32:
        raise ValueError(f"blocks must be (n, {size}) float32, not {blocks.shape} {blocks.dtype}")
    blocks = np.ascontiguousarray(blocks)
    out = np.empty((blocks.shape[0], nbytes), dtype=np.uint8)
    if blocks.shape[0]:
        with _LOCK:
            kernel(blocks, out)
    return out
