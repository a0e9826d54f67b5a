"""The whole Gated DeltaNet mixer core as ONE CUDA kernel, capture rows included.

Between the input projection and the output projection, the portable path
(`engine.models.qwen35.GatedDeltaNet`) runs a dozen operations: causal conv,
SiLU, the q/k L2 norms, the beta and decay gates, the recurrence, the gated
RMSNorm, and the gathers between the packed and padded views of the batch. At
small batch each costs a fixed launch overhead that dwarfs its work, so on
MLX's CUDA backend they run here as one kernel that reads the packed output of
the fused input projection as it is and writes the packed input of the output
projection: a block per (row, value head); its warps hold the head's state rows
in registers, its threads recompute the short conv of the channels the head reads
(one channel each, from the conv state and the new inputs, into shared memory),
and it normalises the head's output through shared memory. The blocks also write each row's new conv state (its last Kc-1 inputs).

Capture rows (speculative verify runs) run in the same launch: their blocks also
write the recurrent state before the row and after each of its positions, and the
row's conv window (conv state + its inputs), which is what `SlotPool.rollback`
keeps a prefix of. That variant is a second kernel (its outputs differ); a batch
without capture rows never pays for it.

Numerics follow the portable path (f32 throughout, same formulas and order of
the conv taps); tests compare the two on the GPU.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.kernels.cuda import cached_kernel, env, switched_on

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
    __shared__ float qk_sh[2 * DK];  // this position's conv outputs: the key head's q and k
    __shared__ float v_sh[DV];  // and the value head's v

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
    // row's HV blocks (CPT channels a thread). Every load before any store: the compiler
    // cannot tell conv_out from the inputs, so a load after a store would wait for it —
    // a memory round trip per value, several microseconds of a decode step's mixer.
    constexpr int NT = 32 * NW;  // the block's threads
    constexpr int CPT = (CC + HV * NT - 1) / (HV * NT);
    {
        float keep[CPT][KC - 1];
        #pragma unroll
        for (int i = 0; i < CPT; ++i) {
            const int c = h * NT + threadIdx.x + i * HV * NT;
            #pragma unroll
            for (int j = 0; j < KC - 1; ++j) keep[i][j] = c < CC ? win(c, n_b + j) : 0.0f;
        }
        #pragma unroll
        for (int i = 0; i < CPT; ++i) {
            const int c = h * NT + threadIdx.x + i * HV * NT;
            if (c < CC) {
                #pragma unroll
                for (int j = 0; j < KC - 1; ++j)
                    conv_out[(long(b) * (KC - 1) + j) * CC + c] = keep[i][j];
            }
        }
    }
/*CAPTURE_WINDOW*/

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
/*CAPTURE_STATE_0*/
    for (int t = 0; t < n_b; ++t) {
        const long row = pad_index[b * T + t];
        // The conv of every channel this head reads, one channel a thread, in parallel.
        for (int c = threadIdx.x; c < 2 * DK + DV; c += blockDim.x) {
            const int ch = c < DK ? kh * DK + c
                : c < 2 * DK ? CQ + kh * DK + (c - DK) : 2 * CQ + h * DV + (c - 2 * DK);
            const float val = conv(ch, t);
            if (c < 2 * DK) qk_sh[c] = val; else v_sh[c - 2 * DK] = val;
        }
        __syncthreads();
        float qv[NPER], kv[NPER];
        float qss = 0.0f, kss = 0.0f;
        #pragma unroll
        for (int m = 0; m < NPER; ++m) {
            const int j = lane + 32 * m;
            qv[m] = j < DK ? qk_sh[j] : 0.0f;
            kv[m] = j < DK ? qk_sh[DK + j] : 0.0f;
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
            const float vi = v_sh[i];
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
/*CAPTURE_STATE_T*/
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
/*CAPTURE_PADDING*/
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

# The capture variant's additions. `cap_index[b]`: row b's place among the capture rows,
# -1 for the others. States go to `cap_states [Bc, T+1, HV, DV, DK]` (before the row, then
# after each position; padding positions keep the last state, as the portable path's
# zero-decay, zero-beta padding does) and the window to `cap_window [Bc, KC-1+T, CC]`.
_CAPTURE = {
    "/*CAPTURE_WINDOW*/": """
    const int cj = cap_index[b];
    if (cj >= 0) {  // loads first, 8 positions at a time (see the conv state above)
        const int P = KC - 1 + T;
        for (int p0 = 0; p0 < P; p0 += 8) {
            float vals[CPT][8];
            #pragma unroll
            for (int i = 0; i < CPT; ++i) {
                const int c = h * NT + threadIdx.x + i * HV * NT;
                #pragma unroll
                for (int q = 0; q < 8; ++q) vals[i][q] = c < CC && p0 + q < P ? win(c, p0 + q) : 0.0f;
            }
            #pragma unroll
            for (int i = 0; i < CPT; ++i) {
                const int c = h * NT + threadIdx.x + i * HV * NT;
                #pragma unroll
                for (int q = 0; q < 8; ++q)
                    if (c < CC && p0 + q < P)
                        cap_window[(long(cj) * P + p0 + q) * CC + c] = vals[i][q];
            }
        }
    }
""",
    "/*CAPTURE_STATE_0*/": """
    auto keep_state = [&](int at) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float* dst = cap_states
                + ((((long(cj) * (T + 1) + at) * HV + h) * DV) + w + NW * r) * DK;
            #pragma unroll
            for (int m = 0; m < NPER; ++m) {
                const int j = lane + 32 * m;
                if (j < DK) dst[j] = s[r][m];
            }
        }
    };
    if (cj >= 0) keep_state(0);
