"""The whole Gated DeltaNet mixer core as ONE CUDA kernel (no capture rows).

Between the input projection and the output projection, the portable path
(`engine.models.qwen35.GatedDeltaNet`) runs a dozen operations: causal conv,
SiLU, the q/k L2 norms, the beta and decay gates, the recurrence, the gated
RMSNorm, and the gathers between the packed and padded views of the batch. At
small batch each costs a fixed launch overhead that dwarfs its work, so on
MLX's CUDA backend they run here as one kernel that reads the packed output of
the fused input projection as it is and writes the packed input of the output
projection: a block per (row, value head); its warps hold the head's state rows
in registers, recompute the short conv for the channels they need from the conv
state and the new inputs, and normalise the head's output through shared
memory. The blocks also write each row's new conv state (its last Kc-1 inputs).

Numerics follow the portable path (f32 throughout, same formulas and order of
the conv taps); tests compare the two on the GPU.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels.cuda import cached_kernel, switched_on

_SOURCE = """
    constexpr int CQ = HK * DK;
    constexpr int CC = 2 * CQ + HV * DV;
    constexpr int ROWS = DV / NW;
    constexpr int R = HV / HK;
    const int lane = threadIdx.x & 31;
    const int w = threadIdx.x >> 5;
    const int h = blockIdx.x % HV;
    const int b = blockIdx.x / HV;
    const int T = pad_index_shape[1];
    const int n_b = row_lengths[b];
    const int kh = TILED ? (h % HK) : (h / R);
    // Beta and alpha columns: separate [beta x HV | alpha x HV], or qwen3next's
    // per key head [beta x R | alpha x R] (grouped head order within a key head).
    const int col_b = BA_FUSED ? OFF_BA + (h / R) * 2 * R + (h % R) : OFF_BA + h;
    const int col_a = BA_FUSED ? col_b + R : OFF_BA + HV + h;
    __shared__ float o_sh[DV];

    auto win = [&](int ch, int pos) -> float {  // window = [conv state, the row's inputs]
        return pos < KC - 1
            ? conv_state[(long(b) * (KC - 1) + pos) * CC + ch]
            : static_cast<float>(proj[long(pad_index[b * T + pos - (KC - 1)]) * W + ch]);
    };
    auto conv = [&](int ch, int t) -> float {
        float acc = 0.0f;
        #pragma unroll
        for (int tap = 0; tap < KC; ++tap) acc += conv_w[ch * KC + tap] * win(ch, t + tap);
        return acc / (1.0f + expf(-acc));  // SiLU
    };
    auto warp_sum = [](float x) -> float {
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffff, x, off);
        return x;
    };

    // The new conv state: window[n_b : n_b + KC - 1], all channels, spread over the
    // row's HV blocks.
    for (int c = h * blockDim.x + threadIdx.x; c < CC; c += HV * blockDim.x) {
        #pragma unroll
        for (int j = 0; j < KC - 1; ++j)
            conv_out[(long(b) * (KC - 1) + j) * CC + c] = win(c, n_b + j);
    }

    float s[ROWS][NPER];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float* src = state + ((long(b) * HV + h) * DV + w + NW * r) * DK;
        #pragma unroll
        for (int m = 0; m < NPER; ++m) {
            const int j = lane + 32 * m;
            s[r][m] = j < DK ? src[j] : 0.0f;
        }
    }
    for (int t = 0; t < n_b; ++t) {
        const long row = pad_index[b * T + t];
        float qv[NPER], kv[NPER];
        float qss = 0.0f, kss = 0.0f;
        #pragma unroll
        for (int m = 0; m < NPER; ++m) {
            const int j = lane + 32 * m;
            qv[m] = j < DK ? conv(kh * DK + j, t) : 0.0f;
            kv[m] = j < DK ? conv(CQ + kh * DK + j, t) : 0.0f;
            qss += qv[m] * qv[m];
            kss += kv[m] * kv[m];
        }
        const float qn = rsqrtf(float(DK)) / fmaxf(sqrtf(warp_sum(qss)), EPS);
        const float kn = 1.0f / fmaxf(sqrtf(warp_sum(kss)), EPS);
        const float braw = static_cast<float>(proj[row * W + col_b]);
        const float araw = static_cast<float>(proj[row * W + col_a]) + dt_bias[h];
        const float softplus = fmaxf(araw, 0.0f) + log1pf(expf(-fabsf(araw)));
        const float beta = 1.0f / (1.0f + expf(-braw));
        const float decay = expf(ssm_a[h] * softplus);
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int i = w + NW * r;
            const float vi = conv(2 * CQ + h * DV + i, t);
            float u = 0.0f;
            #pragma unroll
            for (int m = 0; m < NPER; ++m) {
                s[r][m] *= decay;
                u += s[r][m] * kv[m] * kn;
            }
            const float delta = beta * (vi - warp_sum(u));
            float o = 0.0f;
            #pragma unroll
            for (int m = 0; m < NPER; ++m) {
                s[r][m] += delta * kv[m] * kn;
                o += s[r][m] * qv[m] * qn;
            }
            o = warp_sum(o);
            if (lane == 0) o_sh[i] = o;
        }
        __syncthreads();
        float ss = 0.0f;
        for (int i = lane; i < DV; i += 32) ss += o_sh[i] * o_sh[i];
        const float inv = rsqrtf(warp_sum(ss) / DV + EPS);
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int i = w + NW * r;
            if (lane == 0) {
                const float zz = static_cast<float>(proj[row * W + OFF_Z + h * DV + i]);
                const float yi = o_sh[i] * inv * norm_w[i] * zz / (1.0f + expf(-zz));
                y[row * (HV * DV) + h * DV + i] = static_cast<OUT_T>(yi);
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float* dst = state_out + ((long(b) * HV + h) * DV + w + NW * r) * DK;
        #pragma unroll
        for (int m = 0; m < NPER; ++m) {
            const int j = lane + 32 * m;
            if (j < DK) dst[j] = s[r][m];
        }
    }
