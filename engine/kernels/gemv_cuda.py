"""Decode-sized matrix products `x @ W.T` (at most `MAX_ROWS` rows of x) as ONE CUDA kernel
that streams each weight once, for float matrices and for MLX's affine 8- and 4-bit layout.

A decode step multiplies a handful of rows by every weight matrix of the model: the step's
time is the time to read the weights. A block's `SPLIT` warps own `OUTS` consecutive outputs
for all rows of x and share their weight rows along K (split-K: a 4096-wide matrix of 4096
rows keeps 4096 warps busy rather than 1024, enough loads in flight to stream it), each lane
16 bytes per row per round (8 bf16, 16 8-bit or 32 4-bit values; for the quantized ones inside
one quantization group), `U` rounds' loads issued before any is used. It dequantizes in
registers, once for all rows of x — a quantized value becomes the float `2^23 + q` by bit
operations, not the slower int-to-float conversion — accumulates in f32 against the x values
it needs (read through the cache, shared by all warps), reduces across its lanes, and the
block's warps add their sums through shared memory. A quantized group contributes
`scale * sum(q * x) + bias * sum(x)`.

Products of 2 to `MAX_ROWS` rows with 16-bit float weights run on tensor cores instead
(`_MMA_SOURCE`, `mma_takes`): there the FMAs per weight value, not the memory, bound the
kernel above (docs/PERFORMANCE.md, session 19).
"""

from __future__ import annotations

import mlx.core as mx

from engine.gguf import QuantizedWeight, Weight
from engine.kernels.cuda import arrival, arrival_counts, cached_kernel, env, switched_on

MAX_ROWS = 8  # rows of x a launch takes (its accumulators live in registers)
MMA_MAX_ROWS = 16  # ... the tensor-core kernel's, where SLOTSERVE_GEMV_MMA_ROWS=16 (`mma_rows`)
_FLOATS = (mx.bfloat16, mx.float16, mx.float32)

# The constants both kernels start from.
_CONSTANTS = """
    constexpr int XV = 16 / sizeof(T);  // x values per 16-byte load
    constexpr int PER_WORD = BITS < 16 ? 32 / BITS : 1;  // quantized values per 32-bit word
    constexpr unsigned MASK = BITS < 16 ? (1u << (BITS & 15)) - 1 : 0u;
"""

_HEAD = (
    _CONSTANTS
    + """\
    // read, not baked in: one build per row count (a SwiGLU input is gate|up, 2K wide)
    const long K = PRO == 2 ? x_shape[1] / 2 : x_shape[1], N = w_shape[0];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long row0 = long(blockIdx.x) * OUTS;  // the block's first output (the grid fits N)
    const unsigned char* base = reinterpret_cast<const unsigned char*>(w);

    // Add + RMSNorm prologue: every block first sums the squares of its rows of h = x + m
    // (rounded to T, as the separate kernel stores it); block 0 also writes h.
    __shared__ float inv[R];
    if (PRO == 1) {
        __shared__ float ssp[SPLIT][R];
        float ss[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) ss[r] = 0.0f;
        for (long k = long(threadIdx.x) * XV; k < K; k += 32L * SPLIT * XV) {
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 xu = __ldg(reinterpret_cast<const uint4*>(x + r * K + k));
                const uint4 mu = __ldg(reinterpret_cast<const uint4*>(m + r * K + k));
                uint4 hu;
                #pragma unroll
                for (int e = 0; e < XV; ++e) {
                    const T s = static_cast<T>(static_cast<float>(reinterpret_cast<const T*>(&xu)[e])
                        + static_cast<float>(reinterpret_cast<const T*>(&mu)[e]));
                    reinterpret_cast<T*>(&hu)[e] = s;
                    ss[r] += static_cast<float>(s) * static_cast<float>(s);
                }
                if (blockIdx.x == 0) *reinterpret_cast<uint4*>(h + r * K + k) = hu;
            }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = ss[r];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
            if (lane == 0) ssp[warp][r] = v;
        }
        __syncthreads();
        if (threadIdx.x < R) {
            float v = 0.0f;
            #pragma unroll
            for (int i = 0; i < SPLIT; ++i) v += ssp[i][threadIdx.x];
            inv[threadIdx.x] = rsqrtf(v / K + EPS);
        }
        __syncthreads();
    }
    // XV input values of row r from k on, through the prologue: each rounded to T where the
    // separate kernels would have stored it.
    auto load_x = [&](int r, long k, float* xv) {
        if (PRO == 1) {
            const uint4 xu = __ldg(reinterpret_cast<const uint4*>(x + r * K + k));
            const uint4 mu = __ldg(reinterpret_cast<const uint4*>(m + r * K + k));
            #pragma unroll
            for (int e = 0; e < XV; ++e) {
                const float s = static_cast<float>(static_cast<T>(
                    static_cast<float>(reinterpret_cast<const T*>(&xu)[e])
                    + static_cast<float>(reinterpret_cast<const T*>(&mu)[e])));
                xv[e] = static_cast<float>(static_cast<T>(s * inv[r] * __ldg(nw + k + e)));
            }
        } else if (PRO == 2) {
            const uint4 gu = __ldg(reinterpret_cast<const uint4*>(x + r * 2 * K + k));
            const uint4 uu = __ldg(reinterpret_cast<const uint4*>(x + r * 2 * K + K + k));
            #pragma unroll
            for (int e = 0; e < XV; ++e) {
                const float g = static_cast<float>(reinterpret_cast<const T*>(&gu)[e]);
                const float u = static_cast<float>(reinterpret_cast<const T*>(&uu)[e]);
                xv[e] = static_cast<float>(static_cast<T>(g / (1.0f + expf(-g)) * u));
            }
        } else {
            const uint4 xu = __ldg(reinterpret_cast<const uint4*>(x + r * K + k));
            #pragma unroll
            for (int e = 0; e < XV; ++e) xv[e] = static_cast<float>(reinterpret_cast<const T*>(&xu)[e]);
        }
    };
"""
)

# The product itself: the lane's weights along K, dequantized once for all rows of x, against
# the x values `load_x` gives (the two kernels' heads define it, and `warp`, `row0`), summed
# into `acc`...
_ACC = """\
    float acc[R][OUTS];
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int o = 0; o < OUTS; ++o) acc[r][o] = 0.0f;
"""

