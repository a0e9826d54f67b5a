"""Gated full attention between the two projections as TWO CUDA kernels.

The portable path (`engine.models.qwen35.Attention`) runs some twenty MLX
operations per layer between the fused q/k/v projection and the output
projection: splits and copies, the q and k RMSNorms, two ropes, transposes,
the append of the new keys to the past, the attention itself (MLX's fused
attention takes no per-row mask on CUDA, so it falls back to separate matmuls
and a softmax), the sigmoid gate and the gathers between the packed and padded
views of the batch. On MLX's CUDA backend each costs a fixed launch overhead
that dwarfs its work at small batch, so here:

1. `prepare`: one warp per (packed token, head) reads the projection as it is,
   normalises and rotates the token's query and key heads, and writes queries
   (model dtype) and the new keys and values (the pool's dtype: attention reads
   exactly what the pool will store, as on the portable path);
2. `attend`: a block per (row, position, query head) attends to the row's past
   keys below its start and the row's new keys up to its own position (online
   softmax over warps, each loading a few keys at once), applies the sigmoid gate
   and writes the packed input of the output projection.

A batch whose rows are one token each (a decode step) can take ONE kernel instead
(`DECODE_ENV`): each `attend` block first makes its own query head and its group's new key
and value as `prepare` would, rounded where `prepare` stores them, into shared memory; the
group's first head writes the new key and value out for the pool. Same values, one launch
a layer fewer.

Numerics: f32 arithmetic throughout; tests compare with the portable path.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels.cuda import (
    arrival,
    arrival_counts,
    cached_kernel,
    env,
    env_flag,
    switched_on,
)

# One head of `proj`'s packed row n from column `col`: RMS-normalised by its norm weight and
# rotated at position `pos` into `r`, and for a key (`!is_q`) its value head into `vv`; `y`
# is the warp's scratch of D floats. Every global load comes before any global store after
# it (the compiler cannot tell the outputs from the inputs: a load after a store would wait
# for it, one round trip each).
_MAKE_HEAD = """\
    float r[PER], vv[PER];
    {
        float x[PER];
        float ss = 0.0f;
        #pragma unroll
        for (int e = 0; e < PER; ++e) {
            x[e] = static_cast<float>(proj[long(n) * W + col + lane + 32 * e]);
            ss += x[e] * x[e];
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, off);
        const float inv = rsqrtf(ss / D + EPS);
        const float* nw = is_q ? q_norm : k_norm;
        float om[PER];
        #pragma unroll
        for (int e = 0; e < PER; ++e) {
            const int j = lane + 32 * e;
            om[e] = j < ROPE_DIM ? omega[j < HALF ? j : j - HALF] : 0.0f;
            vv[e] = is_q ? 0.0f
                : static_cast<float>(proj[long(n) * W + 2 * H * D + HKV * D + kvh * D + j]);
        }
        #pragma unroll
        for (int e = 0; e < PER; ++e) y[lane + 32 * e] = x[e] * inv * nw[lane + 32 * e];
        __syncwarp();
        #pragma unroll
        for (int e = 0; e < PER; ++e) {
            const int j = lane + 32 * e;
            r[e] = y[j];
            if (j < ROPE_DIM) {
                const int i = j < HALF ? j : j - HALF;
                float sn, cs;
                sincosf(float(pos) * om[e], &sn, &cs);
                r[e] = j < HALF ? y[j] * cs - y[j + HALF] * sn : y[j] * cs + y[i] * sn;
            }
        }
        __syncwarp();  // every lane's rotation read its partners before y is written again
    }
"""

_PREPARE = (
    """
    constexpr int PER = D / 32;
    constexpr int HALF = ROPE_DIM / 2;
    const int lane = threadIdx.x & 31;
    const int unit = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (unit >= proj_shape[0] * (H + HKV)) return;
    const int n = unit / (H + HKV);
    const int head = unit % (H + HKV);
    const bool is_q = head < H;
    const int kvh = head - H;
    const int col = is_q ? head * 2 * D : 2 * H * D + kvh * D;
    const int T = pad_index_shape[1];
    const int b = pack_index[n] / T;
    const int pos = row_starts[b] + pack_index[n] % T;
    __shared__ float buf[(BLOCK / 32) * D];
    float* y = buf + (threadIdx.x >> 5) * D;
"""
    + _MAKE_HEAD
    + """\
    #pragma unroll
    for (int e = 0; e < PER; ++e) {
        const int j = lane + 32 * e;
        if (is_q) {
            q_out[(long(n) * H + head) * D + j] = static_cast<OUT_T>(r[e]);
        } else {
            k_out[(long(n) * HKV + kvh) * D + j] = static_cast<KV_T>(r[e]);
            v_out[(long(n) * HKV + kvh) * D + j] = static_cast<KV_T>(vv[e]);
        }
    }
