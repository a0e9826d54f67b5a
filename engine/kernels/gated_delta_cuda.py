"""Fused Gated DeltaNet recurrence for MLX's CUDA backend.

One warp per (row, value head, value channel): the warp holds that channel's
row of the state (dk floats, spread over its 32 lanes) in registers for the
whole run, so the state is read once and written once per call however many
positions it covers, and no two warps share data. Per position: decay,
retrieve (a warp reduction), rank-1 update, read out (a second reduction).
With capture, the state after every position is written for rollback.

Inputs follow `engine.gated_delta`: q, k `[B, T, Hk, dk]` (q L2-normalised and
scaled, k L2-normalised; the kernel maps value head j to key head j % Hk when
tiled, j // (Hv/Hk) when grouped), v `[B, T, Hv, dv]`, g and beta `[B, T, Hv]`,
state `[B, Hv, dv, dk]`, all float32.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels.cuda import cached_kernel

_SOURCE = """
    const int lane = threadIdx.x & 31;
    const long warp = (long(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const int B = v_shape[0], T = v_shape[1], Hv = v_shape[2], Hk = q_shape[2];
    if (warp >= long(B) * Hv * DV) return;
    const int i = warp % DV;
    const int h = (warp / DV) % Hv;
    const int b = warp / (long(DV) * Hv);
    const int kh = TILED ? (h % Hk) : (h / (Hv / Hk));
    float s[NPER];
    const float* s_in = state + ((long(b) * Hv + h) * DV + i) * DK;
    #pragma unroll
    for (int m = 0; m < NPER; ++m) {
        const int j = lane + 32 * m;
        s[m] = j < DK ? s_in[j] : 0.0f;
    }
    for (int t = 0; t < T; ++t) {
        const long qk = ((long(b) * T + t) * Hk + kh) * DK;
        const long hv = (long(b) * T + t) * Hv + h;
        const float decay = expf(g[hv]);
        float kk[NPER];
        float u = 0.0f;
        #pragma unroll
        for (int m = 0; m < NPER; ++m) {
            const int j = lane + 32 * m;
            kk[m] = j < DK ? k[qk + j] : 0.0f;
            s[m] *= decay;
            u += s[m] * kk[m];
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) u += __shfl_xor_sync(0xffffffff, u, off);
        const float delta = beta[hv] * (v[hv * DV + i] - u);
        float o = 0.0f;
        #pragma unroll
        for (int m = 0; m < NPER; ++m) {
            const int j = lane + 32 * m;
            s[m] += delta * kk[m];
            o += s[m] * (j < DK ? q[qk + j] : 0.0f);
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) o += __shfl_xor_sync(0xffffffff, o, off);
        if (lane == 0) out[hv * DV + i] = o;
        if (CAPTURE) {
            float* dst = state_out + ((hv * DV) + i) * DK;
            #pragma unroll
            for (int m = 0; m < NPER; ++m) {
                const int j = lane + 32 * m;
                if (j < DK) dst[j] = s[m];
            }
        }
    }
    if (!CAPTURE) {
        float* dst = state_out + ((long(b) * Hv + h) * DV + i) * DK;
        #pragma unroll
        for (int m = 0; m < NPER; ++m) {
            const int j = lane + 32 * m;
            if (j < DK) dst[j] = s[m];
        }
    }
"""


def gated_delta_cuda(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    tiled: bool,
    capture: bool,
) -> tuple[mx.array, mx.array]:
    """Returns (o `[B, T, Hv, dv]`, final state) or, with `capture`, (o, states after
    every position `[B, T, Hv, dv, dk]`)."""
    kernel = cached_kernel(
        "gated_delta", "", ["q", "k", "v", "g", "beta", "state"], ["out", "state_out"], _SOURCE
    )
    B, T, Hv, dv = v.shape
    dk = q.shape[-1]
    state_shape = (B, T, Hv, dv, dk) if capture else (B, Hv, dv, dk)
    f32 = mx.float32
    out, states = kernel(
        inputs=[
            q.astype(f32),
            k.astype(f32),
            v.astype(f32),
            g.astype(f32),
            beta.astype(f32),
            state.astype(f32),
        ],
        template=[
            ("DK", dk),
            ("DV", dv),
            ("NPER", (dk + 31) // 32),
            ("TILED", tiled),
            ("CAPTURE", capture),
        ],
        grid=(B * Hv * dv * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(B, T, Hv, dv), state_shape],
        output_dtypes=[f32, f32],
    )
    return out, states
