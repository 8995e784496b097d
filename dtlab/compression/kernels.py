"""Fused CPU kernels for the compressors' passes over a whole buffer, with plain-torch fallbacks.

On a CPU, a compressor's local work is a handful of passes over the gradient buffer (error-feedback
add, non-finite check, magnitude, threshold, compaction, quantization, casts, residual update), and
each torch op is one more pass through memory. The kernels here do several of those in one pass:

- :func:`add_count_nonfinite`: ``out = a + b`` and the number of non-finite values of ``out``;
- :func:`add_select`: the same, and in the same pass the indices :func:`indices_above` a threshold
  would return for ``out`` (the error-feedback add fused with a compressor's selection);
- :func:`indices_above`: sorted indices with ``|x| >= thr`` (``|x| > 0`` for ``thr <= 0``), without
  a magnitude buffer or a mask;
- :func:`write_sparse`: a sparse result written into a dense buffer in one sequential pass;
- :func:`sum_sorted_runs`: every rank's sorted entries merged and summed at common indices (no sort);
- :func:`std_mean`: GaussianK's mean and standard deviation in one float64 pass;
- :func:`add_std_mean`: :func:`add_count_nonfinite` and the :func:`std_mean` of the sum, one pass;
- :func:`intersect_sorted`: the common elements of two sorted index tensors, by a linear merge;
- :func:`radix_histogram`: one round of the distributed radix select, without the masks;
- :func:`qsgd_encode` / :func:`qsgd_decode_mean`: QSGD's stochastic quantization with the residual
  written in place, and the dequantized average of every rank's codes;
- :func:`cast_with_residual`: ``(x / p)`` in float16/bfloat16 with the residual written in place.

Each function returns exactly what its torch fallback returns (the same float32 operations in the
same order; comparisons against the float32-rounded threshold as torch's ``ge`` does; compiled with
``-ffp-contract=off``, so no fused multiply-add changes a rounding). The kernels are plain C
(:mod:`~dtlab.compression.kernel_source`), built once per machine and called through ``ctypes``
(:mod:`~dtlab.compression.native`). They run on contiguous CPU tensors of the expected dtypes;
everything else (GPU tensors, other dtypes, no compiler, ``DTLAB_NATIVE_KERNELS=0``) takes the torch
fallback, which the tests run against the kernels. PowerSGD's kernels are in
:mod:`~dtlab.compression.powersgd_kernels`.
"""

from __future__ import annotations

import ctypes
import math

import torch

from dtlab.compression.native import native, native_enabled

__all__ = [
    "add_count_nonfinite",
    "add_select",
    "add_std_mean",
    "cast_with_residual",
    "gather_abs",
    "gather_add_abs",
    "indices_above",
    "intersect_sorted",
    "native_enabled",
    "qsgd_decode_mean",
    "qsgd_encode",
    "qsgd_noise_key",
    "radix_histogram",
    "std_mean",
    "sum_sorted_runs",
    "write_sparse",
]