"""
)

# Both attention kernels' end: each warp folds its U loaded keys into its online softmax
# (closing the loop over keys), then the block's warps merge theirs, gate and write the row.
_KEYS = """\
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (j0 + u > last) break;
            float s = 0.0f;
            #pragma unroll
            for (int e = 0; e < PER; ++e) s += q[e] * kf[u][e];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
            const float m2 = fmaxf(m, s);
            const float keep = expf(m - m2), p = expf(s - m2);
            l = l * keep + p;
            #pragma unroll
            for (int e = 0; e < PER; ++e) o[e] = o[e] * keep + p * vf[u][e];
            m = m2;
        }
    }
    if (lane == 0) { part_m[w] = m; part_l[w] = l; }
    #pragma unroll
    for (int e = 0; e < PER; ++e) part_o[w][lane + 32 * e] = o[e];
    __syncthreads();
    float mm = -1e30f;
    #pragma unroll
    for (int i = 0; i < NW; ++i) mm = fmaxf(mm, part_m[i]);
    float ll = 0.0f;
    #pragma unroll
    for (int i = 0; i < NW; ++i) ll += part_l[i] * expf(part_m[i] - mm);
"""

_OUT = """\
    for (int d = threadIdx.x; d < D; d += BLOCK) {
        float acc = 0.0f;
        #pragma unroll
        for (int i = 0; i < NW; ++i) acc += part_o[i][d] * expf(part_m[i] - mm);
        const float g = static_cast<float>(proj[n * W + h * 2 * D + D + d]);
        out[(n * H + h) * D + d] = static_cast<OUT_T>(acc / ll / (1.0f + expf(-g)));
    }
"""

# A decode row's keys shared by blocks (`blockIdx.y`, CHUNK positions each; SPLITS > 1): a
# row whose keys fit one chunk writes its output as above; otherwise each of its blocks
# writes its softmax state (the block's max, sum and weighted values) to `part`, and the
# row-head's last block to arrive (a count each in `counts`, reset by it) merges them in
# block order and writes the output: the same sums whichever block is last, and a row's
# blocks are set by its own length, so its result does not depend on the rows beside it.
_SPLIT_OUT = (
    """\
    if (start < CHUNK) {  // one block's keys: its output as unsplit
"""
    + _OUT
    + """\
        return;
    }
    const int parts = start / CHUNK + 1;  // the row's blocks (keys 0 .. start)
    const long rh = long(b) * H + h;
    float* mine = part + (rh * SPLITS + split) * (D + 2);
    for (int d = threadIdx.x; d < D; d += BLOCK) {
        float acc = 0.0f;
        #pragma unroll
        for (int i = 0; i < NW; ++i) acc += part_o[i][d] * expf(part_m[i] - mm);
        mine[d] = acc;
    }
    if (threadIdx.x == 0) { mine[D] = mm; mine[D + 1] = ll; }
"""
    + arrival("rh", "parts")
    + """\
    const float* row = part + rh * SPLITS * (D + 2);
    float M = -1e30f, L = 0.0f;
    for (int i = 0; i < parts; ++i) M = fmaxf(M, __ldcg(row + i * (D + 2) + D));
    for (int i = 0; i < parts; ++i)
        L += __ldcg(row + i * (D + 2) + D + 1) * expf(__ldcg(row + i * (D + 2) + D) - M);
    for (int d = threadIdx.x; d < D; d += BLOCK) {
        float acc = 0.0f;
        for (int i = 0; i < parts; ++i)
            acc += __ldcg(row + i * (D + 2) + d) * expf(__ldcg(row + i * (D + 2) + D) - M);
        const float g = static_cast<float>(proj[n * W + h * 2 * D + D + d]);
        out[(n * H + h) * D + d] = static_cast<OUT_T>(acc / L / (1.0f + expf(-g)));
    }