# ... over the values of K from K_LO to K_HI (the whole of K, or one staged chunk of it).
_PRODUCT = """\
    constexpr long STRIDE = 32L * SPLIT * VEC;  // values of K one round of the block covers
    for (long k0 = K_LO + (long(warp) * 32 + lane) * VEC; k0 < K_HI; k0 += STRIDE * U) {
        // All U rounds' loads first: U * OUTS 16-byte loads in flight per lane.
        uint4 wq[U][OUTS];
        float sc[U][OUTS], bi[U][OUTS];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const long k = k0 + u * STRIDE;
            #pragma unroll
            for (int o = 0; o < OUTS; ++o) {
                const long row = row0 + o < N ? row0 + o : N - 1;  // spare outputs reread the last
                if (k < K_HI) {
                    wq[u][o] = __ldg(reinterpret_cast<const uint4*>(base + (row * K + k) * BITS / 8));
                    if (BITS < 16) {
                        sc[u][o] = static_cast<float>(scales[row * (K / GS) + k / GS]);
                        bi[u][o] = static_cast<float>(biases[row * (K / GS) + k / GS]);
                    }
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const long k = k0 + u * STRIDE;
            if (k >= K_HI) break;
            float dot[R][OUTS], sx[R];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                sx[r] = 0.0f;
                #pragma unroll
                for (int o = 0; o < OUTS; ++o) dot[r][o] = 0.0f;
            }
            #pragma unroll
            for (int c = 0; c < VEC / XV; ++c) {
                // This load's XV weights of every output, dequantized once for all rows of x.
                float wf[OUTS][XV];
                #pragma unroll
                for (int o = 0; o < OUTS; ++o)
                    #pragma unroll
                    for (int e = 0; e < XV; ++e) {
                        const int j = c * XV + e;  // the value's place in the lane's 16 bytes
                        if (BITS < 16) {
                            // q as the float 2^23 + q, from its bits: no int-to-float unit
                            const unsigned wd = reinterpret_cast<const unsigned*>(&wq[u][o])[j / PER_WORD];
                            const unsigned q = (wd >> (BITS * (j % PER_WORD))) & MASK;
                            wf[o][e] = __int_as_float(q | 0x4B000000u) - 8388608.0f;
                        } else {
                            wf[o][e] = static_cast<float>(reinterpret_cast<const W*>(&wq[u][o])[j]);
                        }
                    }
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    float xv[XV];
                    load_x(r, k + c * XV, xv);
                    #pragma unroll
                    for (int e = 0; e < XV; ++e) {
                        const float xe = xv[e];
                        sx[r] += xe;
                        #pragma unroll
                        for (int o = 0; o < OUTS; ++o) dot[r][o] = fmaf(wf[o][e], xe, dot[r][o]);
                    }
                }
            }
            #pragma unroll
            for (int r = 0; r < R; ++r)
                #pragma unroll
                for (int o = 0; o < OUTS; ++o)
                    acc[r][o] += BITS < 16 ? sc[u][o] * dot[r][o] + bi[u][o] * sx[r] : dot[r][o];
        }
    }
"""

_TAIL = """\
    __shared__ float part[SPLIT][R][OUTS];
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int o = 0; o < OUTS; ++o) {
            float v = acc[r][o];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
            if (lane == 0) part[warp][r][o] = v;
        }
    __syncthreads();
    if (warp == 0 && lane < R * OUTS) {  // R * OUTS <= 32: one lane an output of a row
        const int r = lane / OUTS, o = lane % OUTS;
        float v = 0.0f;
        #pragma unroll
        for (int i = 0; i < SPLIT; ++i) v += part[i][r][o];
        if (row0 + o < N) out[r * N + row0 + o] = static_cast<T>(v);
    }
"""

_SOURCE = _HEAD + _ACC + "    const long K_LO = 0, K_HI = K;\n" + _PRODUCT + _TAIL

# The staged kernel (`STAGED_ENV`): a block of G groups of SPLIT warps, each group OUTS
# outputs; the input rows made once per block into shared memory, so a prologue costs a
# block one pass over its rows, not one per 16-byte weight load. Rows wider than the stage
# go through it in chunks of KC values of K (`R * KC` values staged at a time; KC = K when
# they fit, as the add + RMSNorm prologue, which needs whole rows for its norm, must).
_STAGED_HEAD = (
    _CONSTANTS
    + """\
    constexpr int NT = 32 * SPLIT * G;  // the block's threads
    const long K = PRO == 2 ? x_shape[1] / 2 : x_shape[1], N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int grp = (threadIdx.x >> 5) / SPLIT;  // the warp's group of OUTS outputs
    const int warp = (threadIdx.x >> 5) % SPLIT;  // and its share of their K
    const long row0 = long(blockIdx.x) * (G * OUTS) + grp * OUTS;  // the group's first output
    const unsigned char* base = reinterpret_cast<const unsigned char*>(w);
    extern __shared__ __align__(16) unsigned char stage_raw[];
    T* xs = reinterpret_cast<T*>(stage_raw);  // [R][KC]: the rows every group reads
    __shared__ float red[SPLIT * G][R];
    __shared__ float inv[R];
"""
)

# One chunk of K, from K_LO to K_HI (the chunk loop defines them): the block makes its rows'
# values there ONCE, into shared memory, rounded where the separate kernels round: x itself;
# h = x + m, then RMSNorm(h) * nw (block 0 writes h); or silu(gate) * up. Its G groups of
# outputs then read them from there.
_STAGED_CHUNK = """\
    float ss[R];  // the thread's share of each row's sum of squares (add + RMSNorm)
    #pragma unroll
    for (int r = 0; r < R; ++r) ss[r] = 0.0f;
    #pragma unroll
    for (int r0 = 0; r0 < R; r0 += RA) {  // RA rows' loads in flight at a time
        for (long k = K_LO + long(threadIdx.x) * XV; k < K_HI; k += long(NT) * XV) {
            uint4 a[RA], b[RA];
            #pragma unroll
            for (int j = 0; j < RA; ++j) {
                const int r = r0 + j;
                if (r >= R) break;
                if (PRO == 2) {
                    a[j] = __ldg(reinterpret_cast<const uint4*>(x + r * 2 * K + k));
                    b[j] = __ldg(reinterpret_cast<const uint4*>(x + r * 2 * K + K + k));
                } else if (PRO == 1) {
                    a[j] = __ldg(reinterpret_cast<const uint4*>(x + r * K + k));
                    b[j] = __ldg(reinterpret_cast<const uint4*>(m + r * K + k));
                } else {
                    a[j] = __ldg(reinterpret_cast<const uint4*>(x + r * K + k));
                }
            }
            #pragma unroll
            for (int j = 0; j < RA; ++j) {
                const int r = r0 + j;
                if (r >= R) break;
                uint4 su;
                if (PRO == 2) {
                    #pragma unroll
                    for (int e = 0; e < XV; ++e) {
                        const float g = static_cast<float>(reinterpret_cast<const T*>(&a[j])[e]);
                        const float u = static_cast<float>(reinterpret_cast<const T*>(&b[j])[e]);
                        reinterpret_cast<T*>(&su)[e] = static_cast<T>(g / (1.0f + expf(-g)) * u);
                    }
                } else if (PRO == 1) {
                    #pragma unroll
                    for (int e = 0; e < XV; ++e) {
                        const T s = static_cast<T>(static_cast<float>(reinterpret_cast<const T*>(&a[j])[e])
                            + static_cast<float>(reinterpret_cast<const T*>(&b[j])[e]));
                        reinterpret_cast<T*>(&su)[e] = s;
                        ss[r] += static_cast<float>(s) * static_cast<float>(s);
                    }
                } else {
                    su = a[j];
                }
                *reinterpret_cast<uint4*>(xs + r * KC + (k - K_LO)) = su;
            }
        }
    }
    if (PRO == 1) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = ss[r];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
            if (lane == 0) red[threadIdx.x >> 5][r] = v;
        }
    }
    __syncthreads();
    if (PRO == 1) {
        if (threadIdx.x < R) {
            float v = 0.0f;
            for (int i = 0; i < SPLIT * G; ++i) v += red[i][threadIdx.x];
            inv[threadIdx.x] = rsqrtf(v / K + EPS);
        }
        if (blockIdx.x == 0)
            for (long i = long(threadIdx.x) * XV; i < R * K; i += long(NT) * XV)
                *reinterpret_cast<uint4*>(h + i) = *reinterpret_cast<const uint4*>(xs + i);
        __syncthreads();
        for (long i = long(threadIdx.x) * XV; i < R * K; i += long(NT) * XV) {
            const int r = int(i / K);
            const long k = i % K;
            uint4 su = *reinterpret_cast<const uint4*>(xs + i);
            #pragma unroll
            for (int e = 0; e < XV; ++e) {
                const float s = static_cast<float>(reinterpret_cast<const T*>(&su)[e]);
                reinterpret_cast<T*>(&su)[e] = static_cast<T>(s * inv[r] * __ldg(nw + k + e));
            }
            *reinterpret_cast<uint4*>(xs + i) = su;
        }
        __syncthreads();
    }
    auto load_x = [&](int r, long k, float* xv) {
        const uint4 xu = *reinterpret_cast<const uint4*>(xs + r * KC + (k - K_LO));
        #pragma unroll
        for (int e = 0; e < XV; ++e) xv[e] = static_cast<float>(reinterpret_cast<const T*>(&xu)[e]);
    };
"""

