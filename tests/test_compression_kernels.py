"""The fused CPU kernels against their plain-torch fallbacks, and every compressor with and without them.

The fallbacks (what runs on GPU tensors, other dtypes, or without a C compiler) are checked against
the torch expressions they replace; the kernels, where this machine builds them, against the
fallbacks: bit for bit, ties at thresholds included (GaussianK's float64 mean/std to round-off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import COMPRESSORS, CompressedReducer, make_compressor
from dtlab.compression import kernels as K
from dtlab.testing import run_world

needs_native = pytest.mark.skipif(
    not K.native_enabled(),
    reason="native kernels off (no C compiler, or DTLAB_NATIVE_KERNELS=0 set): only the fallbacks run here",
)


def _both(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn()`` with the kernels, then with the torch fallbacks."""
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "1")
    native = fn()
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "0")
    plain = fn()
    monkeypatch.delenv("DTLAB_NATIVE_KERNELS")
    return native, plain


def _data(n: int = 20_011) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g) * torch.linspace(0.01, 3, n)
    x[::97] = 0.0
    x[5], x[7], x[8] = -0.0, 1e-42, -x[1000]  # signed zero, a subnormal, a tie in magnitude
    return x


def test_fallbacks_compute_what_they_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "0")
    x = _data()
    thr = float(x.abs()[1000])
    assert torch.equal(K.indices_above(x, thr), torch.nonzero(x.abs() >= thr).view(-1))
    assert torch.equal(K.indices_above(x, 0.0), torch.nonzero(x != 0).view(-1))
    y, out = torch.randn(x.numel()), torch.empty(x.numel())
    assert K.add_count_nonfinite(x, y, out) == 0 and torch.equal(out, x + y)
    bad, sel = K.add_select(x, y, out, 1.5, 10)
    assert bad == 0 and torch.equal(out, x + y)
    assert torch.equal(sel, torch.nonzero((x + y).abs() >= 1.5).view(-1))
    pos = torch.tensor([0, 5, 17, 5])
    assert torch.equal(K.gather_add_abs(x, y, pos), (x + y)[pos].abs())
    for native in ("1", "0"):  # zero_a: the first operand zeroed in the same pass, nothing else changes
        monkeypatch.setenv("DTLAB_NATIVE_KERNELS", native)
        a, out2 = x.clone(), torch.empty(x.numel())
        bad2, sel2 = K.add_select(a, y, out2, 1.5, 10, zero_a=True)
        assert bad2 == 0 and torch.equal(out2, x + y) and torch.equal(sel2, sel) and not a.any()
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "0")
    y[3], y[4] = float("inf"), float("nan")
    assert K.add_count_nonfinite(x, y, out) == 2
    low = torch.empty(x.numel(), dtype=torch.float16)
    res = x.clone()
    K.cast_with_residual(res, 2, low)
    assert torch.equal(low, (x / 2).half()) and torch.equal(res, x - low.float() * 2)
    dense = torch.randn(50)
    K.write_sparse(dense, torch.tensor([2, 40]), torch.tensor([1.5, -2.0]))
    assert dense.count_nonzero() == 2 and dense[2] == 1.5 and dense[40] == -2.0
    a, b = torch.tensor([1, 4, 7, 9]), torch.tensor([0, 4, 9, 12])
    assert K.intersect_sorted(a, b).tolist() == [4, 9]
    uniq, sums = K.sum_sorted_runs(
        torch.tensor([1, 4, 0, 4, 9]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), [2, 3]
    )
    assert uniq.tolist() == [0, 1, 4, 9] and sums.tolist() == [3.0, 1.0, 6.0, 5.0]
    std, mean = K.std_mean(x)
    ref_std, ref_mean = torch.std_mean(x)
    assert std == float(ref_std) and mean == float(ref_mean)