"""
)

_ATTEND = (
    """
    constexpr int PER = D / 32;
    constexpr int NW = BLOCK / 32;
    const int lane = threadIdx.x & 31;
    const int w = threadIdx.x >> 5;
    const int T = pad_index_shape[1];
    // The past is read through its strides ([.., B, S, HKV, D], D unit-strided): a pool view
    // of several slots' first S entries is not contiguous, and copying it would cost a
    // launch and its bytes per layer and step.
    const int ND = k_past_ndim;
    const int S = k_past_shape[ND - 3];
    const long KB = k_past_strides[ND - 4], KS = k_past_strides[ND - 3];
    const long KH = k_past_strides[ND - 2];
    const long VB = v_past_strides[ND - 4], VS = v_past_strides[ND - 3];
    const long VH = v_past_strides[ND - 2];
    const int h = blockIdx.x % H;
    const int t = (blockIdx.x / H) % T;
    const int b = blockIdx.x / (H * T);
    if (t >= row_lengths[b]) return;  // padding: no packed token to write
    const int kvh = h / (H / HKV);
    const int start = row_starts[b];
    const long n = pad_index[b * T + t];
    __shared__ float part_m[NW], part_l[NW];
    __shared__ float part_o[NW][D];

    float q[PER], o[PER];
    #pragma unroll
    for (int e = 0; e < PER; ++e) {
        q[e] = static_cast<float>(q_in[(n * H + h) * D + lane + 32 * e]) * SCALE;
        o[e] = 0.0f;
    }
    // Each warp takes U keys at a time: their K and V rows are loaded together, so a warp
    // waits on memory once per U keys, not twice per key.
    float m = -1e30f, l = 0.0f;
    const int last = start + t;
    for (int j0 = w * U; j0 <= last; j0 += NW * U) {
        float kf[U][PER], vf[U][PER];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u;
            if (j > last) break;
            const bool past = j < start;
            const long at_new = (long(pad_index[b * T + (past ? 0 : j - start)]) * HKV + kvh) * D;
            const long at_k = past ? b * KB + j * KS + kvh * KH : at_new;
            const long at_v = past ? b * VB + j * VS + kvh * VH : at_new;
            const auto* ks = past ? k_past : k_new;
            const auto* vs = past ? v_past : v_new;
            #pragma unroll
            for (int e = 0; e < PER; ++e) {
                kf[u][e] = static_cast<float>(ks[at_k + lane + 32 * e]);
                vf[u][e] = static_cast<float>(vs[at_v + lane + 32 * e]);
            }
        }
"""
    + _KEYS
    + _OUT
)


# The decode kernel: `attend` for rows of one token, making its inputs itself. Warp 0 makes
# the block's query head, warp 1 its group's new key and value, each as `prepare` does (its
# per-warp scratch is the head's row of `made`), then every warp attends as in `_ATTEND`,
# the row's one new position read from `made`.
_DECODE_BODY = (
    """
    constexpr int PER = D / 32;
    constexpr int NW = BLOCK / 32;
    constexpr int HALF = ROPE_DIM / 2;
    const int lane = threadIdx.x & 31;
    const int w = threadIdx.x >> 5;
    const int ND = k_past_ndim;
    const long KB = k_past_strides[ND - 4], KS = k_past_strides[ND - 3];
    const long KH = k_past_strides[ND - 2];
    const long VB = v_past_strides[ND - 4], VS = v_past_strides[ND - 3];
    const long VH = v_past_strides[ND - 2];
    const int h = blockIdx.x % H;
    const int b = blockIdx.x / H;
    if (row_lengths[b] < 1) return;  // padding: no packed token to write
    const int kvh = h / (H / HKV);
    const int start = row_starts[b];
    const long n = pad_index[b];
@SPLIT_TOP@    __shared__ float made[3][D];  // the query head (rounded to OUT_T), new key, value (KV_T)
    __shared__ float part_m[NW], part_l[NW];
    __shared__ float part_o[NW][D];

    if (w < 2) {
        const bool is_q = w == 0;
        const int col = is_q ? h * 2 * D : 2 * H * D + kvh * D;
        const int pos = start;
        float* y = made[w];
"""
    + _MAKE_HEAD
    + """\
        const bool writes = !is_q && h % (H / HKV) == 0 @FIRST@;  // the group's first head stores
        #pragma unroll
        for (int e = 0; e < PER; ++e) {
            const int j = lane + 32 * e;
            if (is_q) {
                y[j] = static_cast<float>(static_cast<OUT_T>(r[e]));
            } else {
                const KV_T kr = static_cast<KV_T>(r[e]), vr = static_cast<KV_T>(vv[e]);
                y[j] = static_cast<float>(kr);
                made[2][j] = static_cast<float>(vr);
                if (writes) {
                    k_out[(n * HKV + kvh) * D + j] = kr;
                    v_out[(n * HKV + kvh) * D + j] = vr;
                }
            }
        }
    }
    __syncthreads();

    float q[PER], o[PER];
    #pragma unroll
    for (int e = 0; e < PER; ++e) {
        q[e] = made[0][lane + 32 * e] * SCALE;
        o[e] = 0.0f;
    }
    float m = -1e30f, l = 0.0f;