_STAGED_TAIL = """\
    __shared__ float part[G][SPLIT][R][OUTS];
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int o = 0; o < OUTS; ++o) {
            float v = acc[r][o];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
            if (lane == 0) part[grp][warp][r][o] = v;
        }
    __syncthreads();
    if (warp == 0 && lane < R * OUTS) {  // R * OUTS <= 32: one lane an output of a row
        const int r = lane / OUTS, o = lane % OUTS;
        float v = 0.0f;
        #pragma unroll
        for (int i = 0; i < SPLIT; ++i) v += part[grp][i][r][o];
        if (row0 + o < N) out[r * N + row0 + o] = static_cast<T>(v);
    }
"""

_STAGED_SOURCE = (
    _STAGED_HEAD
    + _ACC
    + "    for (long K_LO = 0; K_LO < K; K_LO += KC) {\n"
    + "    const long K_HI = K_LO + KC < K ? K_LO + KC : K;\n"
    + _STAGED_CHUNK
    + _PRODUCT
    + "    __syncthreads();  // every group done with the chunk before the next is staged\n"
    + "    }\n"
    + _STAGED_TAIL
)


# The staged kernel on tensor cores (`MMA_ENV`): at 2-8 rows the product above costs a lane 8
# FMAs per weight value (the 0.8B's 8-row products ran at ~0.9 TB/s, its down projections at
# ~0.4: the H200's issue rate, not its memory, bound them). Here a warp owns 16 outputs and
# multiplies them by up to 8 rows with `mma.sync` m16n8k16 (bf16 or f16 in, f32 sums): lane
# (g, t) = (lane / 4, lane % 4) loads 16 bytes of output rows g and g + 8 at K offset 8t of the
# warp's 32 values, and the same 8 values of x's row g (`_MMA_X`) — and past 8 rows (up to
# `MMA_MAX_ROWS`, SLOTSERVE_GEMV_MMA_ROWS) those of row g + 8 too, a second pair of products
# on the same weight registers into a second set of sums; the two products of a
# round take those 8 values 4 at a time as the fragments' k = 2t, 2t + 1, 2t + 8, 2t + 9 — a
# permutation of K that A and B share, so the sum is over the same products. An output is
# a row of A against a column of B: no other row of x enters it, so a row's result is the
# same whatever rows share the launch (rows past R are zeros).
_MMA_ACC = """\
    const int g = lane >> 2, t = lane & 3;
    const long ra = row0 + g < N ? row0 + g : N - 1;  // spare outputs reread the last
    const long rb = row0 + g + 8 < N ? row0 + g + 8 : N - 1;
    // sums of outputs g and g + 8 (i >> 1) by x rows 2t and 2t + 1 (i & 1); past 8 rows, c2
    // holds rows 8 + 2t and 9 + 2t (a second fragment of x on the same weight registers)
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    constexpr int CW = R > 8 ? 8 : 4;  // a lane's sums: i < 4 in c, the rest in c2
    auto sum_at = [&](int i) -> float& { return i < 4 ? c[i] : c2[i - 4]; };
    auto mma = [&](float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                   unsigned b0, unsigned b1) {
        if (BF)
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        else
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    };
"""

# The weights' loads: lane (g, t)'s 16 bytes of rows g and g + 8 for U rounds from k0 (none
# past K_HI). They depend on nothing the block makes, so a chunk's first rounds are asked
# for before the block stages its rows, and every later U rounds while the last are used.
_MMA_LOADS = """\
    constexpr long MSTRIDE = 32L * SPLIT;  // values of K one round of the group covers
    auto load_w = [&](uint4 (&a)[U], uint4 (&b)[U], long k0, long K_HI) {
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const long k = k0 + u * MSTRIDE;
            if (k < K_HI) {
                a[u] = __ldg(reinterpret_cast<const uint4*>(base + (ra * K + k) * 2));
                b[u] = __ldg(reinterpret_cast<const uint4*>(base + (rb * K + k) * 2));
            }
        }
    };
    uint4 wa[U], wb[U];
"""

# Row g's 8 values of x from k on, as the prologue makes them: from the stage (add + RMSNorm,
# whose norm needs whole rows first), or (DIRECT: a plain or SwiGLU product) made here from
# the raw values `load_raw` read (x, or gate and up) — no stage to wait for; each value is
# made by one lane of each warp that meets it, rounded where the separate kernels round.
_MMA_X = """\
    auto load_raw = [&](uint4 (&p)[U], uint4 (&q)[U], int gr, long k0, long K_HI) {
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const long k = k0 + u * MSTRIDE;
            if (DIRECT && gr < R && k < K_HI) {
                if (PRO == 2) {
                    p[u] = __ldg(reinterpret_cast<const uint4*>(x + gr * 2 * K + k));
                    q[u] = __ldg(reinterpret_cast<const uint4*>(x + gr * 2 * K + K + k));
                } else {
                    p[u] = __ldg(reinterpret_cast<const uint4*>(x + gr * K + k));
                }
            }
        }
    };
    auto x_frag = [&](int gr, long k, long K_LO, const uint4& p, const uint4& q) {
        uint4 xb = make_uint4(0u, 0u, 0u, 0u);
        if (gr >= R) return xb;  // rows past R: zeros
        if (!DIRECT) {
            xb = *reinterpret_cast<const uint4*>(xs + gr * KC + (k - K_LO));
        } else if (PRO == 2) {
            #pragma unroll
            for (int e = 0; e < XV; ++e) {
                const float gv = static_cast<float>(reinterpret_cast<const T*>(&p)[e]);
                const float uv = static_cast<float>(reinterpret_cast<const T*>(&q)[e]);
                reinterpret_cast<T*>(&xb)[e] = static_cast<T>(gv / (1.0f + expf(-gv)) * uv);
            }
        } else {
            xb = p;
        }
        return xb;
    };
"""