"""


def enabled() -> bool:
    """On MLX's CUDA backend, unless SLOTSERVE_FUSED_GDN=0."""
    return switched_on("GDN")


def gdn_mixer_cuda(
    proj: mx.array,
    pad_index: mx.array,
    row_lengths: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    dt_bias: mx.array,
    ssm_a: mx.array,
    norm_w: mx.array,
    *,
    n_key_heads: int,
    tiled: bool,
    fused_ba: bool,
    eps: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """The mixer core of a batch of rows, packed in and packed out.

    `proj` `[N, W]`: the packed output of the input projection, columns
    `[conv inputs Cc | z Hv*dv | beta, alpha]`; `pad_index` `[B, T]` and
    `row_lengths` `[B]` from the batch `Layout`; state conv `[B, Kc-1, Cc]` and
    ssm `[B, Hv, dv, dk]` (f32). Returns the gated, normalised output `[N, Hv*dv]`
    in `proj`'s dtype, the final ssm state and the new conv state (f32).
    """
    kernel = cached_kernel(
        "gdn_mixer",
        repr(eps),  # a float: baked into the source (template arguments are integers)
        [
            "proj",
            "pad_index",
            "row_lengths",
            "conv_state",
            "state",
            "conv_w",
            "dt_bias",
            "ssm_a",
            "norm_w",
        ],
        ["y", "state_out", "conv_out"],
        f"    constexpr float EPS = {eps!r}f;\n" + _SOURCE,
    )
    N, W = proj.shape
    B, Hv, dv, dk = ssm.shape
    Cc, Kc = conv_w.shape
    nw = 8 if dv % 8 == 0 else 1
    f32 = mx.float32
    y, state, conv = kernel(
        inputs=[
            proj,
            pad_index,
            row_lengths,
            conv_state.astype(f32),
            ssm.astype(f32),
            conv_w.astype(f32),
            dt_bias.astype(f32),
            ssm_a.astype(f32),
            norm_w.astype(f32),
        ],
        template=[
            ("OUT_T", proj.dtype),
            ("HK", n_key_heads),
            ("HV", Hv),
            ("DK", dk),
            ("DV", dv),
            ("KC", Kc),
            ("W", W),
            ("OFF_Z", Cc),
            ("OFF_BA", Cc + Hv * dv),
            ("BA_FUSED", fused_ba),
            ("NW", nw),
            ("NPER", (dk + 31) // 32),
            ("TILED", tiled),
        ],
        grid=(B * Hv * nw * 32, 1, 1),
        threadgroup=(nw * 32, 1, 1),
        output_shapes=[(N, Hv * dv), (B, Hv, dv, dk), (B, Kc - 1, Cc)],
        output_dtypes=[proj.dtype, f32, f32],
    )
    return y, state, conv
