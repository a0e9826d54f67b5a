"""Each row's `C` largest logits' ids as ONE CUDA kernel, a block a row: a radix select.

A sampled row with top-k <= `sampling.CANDIDATES` draws from its 1,024 largest logits
(`engine.sampling._candidate_weights`). MLX 0.32's CUDA `argpartition` is its full
`gpu_sort`: on the H200 a sampled 8-row step of the 0.8B (V = 248,320) spent ~220 us in
15 sort launches to find them (session 24 timeline: `mb_block_sort` 109 us, 6 merges 85 us,
6 partitions 29 us), on a step bound by the host's launches. Here a block reads its row
from the cache a few times instead and writes the ids:

1. the row's values as order-preserving 32-bit keys; four passes of a 256-bin histogram
   (shared memory), each over the keys that match the bytes chosen so far, find the key of
   the `C`-th largest value, `T`, and how many values equal to it are taken (`want`);
2. where more values equal T than are taken (ties at the edge: bf16 logits have many),
   passes over their indices, 6 bits at a time (three for V < 2^18), find the `want`-th
   smallest index `I`: the ties taken are the first ones in the row, as a stable sort's;
3. one pass writes every id with a key above T, and with T at an index <= I, through a
   block counter: `C` ids in an order that varies, the set never — `topk_ids` sorts them.

Values are compared as floats are: -0.0 equals 0.0 (a tie). A NaN's key is above +inf or
below -inf by its sign; a row whose logits are not finite fails whatever it drew
(`scheduler/step.py`).
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels import cuda

ENV = "SLOTSERVE_TOPK"
NT = 1024  # threads a block (a row)

_SOURCE = """
    const long V = x_shape[1];
    const long r = blockIdx.x;
    const T* row = x + r * V;
    const unsigned lane = threadIdx.x & 31u;
    auto key = [](float v) {  // greater float, greater key (-0.0 the key of 0.0: equal floats)
        const unsigned u = __float_as_uint(v == 0.0f ? 0.0f : v);
        return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    };
    __shared__ unsigned hist[256];
    __shared__ unsigned chosen, left, taken;
    // a warp's lanes with the same bin add their count once (most of a row's values share
    // the few top bytes of their keys: one atomic a lane would queue on those bins)
    auto count = [&](bool on, unsigned bin) {
        const unsigned peers = __match_any_sync(0xffffffffu, on ? bin : 0xffffffffu);
        if (on && __ffs(peers) - 1 == int(lane)) atomicAdd(&hist[bin], unsigned(__popc(peers)));
    };
    // the bin of `bins` holding the want-th counted value, from the top bin down or from bin
    // 0 up, and how many of that bin are still wanted (`chosen`, `left`: for every thread)
    auto pick = [&](int bins, bool top, unsigned want) {
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned before = 0u;
            int b = top ? bins - 1 : 0;
            for (; (top ? b > 0 : b < bins - 1) && before + hist[b] < want; b += top ? -1 : 1)
                before += hist[b];
            chosen = unsigned(b);
            left = want - before;
        }
        __syncthreads();
    };
    // 1. the C-th largest key, byte by byte from the top (every lane runs every round: the
    // warp's votes need all 32)
    unsigned prefix = 0u, mask = 0u, want = C;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += NT) hist[b] = 0u;
        __syncthreads();
        for (long base = 0; base < V; base += NT) {
            const long i = base + threadIdx.x;
            const unsigned k = i < V ? key(static_cast<float>(row[i])) : 0u;
            count(i < V && (k & mask) == prefix, (k >> shift) & 255u);
        }
        pick(256, true, want);  // the want-th largest of those matching
        prefix |= chosen << shift;
        mask |= 255u << shift;
        want = left;
        __syncthreads();  // (hist is cleared next round)
    }
    const unsigned t_key = prefix;
    const unsigned ties = hist[chosen];  // values equal to T in the row (the last round's bin)
    __syncthreads();  // (read by every thread before hist is cleared again)
    // 2. among the ties, the want-th smallest index (none of this when all are taken)
    unsigned last = 0xffffffffu;
    if (want < ties) {
        int bits = 1;
        while ((1L << bits) < V) ++bits;
        unsigned ip = 0u, im = 0u, iw = want;
        for (int shift = ((bits + 5) / 6 - 1) * 6; shift >= 0; shift -= 6) {
            for (int b = threadIdx.x; b < 64; b += NT) hist[b] = 0u;
            __syncthreads();
            for (long base = 0; base < V; base += NT) {
                const long i = base + threadIdx.x;
                const bool tie = i < V && key(static_cast<float>(row[i])) == t_key;
                count(tie && (unsigned(i) & im) == ip, (unsigned(i) >> shift) & 63u);
            }
            pick(64, false, iw);  // the iw-th smallest index
            ip |= chosen << shift;
            im |= 63u << shift;
            iw = left;
            __syncthreads();
        }
        last = ip;
    }
    // 3. the ids: above T, and T's ties up to the index found
    if (threadIdx.x == 0) taken = 0u;
    __syncthreads();
    for (long i = threadIdx.x; i < V; i += NT) {
        const unsigned k = key(static_cast<float>(row[i]));
        if (k > t_key || (k == t_key && unsigned(i) <= last)) {
            const unsigned at = atomicAdd(&taken, 1u);
            if (at < C) out[r * C + at] = unsigned(i);
        }
    }
"""


def enabled() -> bool:
    """On MLX's CUDA backend with SLOTSERVE_TOPK=1 ("0", the default, until it has run on a
    GPU: MLX's argpartition)."""
    return cuda.env_flag(ENV) and cuda.available()  # (read at the call: tools replace it)


def topk_ids(x: mx.array, C: int) -> mx.array:
    """The ids of each row's `C` largest values of `x` `[R, V]` (float; V >= C), in
    increasing id order, uint32: where several values equal the C-th largest, the first of
    them in the row. One launch (a block a row) and a sort of the C ids."""
    R, V = x.shape
    if not 0 < C <= V:
        raise ValueError(f"topk_ids: {C} of {V} values")
    kernel = cuda.cached_kernel("topk", "", ["x"], ["out"], _SOURCE)
    (ids,) = kernel(
        inputs=[x],
        template=[("T", x.dtype), ("C", C), ("NT", NT)],
        grid=(R * NT, 1, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[(R, C)],
        output_dtypes=[mx.uint32],
    )
    return mx.sort(ids, axis=-1)