# One chunk's products (its first U rounds already loaded into wa, wb): the group's warps take
# its rounds of 32 values in turn (a chunk and K are whole rounds, so a warp's lanes run the
# same rounds and meet `mma.sync` together), the next U rounds' weights in flight meanwhile.
# A direct product's raw x values for U rounds are asked for together, before the next
# rounds' weights: one wait on the cache a U rounds, not one a round.
_MMA_PRODUCT = """\
    for (long k0 = K_LO + long(warp) * 32 + t * 8; k0 < K_HI; k0 += MSTRIDE * U) {
        uint4 xp[U], xq[U], xp2[U], xq2[U], na[U], nb[U];
        load_raw(xp, xq, g, k0, K_HI);
        if (R > 8) load_raw(xp2, xq2, g + 8, k0, K_HI);
        load_w(na, nb, k0 + MSTRIDE * U, K_HI);
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const long k = k0 + u * MSTRIDE;
            if (k >= K_HI) break;
            const uint4 xb = x_frag(g, k, K_LO, xp[u], xq[u]);
            mma(c, wa[u].x, wb[u].x, wa[u].y, wb[u].y, xb.x, xb.y);
            mma(c, wa[u].z, wb[u].z, wa[u].w, wb[u].w, xb.z, xb.w);
            if (R > 8) {  // the same weights by rows 8-15 of x
                const uint4 xb2 = x_frag(g + 8, k, K_LO, xp2[u], xq2[u]);
                mma(c2, wa[u].x, wb[u].x, wa[u].y, wb[u].y, xb2.x, xb2.y);
                mma(c2, wa[u].z, wb[u].z, wa[u].w, wb[u].w, xb2.z, xb2.w);
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            wa[u] = na[u];
            wb[u] = nb[u];
        }
    }
"""

# A direct product's K may also be shared by BS blocks (grid row `blockIdx.y`), each taking
# whole rounds of 32 values: the 0.8B's down projection at 8 rows had 64 blocks of 8 warps
# (split 8 is the most a block holds) for 132 multiprocessors, 14.7 us for 7.3 MB (session
# 20). Each block's sums go to `part` [BS][R][N] (float); the last block of a column group
# to finish (a count per group in `counts`, left at zero again) adds the BS sums in block
# order and writes the outputs: the same sum whichever block is last, and BS depends on
# the product's shape only, so a row's result does not depend on the rows beside it.
_MMA_BLOCK_RANGE = """\
    const long K_BEGIN = K / 32 * long(blockIdx.y) / BS * 32;  // this block's rounds of K
    const long K_END = K / 32 * long(blockIdx.y + 1) / BS * 32;
"""

_MMA_BLOCK_TAIL = (
    """\
    if (BS > 1) {
        if (warp == 0) {
            #pragma unroll
            for (int i = 0; i < CW; ++i) {
                const int r = 2 * t + (i & 1) + (i >> 2) * 8;
                const long o = row0 + g + ((i >> 1) & 1) * 8;
                if (r < R && o < N) part[(long(blockIdx.y) * R + r) * N + o] = sum_at(i);
            }
        }
"""
    + arrival("blockIdx.x", "BS")
    + """\
        if (warp == 0) {
            #pragma unroll
            for (int i = 0; i < CW; ++i) {
                const int r = 2 * t + (i & 1) + (i >> 2) * 8;
                const long o = row0 + g + ((i >> 1) & 1) * 8;
                if (r < R && o < N) {
                    float sum = 0.0f;
                    for (int b = 0; b < BS; ++b) sum += __ldcg(part + (long(b) * R + r) * N + o);
                    out[r * N + o] = static_cast<T>(sum);
                }
            }
        }
        return;
    }
"""
)

# The group's warps add their sums in the stage (free after the last chunk), in warp order.
_MMA_TAIL = (
    """\
    float* sums = reinterpret_cast<float*>(stage_raw);  // [G][SPLIT][32 lanes][CW]
    if (SPLIT > 1) {
        #pragma unroll
        for (int i = 0; i < CW; ++i) sums[((grp * SPLIT + warp) * 32 + lane) * CW + i] = sum_at(i);
        __syncthreads();
    }
    if (warp == 0) {
        #pragma unroll
        for (int s = 1; s < SPLIT; ++s)
            #pragma unroll
            for (int i = 0; i < CW; ++i) sum_at(i) += sums[((grp * SPLIT + s) * 32 + lane) * CW + i];
    }
"""
    + _MMA_BLOCK_TAIL
    + """\
    if (warp == 0) {
        #pragma unroll
        for (int i = 0; i < CW; ++i) {
            const int r = 2 * t + (i & 1) + (i >> 2) * 8;
            const long o = row0 + g + ((i >> 1) & 1) * 8;
            if (r < R && o < N) out[r * N + o] = static_cast<T>(sum_at(i));
        }
    }
"""
)

_MMA_SOURCE = (
    _STAGED_HEAD
    + _MMA_ACC
    + _MMA_LOADS
    + _MMA_X
    + _MMA_BLOCK_RANGE
    + "    for (long K_LO = K_BEGIN; K_LO < K_END; K_LO += KC) {\n"
    + "    const long K_HI = K_LO + KC < K_END ? K_LO + KC : K_END;\n"
    + "    load_w(wa, wb, K_LO + long(warp) * 32 + t * 8, K_HI);\n"
    + "    if (!DIRECT) {\n"
    + _STAGED_CHUNK
    + "    }\n"
    + _MMA_PRODUCT
    + "    if (!DIRECT) __syncthreads();  // every group done with the chunk before the next\n"
    + "    }\n"
    + _MMA_TAIL
)


def enabled() -> bool:
    """On MLX's CUDA backend, unless SLOTSERVE_FUSED_GEMV=0."""
    return switched_on("GEMV")


DENSE_ENV = "SLOTSERVE_FUSED_GEMV_DENSE"
DENSE_MODES = ("0", "1", "rows", "mma")