@RANGE@    for (int j0 = first + w * U; j0 <= last; j0 += NW * U) {
        float kf[U][PER], vf[U][PER];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u;
            if (j > last) break;
            if (j < start) {
                const long at_k = b * KB + j * KS + kvh * KH, at_v = b * VB + j * VS + kvh * VH;
                #pragma unroll
                for (int e = 0; e < PER; ++e) {
                    kf[u][e] = static_cast<float>(k_past[at_k + lane + 32 * e]);
                    vf[u][e] = static_cast<float>(v_past[at_v + lane + 32 * e]);
                }
            } else {
                #pragma unroll
                for (int e = 0; e < PER; ++e) {
                    kf[u][e] = made[1][lane + 32 * e];
                    vf[u][e] = made[2][lane + 32 * e];
                }
            }
        }
"""
)

_DECODE = (
    _DECODE_BODY.replace("@SPLIT_TOP@", "")
    .replace(" @FIRST@", "")
    .replace("@RANGE@", "    const int first = 0, last = start;\n")
    + _KEYS
    + _OUT
)

# (a block whose chunk starts past the row's keys has nothing to do; the row's first block
# stores the new key and value)
_DECODE_SPLIT = (
    _DECODE_BODY.replace(
        "@SPLIT_TOP@",
        "    const int split = blockIdx.y;  // the row's block\n    if (split * CHUNK > start) return;\n",
    )
    .replace(" @FIRST@", " && split == 0")
    .replace(
        "@RANGE@",
        "    const int first = split * CHUNK;\n"
        "    const int last = start < first + CHUNK - 1 ? start : first + CHUNK - 1;\n",
    )
    + _KEYS
    + _SPLIT_OUT
)

DECODE_ENV = "SLOTSERVE_ATTENTION_DECODE"
SPLIT_ENV = "SLOTSERVE_ATTENTION_SPLIT"
SPLIT_CHUNKS = ("0", "64", "128", "256")
SPLIT_DEFAULT = "128"


def enabled() -> bool:
    """On MLX's CUDA backend, unless SLOTSERVE_FUSED_ATTENTION=0."""
    return switched_on("ATTENTION")


def decode_kernel() -> bool:
    """Whether rows of one token take the one-kernel decode path (SLOTSERVE_ATTENTION_DECODE:
    "1", the default since session 20's H200 run — its tests passed there and a 0.8B step's
    attention at 8 rows took 108 against 117 us, six launches fewer — or "0", `prepare` then
    `attend` as prefill rows take them)."""
    return env_flag(DECODE_ENV, "1")


def split_chunk() -> int:
    """Keys a block of the decode kernel takes when a row's keys are shared by blocks
    (SLOTSERVE_ATTENTION_SPLIT: 128, the default since session 22 — the H200 ran its tests, and
    at a 4,096-key context a 0.8B layer's decode attention took 48.5 against 354.8 us at
    one row, 128.4 against 355.0 at eight; or 64, 256, or "0": one block a row and head,
    whatever its keys). A row of at most that many keys is computed as unsplit, bit for bit."""
    value = env(SPLIT_ENV, SPLIT_DEFAULT)
    if value not in SPLIT_CHUNKS:
        raise ValueError(f"{SPLIT_ENV}={value!r}: one of {', '.join(SPLIT_CHUNKS)}")
    return int(value)