def test_qsgd_fallback_is_unbiased_and_keeps_what_it_did_not_send(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "0")
    x = torch.full((512,), 0.3)
    norms = torch.linalg.vector_norm(x).view(1)
    codes = torch.empty(512, dtype=torch.int8)
    total = torch.zeros(512)
    for key in range(200):
        res = x.clone()
        K.qsgd_encode(res, 512, norms, 127, K.qsgd_noise_key(key), codes)
        decoded = codes.float() * (norms / 127)
        assert torch.allclose(res, x - decoded)  # the residual is exactly what was not sent
        total += decoded
    assert abs(float(total.mean()) / 200 - 0.3) < 0.3 * 0.01  # unbiased stochastic rounding


@needs_native
def test_kernels_equal_fallbacks_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _data()
    m = float(x.abs()[1000])
    below = float(np.nextafter(np.float32(m), np.float32(0)))
    # thresholds: exactly a value (ties), between two floats (rounded to float32 as torch compares), 0
    for thr in (m, below, m + 1e-12, m - 1e-12, 0.0, -1.0, 1e-42, 100.0):
        native, plain = _both(monkeypatch, lambda thr=thr: K.indices_above(x, thr, expected=7))
        assert torch.equal(native, plain), thr
    y = torch.randn(x.numel())
    y[3], y[9] = float("inf"), float("nan")
    for other in (y, torch.randn(x.numel())):
        native, plain = _both(
            monkeypatch, lambda o=other: (out := torch.empty(x.numel()), K.add_count_nonfinite(x, o, out))
        )
        assert native[1] == plain[1] and torch.equal(native[0].nan_to_num(), plain[0].nan_to_num())
        for thr in (m, below, 0.0, 100.0):  # the add fused with a selection; a small cap: a second pass
            for expected in (7, 20_000):
                (o_n, b_n, i_n), (o_p, b_p, i_p) = _both(
                    monkeypatch,
                    lambda o=other, t=thr, e=expected: (
                        out := torch.empty(x.numel()),
                        *K.add_select(x, o, out, t, e),
                    ),
                )
                assert b_n == b_p and torch.equal(i_n, i_p), (thr, expected)
                assert torch.equal(o_n.nan_to_num(), o_p.nan_to_num())
    pos = torch.randint(0, x.numel(), (999,))
    native, plain = _both(monkeypatch, lambda: K.gather_add_abs(x, y, pos))
    assert torch.equal(native.nan_to_num(), plain.nan_to_num())
    a, b = torch.unique(torch.randint(0, 10**5, (5000,))), torch.unique(torch.randint(0, 10**5, (7000,)))
    native, plain = _both(monkeypatch, lambda: K.intersect_sorted(a, b))
    assert torch.equal(native, plain)
    pos = torch.randint(0, x.numel(), (999,))
    native, plain = _both(monkeypatch, lambda: K.gather_abs(x, pos))
    assert torch.equal(native, plain)
    idx = torch.unique(torch.randint(0, x.numel(), (300,)))
    native, plain = _both(
        monkeypatch, lambda: (o := torch.randn(x.numel()), K.write_sparse(o, idx, x[idx]))[0]
    )
    assert torch.equal(native, plain)
    native, plain = _both(monkeypatch, lambda: K.std_mean(x))
    assert native == pytest.approx(plain, rel=1e-6, abs=1e-9)
    z = torch.cat([x, torch.tensor([float("inf"), float("nan"), -float("inf"), 0.0])]).view(torch.int32)
    ref = int(x.abs()[1000:1001].view(torch.int32))  # a positive value's bits: the prefixes of a select
    for shift, prefix in ((24, 0), (16, ref & ~0xFFFF), (8, ref & ~0xFF), (0, ref)):
        native, plain = _both(monkeypatch, lambda s=shift, q=prefix: K.radix_histogram(z, s, q))
        assert torch.equal(native, plain) and int(native.sum()) > 0, shift
    assert int(K.radix_histogram(z, 24, 0).sum()) == int((z.view(torch.float32) > 0).sum())
    y = torch.randn(x.numel())
    (o_n, b_n, m_n), (o_p, b_p, m_p) = _both(
        monkeypatch, lambda: (out := torch.empty(x.numel()), *K.add_std_mean(x, y, out))
    )
    assert torch.equal(o_n, o_p) and b_n == b_p == 0 and m_n == pytest.approx(m_p, rel=1e-6, abs=1e-9)
    assert m_n == K.std_mean(x + y)  # the same float64 sums as the kernel's std_mean: bit for bit
    gen = torch.Generator().manual_seed(5)
    for runs in (1, 2, 3, 7):  # one sorted run per rank; common indices summed in rank order
        parts = [
            torch.unique(
                torch.randint(0, 300, (int(torch.randint(0, 90, (1,), generator=gen)),), generator=gen)
            )
            for _ in range(runs)
        ]
        idx, vals = torch.cat(parts), torch.randn(sum(q.numel() for q in parts), generator=gen)
        counts = [q.numel() for q in parts]
        (i_n, v_n), (i_p, v_p) = _both(
            monkeypatch, lambda i=idx, v=vals, c=counts: K.sum_sorted_runs(i, v, c)
        )
        assert torch.equal(i_n, i_p) and torch.equal(v_n, v_p)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_kernel_rounds_like_torch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    z = _data() * 1e3
    z[11], z[12], z[13], z[14] = 70_000.0, 1e-7, 6e-8, -2.9802322e-08  # overflow, subnormals, a tie
    for p in (1, 2, 3):

        def cast(p: int = p) -> tuple[torch.Tensor, torch.Tensor]:
            res, low = z.clone(), torch.empty(z.numel(), dtype=dtype)
            K.cast_with_residual(res, p, low)
            return low.view(torch.int16), res

        (low_n, res_n), (low_p, res_p) = _both(monkeypatch, cast)
        assert torch.equal(low_n, low_p) and torch.equal(res_n, res_p)
        assert torch.equal(low_n, (z / p).to(dtype).view(torch.int16))