""",
    "/*CAPTURE_STATE_T*/": """
        if (cj >= 0) keep_state(t + 1);
""",
    "/*CAPTURE_PADDING*/": """
    if (cj >= 0)
        for (int t = n_b; t < T; ++t) keep_state(t + 1);
""",
}


def _source(eps: float, capture: bool) -> str:
    src = f"    constexpr float EPS = {eps!r}f;\n" + _SOURCE
    for marker, code in _CAPTURE.items():
        src = src.replace(marker, code if capture else "")
    return src


@functools.lru_cache(maxsize=256)  # capture patterns of recent batch shapes
def _capture_index(rows: int, capture_rows: tuple[int, ...]) -> mx.array:
    """`[rows]` int32: each row's place among the capture rows, -1 for the others."""
    index = [-1] * rows
    for j, b in enumerate(capture_rows):
        index[b] = j
    return mx.array(index, dtype=mx.int32)


def enabled() -> bool:
    """On MLX's CUDA backend, unless SLOTSERVE_FUSED_GDN=0."""
    return switched_on("GDN")


WARPS_ENV = "SLOTSERVE_GDN_WARPS"
FEW_BLOCKS = 264  # two per multiprocessor of an H100 / H200 (132)


def fixed_warps(value: str) -> int | None:
    """SLOTSERVE_GDN_WARPS's value as a count (1, 2, 4, 8 or 16; "": none fixed)."""
    if value and not (value.isdigit() and int(value) in (1, 2, 4, 8, 16)):
        raise ValueError(f"{WARPS_ENV}={value!r}: warps a block are 1, 2, 4, 8 or 16")
    return int(value) if value else None


def warps(blocks: int, dv: int) -> int:
    """Warps a block (one row's value head) runs: each warp carries `dv / warps` rows of the
    head's state through the recurrence one after another, two warp reductions a row — the
    kernel's latency at small batch, where its blocks leave most multiprocessors idle (on the
    H200 at N = 1, 16 blocks of 8 warps, each moving its head's 128 KB of state, took 15.7 us
    a layer: 18 layers, a fifth of the decode step's GPU time; 16 warps: 11.9 us). So a
    launch of at most `FEW_BLOCKS` blocks runs 16 warps a block, halving that chain; a wider
    one 8 (the multiprocessors are full anyway). `SLOTSERVE_GDN_WARPS=1|2|4|8|16` fixes the
    count where `dv` allows (benchmarks). Not 32: 1,024 threads of some of the kernel's
    variants ask for more registers than a multiprocessor has (on the H200 the launch of
    128-row heads failed, "too many resources requested", session 18)."""
    fixed = fixed_warps(env(WARPS_ENV, ""))
    nw = fixed or (16 if blocks <= FEW_BLOCKS else 8)
    while dv % nw:  # (powers of two: halving ends at 1, which divides anything)
        nw //= 2
    return nw


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
    capture_rows: tuple[int, ...] = (),
) -> tuple[mx.array, mx.array, mx.array, tuple[mx.array, mx.array] | None]:
    """The mixer core of a batch of rows, packed in and packed out.

    `proj` `[N, W]`: the packed output of the input projection, columns
    `[conv inputs Cc | z Hv*dv | beta, alpha]`; `pad_index` `[B, T]` and
    `row_lengths` `[B]` from the batch `Layout`; state conv `[B, Kc-1, Cc]` and
    ssm `[B, Hv, dv, dk]` (f32; either may have a leading axis of 1, as the pool's views
    do). Returns the gated, normalised output `[N, Hv*dv]` in `proj`'s dtype, the final
    ssm state, the new conv state (f32) and, when `capture_rows` names rows, their capture:
    (windows `[Bc, Kc-1+T, Cc]`, states `[Bc, T+1, Hv, dv, dk]`), as `LinearCapture` holds
    them.
    """
    capture = bool(capture_rows)
    inputs = [
        "proj",
        "pad_index",
        "row_lengths",
        "conv_state",
        "state",
        "conv_w",
        "dt_bias",
        "ssm_a",
        "norm_w",
    ]
    outputs = ["y", "state_out", "conv_out"]
    if capture:
        inputs.append("cap_index")
        outputs += ["cap_states", "cap_window"]
    kernel = cached_kernel(
        "gdn_mixer",
        # eps is a float: baked into the source (template arguments are integers)
        f"{eps!r}{' capture' if capture else ''}",
        inputs,
        outputs,
        _source(eps, capture),
    )
    N, W = proj.shape
    B, Hv, dv, dk = ssm.shape[-4:]
    Cc, Kc = conv_w.shape
    T = pad_index.shape[1]
    nw = warps(B * Hv, dv)
    f32 = mx.float32
    arrays = [
        proj,
        pad_index,
        row_lengths,
        conv_state.astype(f32),
        ssm.astype(f32),
        conv_w.astype(f32),
        dt_bias.astype(f32),
        ssm_a.astype(f32),
        norm_w.astype(f32),
    ]
    shapes = [(N, Hv * dv), (B, Hv, dv, dk), (B, Kc - 1, Cc)]
    dtypes = [proj.dtype, f32, f32]
    if capture:
        Bc = len(capture_rows)
        arrays.append(_capture_index(B, capture_rows))
        shapes += [(Bc, T + 1, Hv, dv, dk), (Bc, Kc - 1 + T, Cc)]
        dtypes += [f32, f32]
    out = kernel(
        inputs=arrays,
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
        output_shapes=shapes,
        output_dtypes=dtypes,
    )
    y, state, conv = out[:3]
    return y, state, conv, (out[4], out[3]) if capture else None