def dense_mode() -> str:
    """Which float products without a prologue take this kernel (SLOTSERVE_FUSED_GEMV_DENSE):
    "0" (the default) none — MLX's own gemv reads a float matrix as fast at one row and is
    one launch; "rows" those of 2 to `MAX_ROWS` rows, where MLX goes to cuBLASLt, whose
    split-K products are two launches (a 0.8B-shaped bf16 step at N = 8 launched 24
    split-K reductions beside its 48 products: session 11); "mma" those of 2 to `MAX_ROWS`
    rows the tensor-core kernel takes (`mma_takes`) but the widest (`MMA_DENSE_MAX_OUT`) —
    as fast as cuBLASLt on the 0.8B's out projections (session 19), so not the default;
    "1" every one that fits."""
    return _switch(DENSE_ENV) if enabled() else "0"


MMA_DENSE_MAX_OUT = 16384  # wider plain products stay with cuBLASLt: the 0.8B's LM head at
# 8 rows read 508 MB in 125 us there, 147 in the first tensor-core kernel (session 19)


def _dense_mma(rows: int, K: int, dtype: mx.Dtype, w: Weight) -> bool:
    return (
        dense_mode() == "mma"
        and rows >= 2
        and w.shape[0] < MMA_DENSE_MAX_OUT
        and mma_takes(rows, K, dtype, w)
    )


def dense_takes(x: mx.array, w: Weight) -> bool:
    """Whether `matmul` sends the float product `x @ W.T` here (`dense_mode`)."""
    mode = dense_mode()
    if mode == "0" or not fits(x, w):
        return False
    rows = x.size // x.shape[-1]
    if mode == "mma" or rows > MAX_ROWS:  # (past 8 rows: tensor cores or not here)
        return _dense_mma(rows, x.shape[-1], x.dtype, w)
    return mode == "1" or rows >= 2


def prologue_enabled() -> bool:
    """Whether a product may fold the operation that makes its input into its own launch
    (`add_norm_gemv_cuda`, `swiglu_gemv_cuda`): with the kernel on, unless
    SLOTSERVE_FUSED_GEMV_PROLOGUE=0. A small decode step is bound by the host's launches, one
    per graph node, so two nodes made one pay even where MLX's gemv reads float weights as
    fast as this kernel."""
    return enabled() and env("SLOTSERVE_FUSED_GEMV_PROLOGUE", "1") != "0"


def _fits(rows: int, K: int, dtype: mx.Dtype, w: Weight) -> bool:
    if dtype not in _FLOATS or rows <= 0:
        return False
    if rows > MAX_ROWS:  # the tensor-core kernel's alone (its sums are 8 a lane, not R x OUTS)
        if isinstance(w, QuantizedWeight):
            return False
        return mma_takes(rows, K, dtype, w) and w.ndim == 2 and w.shape[1] == K
    if isinstance(w, QuantizedWeight):
        per_load = 128 // w.bits
        return (
            w.bits in (4, 8)
            and w.shape[1] == K
            and w.group_size % per_load == 0
            and K % w.group_size == 0
            and w.scales.dtype in _FLOATS
        )
    return w.ndim == 2 and w.shape[1] == K and w.dtype == dtype and K * w.itemsize % 16 == 0