@needs_native
@pytest.mark.parametrize(("n", "bucket"), [(20_011, 512), (1024, 512), (7, 4), (5, 16)])
def test_qsgd_kernels_equal_fallbacks(monkeypatch: pytest.MonkeyPatch, n: int, bucket: int) -> None:
    v = _data()[:n]
    nb = -(-n // bucket)
    padded = torch.zeros(nb * bucket)
    padded[:n] = v
    norms = torch.linalg.vector_norm(padded.view(nb, bucket), dim=1)

    def encode() -> tuple[torch.Tensor, int, torch.Tensor]:
        res, codes = v.clone(), torch.empty(nb * bucket, dtype=torch.int8)
        return codes, K.qsgd_encode(res, bucket, norms, 127, K.qsgd_noise_key(12345), codes), res

    (c_n, s_n, r_n), (c_p, s_p, r_p) = _both(monkeypatch, encode)
    assert torch.equal(c_n, c_p) and s_n == s_p and torch.equal(r_n, r_p)
    codes, all_norms = torch.cat([c_n, c_n.flip(0)]), torch.cat([norms, norms.flip(0)])

    def decode() -> tuple[torch.Tensor, int]:
        out = torch.empty(n)
        return out, K.qsgd_decode_mean(codes, all_norms, 2, bucket, 127, out)

    (d_n, z_n), (d_p, z_p) = _both(monkeypatch, decode)
    assert torch.equal(d_n, d_p) and z_n == z_p


def _steps(backend: CommunicationBackend, name: str) -> list[torch.Tensor]:
    comp = make_compressor(name, density=0.01, warmup_steps=1, tau=4, tau_prime=8, rank=2)
    red = CompressedReducer(backend, comp, dense_below=0)
    n, outs = 1 << 20, []  # large enough for the sampled pre-filter of the exact top-k
    for step in range(6):
        g = torch.Generator().manual_seed(backend.rank * 1009 + step)
        grad = torch.randn(n, generator=g) * torch.linspace(0.05, 1.0, n)
        red.all_reduce("g", grad).wait()
        outs.append(grad)
    res = red.error_feedback.residual("g")
    return [*outs, res if res is not None else torch.zeros(0)]


@needs_native
def test_every_compressor_steps_identically_with_and_without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two in-memory ranks, six steps (one dense, thresholds recomputed and reused): results and
    residuals bit-identical (GaussianK: its threshold comes from a float64 mean/std, so to round-off;
    PowerSGD: its kernels sum its products in another order than MKL, so to float32 round-off, 1e-5 of
    each tensor's largest magnitude; 1.2e-6 seen)."""
    names = [name for name in COMPRESSORS if name != "dense"]
    native, plain = _both(monkeypatch, lambda: {nm: run_world(2, _steps, nm) for nm in names})
    for name in names:
        for rank in range(2):
            for a, b in zip(native[name][rank], plain[name][rank], strict=True):
                if name == "gaussiank":
                    assert (a != b).sum() <= 4, name
                elif name == "powersgd":
                    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), rank
                else:
                    assert torch.equal(a, b), (name, rank)
    for x, y in zip(native["powersgd"][0][:-1], native["powersgd"][1][:-1], strict=True):
        assert torch.equal(x, y)  # both ranks run the same kernels: the same average, bit for bit


def _steps_with_jump(backend: CommunicationBackend, name: str) -> list[torch.Tensor]:
    """Seven steps; the gradient grows 20x at step 5 (one that reuses thresholds): Ok-Topk's reused
    threshold goes stale and its guard re-estimates it."""
    comp = make_compressor(name, density=0.01, warmup_steps=1, tau=3, tau_prime=6)
    red = CompressedReducer(backend, comp, dense_below=0)
    n, outs = (1 << 20) + 3, []
    for step in range(7):
        g = torch.Generator().manual_seed(backend.rank * 1009 + step)
        grad = torch.randn(n, generator=g) * torch.linspace(0.05, 1.0, n) * (20.0 if step >= 5 else 1.0)
        red.all_reduce("g", grad).wait()
        outs.append(grad)
    res = red.error_feedback.residual("g")
    return [*outs, res if res is not None else torch.zeros(0)]


def test_selection_made_in_the_error_feedback_pass_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The magnitude-selecting compressors ask the error-feedback pass to select for them
    (``prefilter``): results and residuals bit-identical to each compressor selecting on its own,
    on exact top-k and threshold-reusing iterations and when a stale threshold is re-estimated."""
    import dtlab.compression.error_feedback as ef

    names = ["topka", "topkdsa", "gtopk", "oktopk", "gaussiank"]
    fused: list[int] = []
    real_add_select, real_add_std_mean = ef.add_select, ef.add_std_mean

    def counting(*args: Any) -> Any:
        fused.append(1)
        return (real_add_select if len(args) > 3 else real_add_std_mean)(*args)

    monkeypatch.setattr(ef, "add_select", counting)
    monkeypatch.setattr(ef, "add_std_mean", counting)
    with_pass = {nm: run_world(2, _steps_with_jump, nm) for nm in names}
    assert len(fused) >= 2 * 5 * len(names)  # every compressed step after the first selected in the pass
    for name in names:
        monkeypatch.setattr(type(make_compressor(name)), "prefilter", lambda *_: None)
    alone = {nm: run_world(2, _steps_with_jump, nm) for nm in names}
    for name in names:
        for rank in range(2):
            for a, b in zip(with_pass[name][rank], alone[name][rank], strict=True):
                assert torch.equal(a, b), (name, rank)


def test_gaussiank_raises_its_threshold_as_step_by_step() -> None:
    """GaussianK finds the raised threshold by bisection over the repeated products: the same
    threshold and entries as raising it by 1.2% at a time (ties, step limits, nothing to raise)."""
    from dtlab.compression.gaussiank import LOWER, _raised

    def stepwise(idx: torch.Tensor, sel: torch.Tensor, thr: float, most: int, steps: int) -> Any:
        loops = 0
        while idx.numel() > most and loops < steps:
            thr *= LOWER
            keep = sel >= thr
            idx, sel, loops = idx[keep], sel[keep], loops + 1
        return idx, thr

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        sel = torch.rand(n, generator=g) * float(torch.rand(1, generator=g) * 5)
        sel[::7] = sel[0]
        most, steps = (
            int(torch.randint(0, n + 1, (1,), generator=g)),
            int(torch.randint(0, 60, (1,), generator=g)),
        )
        a = stepwise(torch.arange(n), sel, float(sel.min()), most, steps)
        b = _raised(torch.arange(n), sel, float(sel.min()), most, steps)
        assert torch.equal(a[0], b[0]) and a[1] == b[1]