def add_count_nonfinite(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int:
    """``out = a + b`` (float32, same size) and the number of NaN/Inf values in ``out``."""
    lib = native(a, b, out)
    if lib is None or not a.dtype == b.dtype == out.dtype == torch.float32:
        torch.add(a, b, out=out)
        return 0 if bool(torch.isfinite(out.sum())) else int((~torch.isfinite(out)).sum())
    return int(lib.dt_add_count_nonfinite(a.data_ptr(), b.data_ptr(), out.data_ptr(), out.numel()))


def add_select(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, thr: float, expected: int = 0, zero_a: bool = False
) -> tuple[int, torch.Tensor]:
    """``out = a + b`` (float32, same size), the number of NaN/Inf values in ``out`` (as
    :func:`add_count_nonfinite`) and ``indices_above(out, thr, expected)``, in one pass over memory
    where the kernel runs (the fallback makes the two passes). ``zero_a``: ``a`` is zeroed too (in the
    same pass: a sparse result is then written into it by a scatter alone)."""
    lib = native(a, b, out)
    if lib is None or not a.dtype == b.dtype == out.dtype == torch.float32:
        bad = add_count_nonfinite(a, b, out)
        if zero_a:
            a.zero_()
        return bad, indices_above(out, thr, expected)
    n = out.numel()
    strict, t = (1, 0.0) if thr <= 0 else (0, float(thr))
    cap = min(n, max(1024, expected + expected // 4 + 1024))
    idx = torch.empty(cap, dtype=torch.int64)
    nonfinite = ctypes.c_int64(0)
    count = int(
        lib.dt_add_select(
            a.data_ptr(), b.data_ptr(), out.data_ptr(), n, t, strict, idx.data_ptr(), cap,
            ctypes.byref(nonfinite), int(zero_a),
        )
    )  # fmt: skip
    if count > cap:  # more than room was reserved for: one more pass over the result
        return int(nonfinite.value), indices_above(out, thr, count)
    return int(nonfinite.value), idx[:count]


def indices_above(x: torch.Tensor, thr: float, expected: int = 0) -> torch.Tensor:
    """Sorted int64 indices of the flat ``x`` with ``|x| >= thr``, or ``|x| > 0`` when ``thr <= 0``
    (the threshold rounded to float32, as torch compares). ``expected``: the count the caller expects;
    room for a bit more is reserved, and a second pass runs only when the count exceeds it."""
    flat = x.reshape(-1)
    lib = native(flat)
    if lib is None or flat.dtype != torch.float32:
        mags = flat.abs()
        return torch.nonzero(mags >= thr if thr > 0 else mags > 0).view(-1)
    n = flat.numel()
    strict, t = (1, 0.0) if thr <= 0 else (0, float(thr))
    cap = min(n, max(1024, expected + expected // 4 + 1024))
    out = torch.empty(cap, dtype=torch.int64)
    count = int(lib.dt_indices_above(flat.data_ptr(), n, t, strict, out.data_ptr(), cap))
    if count > cap:
        out = torch.empty(count, dtype=torch.int64)
        lib.dt_indices_above(flat.data_ptr(), n, t, strict, out.data_ptr(), count)
    return out[:count]


#: runs merged by the kernel at most (one per rank); more go to the sort-based fallback
MAX_RUNS = 64


def sum_sorted_runs(
    idx: torch.Tensor, vals: torch.Tensor, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique indices of ``idx`` and the float32 sums of their ``vals``, added in input order
    (as ``index_add_`` into zeros), where ``idx`` is ``len(counts)`` consecutive runs, each sorted
    ascending without repeats (one per rank). The kernel merges the runs (no sort); the fallback is
    ``torch.unique`` and ``index_add_``."""
    vals32 = vals.to(torch.float32)
    lib = native(idx, vals32)
    if lib is None or idx.dtype != torch.int64 or not 0 < len(counts) <= MAX_RUNS:
        uniq, inverse = torch.unique(idx, sorted=True, return_inverse=True)
        sums = torch.zeros(uniq.numel(), dtype=torch.float32, device=vals.device)
        sums.index_add_(0, inverse, vals32)
        return uniq, sums
    starts = torch.tensor([0, *counts], dtype=torch.int64).cumsum_(0)
    out_idx = torch.empty(idx.numel(), dtype=torch.int64)
    out_vals = torch.empty(idx.numel(), dtype=torch.float32)
    m = lib.dt_merge_runs(
        idx.data_ptr(),
        vals32.data_ptr(),
        starts.data_ptr(),
        len(counts),
        out_idx.data_ptr(),
        out_vals.data_ptr(),
    )
    return out_idx[:m], out_vals[:m]


def write_sparse(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``out`` (flat) becomes zero except ``out[indices] = values``; ``indices`` unique. The kernel
    (float32 ``out`` and ``values``, sorted int64 indices) writes ``out`` in one sequential pass."""
    flat = out.view(-1)
    lib = native(flat, indices, values)
    if (
        lib is None
        or flat.dtype != torch.float32
        or values.dtype != torch.float32
        or indices.dtype != torch.int64
        or not _sorted_in_range(indices, flat.numel())
    ):
        flat.zero_()
        flat.scatter_(0, indices, values.to(flat.dtype))
        return
    lib.dt_write_sparse(flat.data_ptr(), flat.numel(), indices.data_ptr(), values.data_ptr(), indices.numel())


def _sorted_in_range(indices: torch.Tensor, n: int) -> bool:
    if indices.numel() == 0:
        return True
    ok = int(indices[0]) >= 0 and int(indices[-1]) < n
    return ok and bool((indices[1:] > indices[:-1]).all())


def add_std_mean(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple[int, tuple[float, float]]:
    """``out = a + b`` (float32, same size), the number of NaN/Inf values in ``out`` and
    ``std_mean(out)``, in one pass where the kernel runs (the same sums as :func:`std_mean`'s)."""
    n = out.numel()
    lib = native(a, b, out)
    if lib is None or not a.dtype == b.dtype == out.dtype == torch.float32 or n < 2:
        return add_count_nonfinite(a, b, out), std_mean(out)
    sums = (ctypes.c_double * 2)()
    bad = int(lib.dt_add_sumsq(a.data_ptr(), b.data_ptr(), out.data_ptr(), n, ctypes.addressof(sums)))
    return bad, _std_mean_of(float(sums[0]), float(sums[1]), n)


def _std_mean_of(total: float, squares: float, n: int) -> tuple[float, float]:
    mean = total / n
    var = max(0.0, (squares - total * mean) / (n - 1))
    return math.sqrt(var), mean


def std_mean(x: torch.Tensor) -> tuple[float, float]:
    """Standard deviation (``n - 1`` in the denominator, 0 for one element) and mean of the flat
    ``x``. The kernel sums in float64 in one pass; the fallback is ``torch.std_mean`` (the two agree to
    float32 round-off, not bit for bit)."""
    flat = x.reshape(-1)
    n = flat.numel()
    lib = native(flat)
    if lib is None or flat.dtype != torch.float32 or n < 2:
        if n < 2:
            return 0.0, float(flat.mean())
        std_t, mean_t = torch.std_mean(flat)
        return float(std_t), float(mean_t)
    sums = (ctypes.c_double * 2)()
    lib.dt_sum_sumsq(flat.data_ptr(), n, ctypes.addressof(sums))
    return _std_mean_of(float(sums[0]), float(sums[1]), n)


def radix_histogram(bits: torch.Tensor, shift: int, prefix: int) -> torch.Tensor:
    """int64 counts of the 256 values of the byte at ``shift`` among the positive floats of ``bits``
    (float32 bit patterns as int32; NaN, zeros and negatives left out) whose bits above ``shift + 8``
    equal ``prefix``'s: one round of a radix select."""
    lib = native(bits)
    if lib is None or bits.dtype != torch.int32:
        bits = bits[(bits > 0) & (bits <= 0x7F800000)]
        if shift < 24:
            bits = bits[(bits >> (shift + 8)) == (prefix >> (shift + 8))]
        return torch.bincount(((bits >> shift) & 0xFF).to(torch.int64), minlength=256)
    hist = torch.empty(256, dtype=torch.int64)
    lib.dt_radix_hist(bits.data_ptr(), bits.numel(), shift, prefix, hist.data_ptr())
    return hist


def gather_abs(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x.view(-1)[positions].abs()`` (float32 ``x``, int64 positions in range)."""
    flat = x.reshape(-1)
    lib = native(flat, positions)
    if lib is None or flat.dtype != torch.float32 or positions.dtype != torch.int64:
        return flat[positions].abs()
    out = torch.empty(positions.numel(), dtype=torch.float32)
    lib.dt_gather_abs(flat.data_ptr(), positions.data_ptr(), positions.numel(), out.data_ptr())
    return out


def gather_add_abs(a: torch.Tensor, b: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(a[positions] + b[positions]).abs()`` (flat float32 ``a``, ``b``; int64 positions in range):
    ``|a + b|`` at a few positions before the sum is written."""
    lib = native(a, b, positions)
    if lib is None or not a.dtype == b.dtype == torch.float32 or positions.dtype != torch.int64:
        return (a[positions] + b[positions]).abs()
    out = torch.empty(positions.numel(), dtype=torch.float32)
    lib.dt_gather_add_abs(a.data_ptr(), b.data_ptr(), positions.data_ptr(), positions.numel(), out.data_ptr())
    return out


def intersect_sorted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elements of sorted ``a`` that also occur in sorted ``b`` (int64, no duplicates in ``a``)."""
    if a.numel() == 0 or b.numel() == 0:
        return a[:0]
    lib = native(a, b)
    if lib is None or not a.dtype == b.dtype == torch.int64:
        pos = torch.searchsorted(b, a).clamp_(max=b.numel() - 1)
        return a[b[pos] == a]
    out = torch.empty(min(a.numel(), b.numel()), dtype=torch.int64)
    count = lib.dt_intersect_sorted(a.data_ptr(), a.numel(), b.data_ptr(), b.numel(), out.data_ptr())
    return out[:count]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (multiplications split into 16-bit halves,
    so nothing overflows int64)."""
    for c in (0x7FEB352D, 0x846CA68B):
        x = x ^ (x >> 16) if c == 0x7FEB352D else x ^ (x >> 15)
        x = (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def qsgd_noise_key(seed: int) -> int:
    """The 32-bit key of QSGD's noise stream for one call (``seed``: any integer)."""
    return _mix32_int(_mix32_int(seed & 0xFFFFFFFF) ^ _mix32_int((seed >> 32) + 0x9E3779B9))


def qsgd_noise(count: int, key: int, device: torch.device) -> torch.Tensor:
    """Uniform ``[0, 1)`` float32 noise of element ``i``: ``(mix32(i ^ key) >> 8) * 2**-24``."""
    i = torch.arange(count, dtype=torch.int64, device=device)
    return (_mix32(i ^ key) >> 8).to(torch.float32) * 2.0**-24


def qsgd_encode(
    x: torch.Tensor, bucket: int, norms: torch.Tensor, levels: int, key: int, codes: torch.Tensor
) -> int:
    """int8 codes (into ``codes``, the padded length) of the flat float32 ``x`` (buckets of
    ``bucket``, the last zero-padded; ``norms`` the buckets' L2 norms) with noise :func:`qsgd_noise`;
    ``x`` becomes ``x - code * norm / levels`` (what was not sent). Returns how many codes are nonzero."""
    n, nb = x.numel(), norms.numel()
    lib = native(x, norms, codes)
    if lib is not None and x.dtype == norms.dtype == torch.float32:
        return int(
            lib.dt_qsgd_encode(x.data_ptr(), n, bucket, norms.data_ptr(), levels, key, codes.data_ptr())
        )
    padded = torch.zeros(nb * bucket, dtype=torch.float32, device=x.device)
    padded[:n] = x
    buckets = padded.view(nb, bucket)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    noise = qsgd_noise(nb * bucket, key, x.device).view(nb, bucket)
    level = torch.floor(buckets.abs() / safe[:, None] * float(levels) + noise).clamp_(max=levels)
    code = torch.sign(buckets) * level
    codes.copy_(code.view(-1))
    x.sub_((code * (norms[:, None] / float(levels))).view(-1)[:n])
    return int(torch.count_nonzero(codes))


def qsgd_decode_mean(
    codes: torch.Tensor, norms: torch.Tensor, p: int, bucket: int, levels: int, out: torch.Tensor
) -> int:
    """Write into ``out`` (``n`` float32) the average over ``p`` ranks of their dequantized codes
    (``codes``: ``p`` padded blocks in rank order, ``norms``: ``p`` blocks of bucket norms), first
    ``n`` elements of each block; returns how many elements of ``out`` are nonzero."""
    nb, n = norms.numel() // p, out.numel()
    lib = native(codes, norms, out)
    if lib is not None and codes.dtype == torch.int8 and norms.dtype == out.dtype == torch.float32:
        return int(
            lib.dt_qsgd_decode_mean(
                codes.data_ptr(), norms.data_ptr(), p, nb, bucket, n, levels, out.data_ptr()
            )
        )
    out.zero_()
    for r in range(p):
        c = codes[r * nb * bucket : (r + 1) * nb * bucket].view(nb, bucket).to(torch.float32)
        out += (c * (norms[r * nb : (r + 1) * nb, None] / float(levels))).view(-1)[:n]
    out.div_(float(p))
    return int(torch.count_nonzero(out))


def cast_with_residual(x: torch.Tensor, p: int, low: torch.Tensor) -> None:
    """Write ``(x / p)`` into ``low`` (float16 or bfloat16, ``x``'s size); the flat float32 ``x``
    becomes ``x - float32(low) * p``, the rounding error this rank keeps."""
    lib = native(x, low)
    if lib is not None and x.dtype == torch.float32 and low.dtype in (torch.float16, torch.bfloat16):
        lib.dt_cast_with_residual(
            x.data_ptr(), x.numel(), p, int(low.dtype == torch.bfloat16), low.data_ptr()
        )
        return
    low.copy_(x / p)
    x.sub_(low.to(torch.float32) * p)
