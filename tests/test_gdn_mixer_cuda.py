"""The fused CUDA mixer core against the portable path, on MLX's CUDA backend only:
the kernel against the portable formulas, and end to end through the real model
(`SLOTSERVE_FUSED_GDN=0` selects the portable ops), capture rows included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from gpu_paths import assert_as_close_as, on_cpu, two_steps

from engine.gated_delta import gated_delta, l2_normalize
from engine.kernels import gdn_mixer_cuda
from engine.kernels.cuda import available
from engine.models.batch import Layout
from engine.models.qwen35 import conv_tail

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("overrides", [{}, {"ssm_state_size": 128}, {"preset": "tiny-next"}])
def test_fused_mixer_matches_the_portable_path(
    make_model: Callable[..., Path], overrides: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused and portable paths against the CPU, without and with capture rows."""
    path = make_model("tiny", quant="f32", **overrides)
    cpu = on_cpu(path)
    monkeypatch.setenv("SLOTSERVE_FUSED_GDN", "0")
    portable = two_steps(path, capture=True)
    monkeypatch.setenv("SLOTSERVE_FUSED_GDN", "1")
    assert_as_close_as(two_steps(path), portable, cpu)
    assert_as_close_as(two_steps(path, capture=True), portable, cpu)


@pytest.mark.parametrize(
    ("lengths", "Hk", "Hv", "dk"),
    [
        ((1,), 2, 4, 16),
        ((3, 1, 2), 2, 4, 16),
        ((1,), 2, 4, 64),
        ((3, 2), 2, 4, 128),
        ((2, 2), 16, 32, 128),
        ((1, 1, 1, 1), 16, 16, 128),
    ],
)
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("fused_ba", [True, False])
@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("warps", ["", "8", "1"])  # "": by the launch's size (16 or 8)
def test_kernel_matches_the_portable_ops(
    lengths: tuple[int, ...],
    Hk: int,
    Hv: int,
    dk: int,
    tiled: bool,
    fused_ba: bool,
    capture: bool,
    warps: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(gdn_mixer_cuda.WARPS_ENV, warps)
    dv, Kc, eps = dk, 4, 1e-6
    Cq, B = Hk * dk, len(lengths)
    Cc, Cv, r = 2 * Cq + Hv * dv, Hv * dv, Hv // Hk
    cap_rows = tuple(range(0, B, 2)) if capture else ()  # every other row: mixed batches
    layout = Layout.build(list(lengths), [5] * B, [b in cap_rows for b in range(B)])
    N = sum(lengths)
    mx.random.seed(0)
    proj = mx.random.normal((N, Cc + Cv + 2 * Hv))
    conv, ssm = mx.random.normal((B, Kc - 1, Cc)), mx.random.normal((B, Hv, dv, dk)) * 0.1
    cw, dt = mx.random.normal((Cc, Kc)) * 0.5, mx.random.normal((Hv,)) * 0.1
    sa, nw = -mx.random.uniform(0.5, 2.0, (Hv,)), 1 + 0.1 * mx.random.normal((dv,))
    y, st, conv_out, kept = gdn_mixer_cuda.gdn_mixer_cuda(
        proj,
        layout.pad_index,
        layout.row_lengths,
        conv,
        ssm,
        cw,
        dt,
        sa,
        nw,
        n_key_heads=Hk,
        tiled=tiled,
        fused_ba=fused_ba,
        eps=eps,
        capture_rows=cap_rows,
    )

    # The portable formulas, over the padded view of the same packed columns.
    p, z, ba = (layout.to_padded(c) for c in mx.split(proj, [Cc, Cc + Cv], axis=-1))
    T = layout.width
    if fused_ba:
        ba = ba.reshape(B, T, Hk, 2 * r)
        b, a = ba[..., :r].reshape(B, T, Hv), ba[..., r:].reshape(B, T, Hv)
    else:
        b, a = ba[..., :Hv], ba[..., Hv:]
    valid = layout.valid[..., None]
    window = mx.concatenate([conv, p], axis=1)
    c = nn.silu(sum(window[:, i : i + T] * cw[:, i] for i in range(Kc)))
    q = l2_normalize(c[..., :Cq].reshape(B, T, Hk, dk), eps) / math.sqrt(dk)
    k = l2_normalize(c[..., Cq : 2 * Cq].reshape(B, T, Hk, dk), eps)
    v = c[..., 2 * Cq :].reshape(B, T, Hv, dv)
    g = mx.where(valid, sa * nn.softplus(a + dt), 0.0)
    o, st_ref = gated_delta(q, k, v, g, mx.where(valid, mx.sigmoid(b), 0.0), ssm, tiled)
    y_ref = mx.fast.rms_norm(o, nw, eps) * nn.silu(z.reshape(B, T, Hv, dv))
    y_ref = layout.to_packed(y_ref.reshape(B, T, Cv))
    assert float(mx.abs(y - y_ref).max()) <= 1e-5 * float(mx.abs(y_ref).max())
    assert float(mx.abs(st - st_ref).max()) <= 1e-5 * float(mx.abs(st_ref).max())
    assert float(mx.abs(conv_out - conv_tail(window, layout, Kc)).max()) == 0.0
    if not cap_rows:
        assert kept is None
        return
    # Capture: the window as the portable path keeps it, and the state before the row and
    # after each position (padding positions keep the last state).
    ci = mx.array(cap_rows, dtype=mx.int32)
    windows, states = kept
    _, st_all = gated_delta(
        q[ci], k[ci], v[ci], g[ci], mx.where(valid, mx.sigmoid(b), 0.0)[ci], ssm[ci], tiled, True
    )
    st_all = mx.concatenate([ssm[ci][:, None], st_all], axis=1)
    assert windows.shape == (len(cap_rows), Kc - 1 + T, Cc)
    assert float(mx.abs(windows - window[ci]).max()) == 0.0
    assert states.shape == st_all.shape
    assert float(mx.abs(states - st_all).max()) <= 1e-5 * float(mx.abs(st_all).max())