def fits(x: mx.array, w: Weight) -> bool:
    """Whether `gemv_cuda(x, w)` takes this product: few rows, float x, a weight layout the
    kernel reads in 16-byte loads (rows of whole loads, whole groups per load)."""
    return x.size > 0 and _fits(x.size // x.shape[-1], x.shape[-1], x.dtype, w)


def preferred(x: mx.array, w: QuantizedWeight) -> bool:
    """Whether this kernel beats MLX's quantized matmul on a product it fits, as measured on
    the H200 (9B shapes, 8-bit; docs/PERFORMANCE.md, session 6): everywhere but at 8 rows on
    a matrix of 16384 outputs or more, where MLX's own kernel for many rows read 24576x4096
    in 2963 us against 3737 (32 matrices) and the LM head in 633 against 1022. (At 4 rows MLX
    read the LM head 3x slower than this kernel; 5-7 rows were not measured.)"""
    return _preferred(x.size // x.shape[-1], w)


def _preferred(rows: int, w: QuantizedWeight) -> bool:
    return rows < MAX_ROWS or w.shape[0] < 16384


# A prologue's price: every block of the product makes the x values it reads itself (the
# norm's sums, a SiLU per value), reading ~1.5x its own weight bytes again through the
# caches. Measured on the H200 (docs/PERFORMANCE.md, session 8), 0.8B-shaped bf16, compiled
# steps with decode-ahead: N = 1 440 -> 510 tok/s (launches, not the GPU, bound that step);
# N = 8 2474 -> 1609; the 9B-shaped q8_0 at N = 1 191 -> 153 (reads bound it). So one row,
# and a float matrix small enough that its launch outweighs its read.
PROLOGUE_MAX_BYTES = 32 << 20


PROLOGUES = ("add_norm", "swiglu")
STAGED_ENV = "SLOTSERVE_GEMV_STAGED"
STAGE_MAX_BYTES = 44 << 10  # the rows a block stages: with its static arrays, <= 48 KiB
STAGED_GROUPS = 8  # output groups per block of the staged kernel (with one warp each: 256
# threads, 32 outputs: a block's one pass over its rows serves 32 outputs, not 4; with
# `split` warps sharing K, 8 // split groups)


STAGED_MODES = ("rows", "0", "1")  # the default first
CHUNKS_ENV = "SLOTSERVE_GEMV_STAGE_CHUNKS"  # "0": rows wider than the stage are not staged
# in chunks (they go to the separate kernels, as before session 11): for measuring


def staged_mode() -> str:
    """Where prologues run in the staged kernel, which makes a block's input rows once in
    shared memory (SLOTSERVE_GEMV_STAGED): "rows" (the default) for float products of 2 to
    `MAX_ROWS` rows — measured on the H200 (docs/PERFORMANCE.md, session 10: 0.8B-shaped
    bf16 at N = 8 with decode-ahead, 12% and 14% faster than cuBLASLt's products beside
    separate add + RMSNorm and SwiGLU kernels, two pairs in one call), while one row stays
    on the unstaged prologue and quantized products on their own kernel (the 9B's one-row
    q8_0 products were 12% slower staged); "1" every product whose rows fit the stage;
    "0" none."""
    mode = _switch(STAGED_ENV)
    return mode if prologue_enabled() else "0"


def _staged(rows: int, K: int, dtype: mx.Dtype, w: Weight, kind: str) -> bool:
    """Whether a prologue product (`kind`: one of `PROLOGUES`) of `rows` rows of width `K`
    runs in the staged kernel."""
    mode = staged_mode()
    if mode == "0" or not stage_chunk(rows, K, dtype, w, kind):
        return False
    return mode == "1" or (rows >= 2 and not isinstance(w, QuantizedWeight))


def stage_chunk(
    rows: int, K: int, dtype: mx.Dtype, w: Weight, kind: str = "swiglu", split: int = 1
) -> int:
    """The values of K the staged kernel stages at a time for a product of `rows` rows of
    width `K` by `w` (0: it cannot take it): all K where the rows fit `STAGE_MAX_BYTES`;
    else, but for the add + RMSNorm prologue (whose norm needs its rows whole), the most
    that fit in whole rounds of the block's loads along K (`split` warps' 32 lanes' 16-byte
    weight loads: 256 bf16 values a warp), so every lane meets the values of K in the order
    the unchunked kernel does (the same sums, bit for bit) — the 0.8B's 8-row SwiGLU input,
    3584 wide (56 KiB), in chunks of 2816 and 768."""
    if rows * K * dtype.size <= STAGE_MAX_BYTES:
        return K
    if kind == "add_norm" or _switch(CHUNKS_ENV) == "0":
        return 0
    bits = w.bits if isinstance(w, QuantizedWeight) else 8 * w.itemsize
    per_round = 32 * split * (128 // bits)
    return STAGE_MAX_BYTES // (rows * dtype.size) // per_round * per_round


def takes_prologue(rows: int, K: int, dtype: mx.Dtype, w: Weight, kind: str = "add_norm") -> bool:
    """Whether a product of `rows` rows of width `K` in `dtype` (as the prologue will make
    them) by `w` takes a fused prologue of `kind` (one of `PROLOGUES`), switched on: where
    `staged_mode` stages it (by default float matrices at 2 to `MAX_ROWS` rows); at one row,
    a float matrix of less than `PROLOGUE_MAX_BYTES` in a layout the kernel reads — or, for
    the kinds SLOTSERVE_GEMV_PROLOGUE_QUANTIZED names (comma-separated; none by default), a
    quantized matrix this kernel is preferred for. That switch is for measuring (the 9B at
    one row, session 10: 162 tok/s with "swiglu", 177 without)."""
    if kind not in PROLOGUES:
        raise ValueError(f"takes_prologue: no prologue {kind!r} (one of {', '.join(PROLOGUES)})")
    if not (prologue_enabled() and _fits(rows, K, dtype, w)):  # (prologue first: the
        return False  # portable path's every layer of every eager step asks)
    if _staged(rows, K, dtype, w, kind):
        return not isinstance(w, QuantizedWeight) or _preferred(rows, w)
    if rows != 1 or staged_mode() == "1":  # ("1": what the stage does not take, nothing)
        return False
    if isinstance(w, QuantizedWeight):
        return kind in prologue_quantized() and _preferred(rows, w)
    return w.nbytes < PROLOGUE_MAX_BYTES


STAGED_SPLIT_ENV = "SLOTSERVE_GEMV_STAGED_SPLIT"
SPLITS = ("auto", "1", "2", "4", "8", "16")  # (16: one group of 16 warps a block)
SMS = 132  # the H200's multiprocessors

MMA_ENV = "SLOTSERVE_GEMV_MMA"
MMA_OUTS = 16  # outputs a warp of the tensor-core kernel owns (the fragment's 16 rows)
MMA_WARPS = 1024  # "auto" splits K until a product has this many warps (or 8 a group)
# At most 8 warps share K in the tensor-core kernel: 16 make a block of 512 threads, and
# at its ~165 registers a thread that asks for more than a multiprocessor's 65,536 (the
# H200 refused the launch: session 20, SLOTSERVE_GEMV_STAGED_SPLIT=16)
MMA_MAX_SPLIT = 8
MMA_UNROLL_ENV = "SLOTSERVE_GEMV_MMA_UNROLL"
MMA_DIRECT_ENV = "SLOTSERVE_GEMV_MMA_DIRECT"
MMA_BLOCKS_ENV = "SLOTSERVE_GEMV_MMA_BLOCKS"
MMA_MIN_ROUNDS = 4  # rounds of 32 values a warp keeps at least when blocks share K


def mma_takes(rows: int, K: int, dtype: mx.Dtype, w: Weight) -> bool:
    """Whether a staged product runs on tensor cores (`_MMA_SOURCE`; SLOTSERVE_GEMV_MMA,
    "1" by default, "0" for the kernel above): float weights of 2 bytes in x's dtype (bf16
    or f16, the fragments' types) and K in whole rounds of 32 values. Needs sm_80 or later."""
    return (
        _switch(MMA_ENV) == "1"
        and not isinstance(w, QuantizedWeight)
        and dtype in (mx.bfloat16, mx.float16)
        and w.dtype == dtype
        and K % 32 == 0
        and 1 <= rows <= mma_rows()
    )


MMA_ROWS_ENV = "SLOTSERVE_GEMV_MMA_ROWS"


def mma_rows() -> int:
    """The most rows a tensor-core product takes (SLOTSERVE_GEMV_MMA_ROWS): "8" (the
    default) or "16" — then 9-16 rows of x, as a daemon pads a step of 9-16 requests, take
    the fused products and prologues too, where at 16 rows MLX's cuBLAS GEMMs, their split-K
    reductions and the norms and SwiGLUs on their own made 231 launches a step against 134
    at 8 rows (H200, session 24: the step bound by the host's launches, its kernels 1.54
    against 1.61 ms). Built after session 24's lease; not yet run on a GPU."""
    return MMA_MAX_ROWS if _switch(MMA_ROWS_ENV) == "16" else MAX_ROWS


def mma_split(n_out: int, K: int) -> int:
    """Warps sharing K for the tensor-core kernel, "auto": the fewest of 1, 2, 4, 8 that give
    the product `MMA_WARPS` warps of 16 outputs, as long as each warp keeps 8 rounds of 32
    values or more (its loads of the next rounds in flight while it multiplies). A first
    guess: on the H200 the 8-row products at these splits still read only 0.4-1.3 TB/s
    (session 19); `SLOTSERVE_GEMV_STAGED_SPLIT` overrides it for measuring."""
    warps = -(-n_out // MMA_OUTS)
    split = 1
    while split < 8 and warps * split < MMA_WARPS and K // (32 * 2 * split) >= 8:
        split *= 2
    return split


def mma_blocks(n_out: int, K: int, split: int) -> int:
    """Blocks sharing K of a direct tensor-core product (`_MMA_BLOCK_TAIL`;
    SLOTSERVE_GEMV_MMA_BLOCKS: "auto", the default since session 22 — the H200 ran its tests
    and the 0.8B's 8-row down product took 11.5 against 14.9 us — or "1", one block): where
    `split` warps a column group leave the product short of `MMA_WARPS` warps, the fewest of
    2, 4, ... that reach it while every warp keeps `MMA_MIN_ROUNDS` rounds. From the shape
    alone, so a row's sums do not depend on how many rows share the launch. The 0.8B's
    down projection (1,024 x 3,584, split 8: 512 warps in 64 blocks): 2."""
    if _switch(MMA_BLOCKS_ENV) == "1":
        return 1
    warps = -(-n_out // MMA_OUTS) * split
    blocks = 1
    while warps * blocks < MMA_WARPS and K // (32 * split * blocks * 2) >= MMA_MIN_ROUNDS:
        blocks *= 2
    return blocks


def staged_split(n_out: int, outs: int, K: int = 0, mma: bool = False) -> int:
    """Warps per output group sharing K in the staged kernel (SLOTSERVE_GEMV_STAGED_SPLIT):
    "auto" (the default): 4 where one warp per group leaves fewer blocks than the GPU has
    multiprocessors, else 1 — the 0.8B's 1024-output down projection at 8 rows made 32
    blocks and read its 7.3 MB at ~0.2 TB/s, 34 us a launch; with 4 warps a group, 128
    blocks, 20 us (H200 timelines, docs/PERFORMANCE.md session 14: the 8-row step's kernels
    2.70 -> 2.24 ms); or "1", 2, 4, 8, 16 for every staged product (the tensor-core
    kernel's "auto" is `mma_split`; 16 is 8 there: `MMA_MAX_SPLIT`)."""
    mode = _switch(STAGED_SPLIT_ENV)
    if mode != "auto":
        return min(int(mode), MMA_MAX_SPLIT) if mma else int(mode)
    if mma:
        return mma_split(n_out, K)
    return 4 if -(-n_out // (outs * STAGED_GROUPS)) < SMS else 1


STAGE_AHEAD_ENV = "SLOTSERVE_GEMV_STAGE_AHEAD"
"""How many input rows' loads the staged kernel has in flight while it stages them: "1"
(the default, as before session 14: a row at a time, each a wait for memory) or "rows"
(all of them at once). Staged products at 8 rows took 16 us each for ~15 MB of weights on
the H200 (session 14 timeline), each block waiting through its rows before its first
weight load. The same values either way. Built after the lease; not run on a GPU yet."""
STAGED_UNROLL_ENV = "SLOTSERVE_GEMV_STAGED_UNROLL"
"""Rounds of weight loads in flight per lane in the staged kernel (`U`): 1 (the default),
2 or 4. A 1024-wide product's lane makes 4 rounds, each a wait for memory at U = 1. The same
sums either way. Built after session 14's lease; not run on a GPU yet."""


PROLOGUE_QUANTIZED_ENV = "SLOTSERVE_GEMV_PROLOGUE_QUANTIZED"

# Every switch this module reads but SLOTSERVE_FUSED_GEMV(_PROLOGUE) (`cuda.switched_on`):
# the values it takes, its default first.
SWITCHES: dict[str, tuple[str, ...]] = {
    DENSE_ENV: DENSE_MODES,
    STAGED_ENV: STAGED_MODES,
    CHUNKS_ENV: ("1", "0"),
    STAGED_SPLIT_ENV: SPLITS,
    MMA_ENV: ("1", "0"),
    MMA_UNROLL_ENV: ("4", "1", "2", "8"),
    MMA_DIRECT_ENV: ("1", "0"),
    MMA_BLOCKS_ENV: ("auto", "1"),
    MMA_ROWS_ENV: ("8", "16"),
    STAGE_AHEAD_ENV: ("1", "rows"),
    STAGED_UNROLL_ENV: ("1", "2", "4"),
}


def _switch(name: str) -> str:
    return _env_choice(name, SWITCHES[name])


def prologue_quantized(value: str | None = None) -> list[str]:
    """The prologue kinds SLOTSERVE_GEMV_PROLOGUE_QUANTIZED names (comma-separated, each one
    of `PROLOGUES`; none by default), from `value` or the environment."""
    if value is None:
        value = env(PROLOGUE_QUANTIZED_ENV, "")
    kinds = [k for k in value.split(",") if k]
    bad = [k for k in kinds if k not in PROLOGUES]
    if bad:
        raise ValueError(
            f"{PROLOGUE_QUANTIZED_ENV}={value!r}: comma-separated of {', '.join(PROLOGUES)}"
        )
    return kinds


def _env_choice(name: str, choices: tuple[str, ...], default: str | None = None) -> str:
    """The environment variable `name`, one of `choices` (unset: `default`, else the first);
    anything else raises, naming the variable."""
    value = env(name, choices[0] if default is None else default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: one of {', '.join(choices)}")
    return value


def split_for(rows: int, n_out: int, outs: int) -> int:
    """Warps per block sharing K, as measured on the H200 (9B shapes, 8-bit;
    docs/PERFORMANCE.md, session 6): 4 for one row of a matrix with fewer than 2048 blocks
    of outputs (the 4096- and 12288-wide ones: 4x the warps in flight), else 1 (wide
    matrices have warps enough, and at 8 rows each warp's own work is what counts)."""
    return 4 if rows == 1 and -(-n_out // outs) < 2048 else 1


def gemv_cuda(
    x: mx.array,
    w: Weight,
    outs: int = 4,
    unroll: int | None = None,
    split: int | None = None,
    staged: bool | None = None,
) -> mx.array:
    """`x @ W.T` for `x` `[..., K]` with at most `MAX_ROWS` rows and `W` `(N, K)` (float in
    x's dtype, or affine-quantized), in x's dtype; `fits(x, w)` must hold. Tuning knobs
    (`bench/gemv_bench.py`): `outs` outputs per block (the tensor-core kernel's: 16 a warp),
    `unroll` rounds of loads in flight, `split` warps per block sharing the outputs' K
    (None: `split_for`); `staged`: through the staged kernel (None: where
    SLOTSERVE_FUSED_GEMV_DENSE=mma sends it, on tensor cores)."""
    if not fits(x, w):
        raise ValueError(f"gemv_cuda: x {x.shape} {x.dtype} does not fit this kernel's layouts")
    R, K = x.size // x.shape[-1], x.shape[-1]
    if staged is None:
        staged = _dense_mma(R, K, x.dtype, w)
    (out,) = _launch(_PLAIN, [x.reshape(R, K)], w, R, outs, unroll, split, staged=staged)
    return out.reshape(*x.shape[:-1], w.shape[0])


def add_norm_gemv_cuda(
    x: mx.array,
    m: mx.array,
    norm: mx.array,
    eps: float,
    w: Weight,
    outs: int = 4,
    unroll: int | None = None,
    split: int | None = None,
) -> tuple[mx.array, mx.array]:
    """The residual sum `h = x + m` and `rms_norm(h) * norm @ W.T`, in ONE launch: what
    `add_norm_cuda.add_rms_norm_cuda` then `gemv_cuda` compute, rounded where they round
    (`norm`: the norm's weight in float32). `x`, `m` `[R, K]` of one float dtype."""
    R, K = x.shape if x.ndim == 2 else (0, 0)
    if m.shape != x.shape or m.dtype != x.dtype or norm.shape != (K,) or not fits(x, w):
        raise ValueError(
            f"add_norm_gemv_cuda: x {x.shape} {x.dtype}, m {m.shape} {m.dtype}, "
            f"norm {norm.shape} do not fit this kernel's layouts"
        )
    inputs = [x, m, norm.astype(mx.float32)]
    staged = _staged(R, K, x.dtype, w, "add_norm")
    out, h = _launch(_ADD_NORM, inputs, w, R, outs, unroll, split, eps=eps, staged=staged)
    return h, out


def swiglu_gemv_cuda(
    gu: mx.array, w: Weight, outs: int = 4, unroll: int | None = None, split: int | None = None
) -> mx.array:
    """`(silu(gate) * up) @ W.T` for the joined `gu` `[R, 2K]` (gate, then up), in ONE
    launch: what `swiglu_cuda.swiglu_cuda` then `gemv_cuda` compute, rounded where they
    round."""
    R, K2 = gu.shape if gu.ndim == 2 else (0, 1)
    if K2 % 2 or not _fits(R, K2 // 2, gu.dtype, w):
        raise ValueError(f"swiglu_gemv_cuda: gu {gu.shape} {gu.dtype} does not fit this kernel")
    staged = _staged(R, K2 // 2, gu.dtype, w, "swiglu")
    (out,) = _launch(_SWIGLU, [gu], w, R, outs, unroll, split, staged=staged)
    return out


# Prologues: what the kernel computes its input values from (`PRO` in its source).
_PLAIN, _ADD_NORM, _SWIGLU = 0, 1, 2
_INPUTS = {_PLAIN: ["x"], _ADD_NORM: ["x", "m", "nw"], _SWIGLU: ["x"]}


def _launch(
    pro: int,
    inputs: list[mx.array],
    w: Weight,
    R: int,
    outs: int,
    unroll: int | None,
    split: int | None,
    eps: float = 0.0,
    staged: bool = False,
) -> list[mx.array]:
    N = w.shape[0]
    K = inputs[0].shape[1] // (2 if pro == _SWIGLU else 1)
    kind = "add_norm" if pro == _ADD_NORM else "swiglu"  # (a plain product chunks as SwiGLU)
    mma = staged and mma_takes(R, K, inputs[0].dtype, w)
    # x read in the product, nothing staged (SLOTSERVE_GEMV_MMA_DIRECT=0: staged, for measuring)
    direct = mma and pro != _ADD_NORM and _switch(MMA_DIRECT_ENV) == "1"
    if mma:
        outs = MMA_OUTS
    if split is None and staged:
        split = staged_split(N, outs, K, mma)
        # a split whose round of loads is wider than a chunk that fits the stage: one warp
        split = split if direct or stage_chunk(R, K, inputs[0].dtype, w, kind, split) else 1
    elif split is None:
        split = split_for(R, N, outs)
    if mma:
        unroll = unroll or int(_switch(MMA_UNROLL_ENV))
    unroll = unroll or (int(_switch(STAGED_UNROLL_ENV)) if staged else 1)
    groups = max(1, STAGED_GROUPS // split) if staged else 1  # at most 256 threads a block
    if not (outs >= 1 and (mma or R * outs <= 32) and unroll >= 1 and 1 <= split * groups <= 32):
        raise ValueError(
            f"gemv_cuda: no kernel for {R} rows, outs={outs} unroll={unroll} split={split}"
        )
    names = list(_INPUTS[pro])
    if isinstance(w, QuantizedWeight):
        bits = w.bits
        inputs = [*inputs, w.weight, w.scales, w.biases]
        names += ["w", "scales", "biases"]
        extra = [("S", w.scales.dtype), ("GS", w.group_size)]
    else:
        bits = 8 * w.itemsize
        inputs, names = [*inputs, w], [*names, "w"]
        extra = [("W", w.dtype)]
    outputs = ["out", "h"] if pro == _ADD_NORM else ["out"]
    shapes: list[tuple[int, ...]] = [(R, N), (R, K)] if pro == _ADD_NORM else [(R, N)]
    dtype = inputs[0].dtype
    dtypes, public = [dtype] * len(outputs), len(outputs)
    column_groups = -(-N // (outs * groups))
    blocks = mma_blocks(N, K, split) if direct else 1
    if blocks > 1:  # the arrival counts as the last input, the block sums as a second output
        inputs, names = [*inputs, arrival_counts(column_groups)], [*names, "counts"]
        outputs, shapes, dtypes = (
            [*outputs, "part"],
            [*shapes, (blocks, R, N)],
            [*dtypes, mx.float32],
        )
    source = _source(names, pro, eps, staged, mma)
    variant = f"{','.join(names)}|{pro}|{eps!r}"
    if staged:  # dynamic shared memory is the kernel's, not the launch's: bucket it
        chunk = K if direct else stage_chunk(R, K, dtype, w, kind, split)
        if not chunk:
            raise ValueError(f"gemv_cuda: {R} rows of {K} do not fit the stage")
        need = 0 if direct else R * chunk * dtype.size
        if mma:  # the warps' sums meet in the stage after the last chunk (8 a lane past 8 rows)
            need = max(need, split * groups * 32 * (8 if R > MAX_ROWS else 4) * 4)
        stage = -(-need // 4096) * 4096  # (CUDA's limit without opting in)
        family = "gemv_mma" if mma else "gemv_staged"
        variant += f"|staged {stage}"
        kernel = cached_kernel(family, variant, names, outputs, source, shared_memory=stage)
        # (the tensor-core kernel's weights are in flight meanwhile: its rows all at once)
        ahead = min(R, MAX_ROWS) if mma or _switch(STAGE_AHEAD_ENV) == "rows" else 1
        extra += [("G", groups), ("KC", chunk), ("RA", ahead)]
        if mma:
            extra += [("BF", int(dtype == mx.bfloat16)), ("DIRECT", int(direct)), ("BS", blocks)]
    else:
        kernel = cached_kernel("gemv", variant, names, outputs, source)
    made = kernel(
        inputs=inputs,
        template=[
            ("T", dtype),
            ("R", R),
            ("BITS", bits),
            ("VEC", 128 // bits),
            ("OUTS", outs),
            ("U", unroll),
            ("SPLIT", split),
            *extra,
        ],
        grid=(column_groups * 32 * split * groups, blocks, 1),
        threadgroup=(32 * split * groups, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )
    return list(made[:public])


def _source(
    names: list[str], pro: int = _PLAIN, eps: float = 0.0, staged: bool = False, mma: bool = False
) -> str:
    """The kernel body for one prologue: the inputs it does not take stand as null pointers
    (a float weight has no scales to read, and its own type `W`); `staged`: the kernel that
    makes its input rows once per block in shared memory; `mma`: its tensor-core form."""
    lines = [f"    constexpr int PRO = {pro};", f"    constexpr float EPS = {eps!r}f;"]
    if "scales" in names:
        lines.append("    using W = unsigned char;")
    else:
        lines += [
            "    using S = float;",
            "    constexpr int GS = 1;",
            "    const float* scales = nullptr; const float* biases = nullptr;",
        ]
    if "m" not in names:
        lines.append("    const T* m = nullptr; const float* nw = nullptr; T* h = nullptr;")
    if mma and "counts" not in names:  # (a product K is not shared by blocks in: BS = 1)
        lines.append("    const int32_t* counts = nullptr; float* part = nullptr;")
    body = _MMA_SOURCE if mma else _STAGED_SOURCE if staged else _SOURCE
    return "\n".join(lines) + "\n" + body