def attention_cuda(
    proj: mx.array,
    pad_index: mx.array,
    pack_index: mx.array,
    row_starts: mx.array,
    row_lengths: mx.array,
    k_past: mx.array,
    v_past: mx.array,
    q_norm: mx.array,
    k_norm: mx.array,
    omega: mx.array,
    *,
    n_heads: int,
    n_kv_heads: int,
    rope_dim: int,
    eps: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """One attention layer's core for a batch of rows, packed in and packed out.

    `proj` `[N, W]`: the packed output of the fused projection, columns
    `[per head (q D | gate D) x H | k Hkv*D | v Hkv*D]`; the `Layout` arrays of the
    batch; `k_past`, `v_past` `[B, S, Hkv, D]`, or with a leading axis of 1 (S >= 1; row
    b's first `row_starts[b]` entries are read; any strides but a unit one along D); the
    q/k norm weights; `omega` `[rope_dim/2]`, the angular frequency of each rotary pair (0:
    unrotated).
    Returns the gated attention output `[N, H*D]` in `proj`'s dtype and the new
    keys and values `[N, Hkv, D]` in the past's dtype (what the pool stores).
    """
    N, W = proj.shape
    B, S, Hkv, D = k_past.shape[-4:]
    if (
        k_past.ndim > 5
        or v_past.shape != k_past.shape
        or D % 32
        or Hkv != n_kv_heads
        or n_heads % n_kv_heads
        or S < 1
    ):
        raise ValueError(f"attention_cuda: unsupported shapes past={k_past.shape} H={n_heads}")
    T = pad_index.shape[1]
    f32, kv_dtype = mx.float32, k_past.dtype
    common = [("OUT_T", proj.dtype), ("KV_T", kv_dtype), ("H", n_heads), ("HKV", Hkv)]
    common += [("D", D), ("W", W)]
    scale = 1.0 / float(D) ** 0.5
    block = 256
    if T == 1 and decode_kernel():
        # blocks a row and head: from the past's length S (a shape: a row's keys are at most
        # S + 1), so the launch is the same for every step of one shape
        chunk = split_chunk()
        splits = -(-(S + 1) // chunk) if chunk else 1
        names = [
            "proj",
            "k_past",
            "v_past",
            "pad_index",
            "row_starts",
            "row_lengths",
            "q_norm",
            "k_norm",
            "omega",
        ]
        inputs = [
            proj,
            k_past,
            v_past,
            pad_index,
            row_starts,
            row_lengths,
            q_norm.astype(f32),
            k_norm.astype(f32),
            omega.astype(f32),
        ]
        outputs = ["out", "k_out", "v_out"]
        shapes = [(N, n_heads * D), (N, Hkv, D), (N, Hkv, D)]
        dtypes = [proj.dtype, kv_dtype, kv_dtype]
        template = [*common, ("ROPE_DIM", rope_dim), ("BLOCK", block), ("U", 4)]
        body, variant = _DECODE, "decode"
        if splits > 1:  # the arrival counts in, each block's softmax state out
            names, inputs = [*names, "counts"], [*inputs, arrival_counts(B * n_heads)]
            outputs = [*outputs, "part"]
            shapes, dtypes = [*shapes, (B * n_heads, splits, D + 2)], [*dtypes, f32]
            template += [("CHUNK", chunk), ("SPLITS", splits)]
            body, variant = _DECODE_SPLIT, "decode_split"
        decode = cached_kernel(
            "attention",
            f"{variant}_{eps!r}_{scale!r}",
            names,
            outputs,
            f"    constexpr float EPS = {eps!r}f;\n    constexpr float SCALE = {scale!r}f;\n"
            + body,
            contiguous=False,  # (the past through its strides; the rest contiguous as made)
        )
        out, k, v, *_ = decode(
            inputs=inputs,
            template=template,
            grid=(B * n_heads * block, splits, 1),
            threadgroup=(block, 1, 1),
            output_shapes=shapes,
            output_dtypes=dtypes,
        )
        return out, k, v
    prepare = cached_kernel(
        "attention",
        f"prepare_{eps!r}",
        ["proj", "pad_index", "pack_index", "row_starts", "q_norm", "k_norm", "omega"],
        ["q_out", "k_out", "v_out"],
        f"    constexpr float EPS = {eps!r}f;\n" + _PREPARE,
    )
    units, per_block = N * (n_heads + Hkv), 4
    q, k, v = prepare(
        inputs=[
            proj,
            pad_index,
            pack_index,
            row_starts,
            q_norm.astype(f32),
            k_norm.astype(f32),
            omega.astype(f32),
        ],
        template=[*common, ("ROPE_DIM", rope_dim), ("BLOCK", 32 * per_block)],
        grid=(-(-units // per_block) * 32 * per_block, 1, 1),
        threadgroup=(32 * per_block, 1, 1),
        output_shapes=[(N, n_heads, D), (N, Hkv, D), (N, Hkv, D)],
        output_dtypes=[proj.dtype, kv_dtype, kv_dtype],
    )
    attend = cached_kernel(
        "attention",
        f"attend_{scale!r}",
        [
            "proj",
            "q_in",
            "k_new",
            "v_new",
            "k_past",
            "v_past",
            "pad_index",
            "row_starts",
            "row_lengths",
        ],
        ["out"],
        f"    constexpr float SCALE = {scale!r}f;\n" + _ATTEND,
        # the past is read through its strides; every other input is a kernel's or a
        # product's output or a layout array, contiguous as made
        contiguous=False,
    )
    (out,) = attend(
        inputs=[proj, q, k, v, k_past, v_past, pad_index, row_starts, row_lengths],
        template=[*common, ("BLOCK", block), ("U", 4)],
        grid=(B * T * n_heads * block, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(N, n_heads * D)],
        output_dtypes=[proj.dtype],
    )
    return out, k, v
