"""The contenders of every benchmark, behind one small interface.

`Ours` drives slotserve's `ModelRunner`; `LlamaCpp` drives llama.cpp through
llama-cpp-python's C API; `MlxLm` drives mlx-lm's model with the batch caches its
`BatchGenerator` uses, on the same weights converted by bench/to_mlx_lm.py. Each
holds `n_seq` sequences and runs ONE forward per call for all of them:

* `start(n_seq, n_ctx)` — fresh, empty state for `n_seq` sequences of up to
  `n_ctx` tokens each (untimed setup);
* `prefill(prompts)` — one forward over every prompt (sequence i gets
  `prompts[i]` from position 0); returns the logits at each prompt's last
  position, `[n_seq, vocab]` float32;
* `decode(tokens)` — one forward with one token per sequence; returns the
  next-token logits `[n_seq, vocab]`;
* `greedy(tokens)` — `decode` and the argmax of each row, on the device where
  there is one (a GPU step would otherwise be timed copying `[n_seq, vocab]`
  logits to the host).
Heavy imports (MLX, llama.cpp) happen inside the constructors, so each
contender only loads its own library in its worker process.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Contender(Protocol):
    name: str

    def start(self, n_seq: int, n_ctx: int) -> None: ...

    def prefill(self, prompts: Sequence[Sequence[int]]) -> np.ndarray: ...

    def decode(self, tokens: Sequence[int]) -> np.ndarray: ...

    def greedy(self, tokens: Sequence[int]) -> list[int]: ...


class Ours:
    """slotserve: `load_model` + `SlotPool` + `ModelRunner.step`, one step per call."""

    def __init__(
        self,
        path: str | Path,
        name: str = "ours",
        dtype: str = "float32",
        kv_dtype: str = "float32",
        compile: bool = False,
        dense: bool = False,
        ahead: bool = False,
    ) -> None:
        import mlx.core as mx

        from engine.models.qwen35 import load_model

        self.name = name
        # dense: quantized matrices dequantized at load (the daemon's weights = "dense")
        self.model = load_model(path, getattr(mx, dtype), dense)
        self.kv_dtype = getattr(mx, kv_dtype)
        self.compile = compile
        self.runners: dict[tuple[int, int], tuple[Any, list[Any]]] = {}  # compiled steps stay warm
        self.runner: Any = None
        self.slots: list[Any] = []
        self.lengths: list[int] = []
        self.phases: dict[str, list[float]] = {"step": [], "host": [], "sample": []}
        if ahead:  # where decode-ahead's host time goes (`_greedy_ahead`)
            self.phases |= {"adopt": [], "argmax": [], "launch": []}
        # ahead: each `greedy` queues the next step on this one's argmax on the device
        # (`ModelRunner.launch`) before reading it back, as the scheduler's decode-ahead does
        self.ahead = ahead
        self.pending: Any = None  # the step queued on the tokens `greedy` returned last
        self.pending_on: list[int] = []

    def start(self, n_seq: int, n_ctx: int) -> None:
        from engine.cache import SlotPool
        from engine.runner import ModelRunner

        if (n_seq, n_ctx) in self.runners:
            self.runner, self.slots = self.runners[n_seq, n_ctx]
            for slot in self.slots:
                self.runner.pool.reset(slot)
        else:
            room = n_ctx + 1 if self.ahead else n_ctx  # ahead: a step past the last is queued
            pool = SlotPool(self.model.config, n_seq, room, kv_dtype=self.kv_dtype)
            kw = {"compile": True} if self.compile else {}
            self.runner = ModelRunner(self.model, pool, **kw)
            self.slots = [pool.allocate() for _ in range(n_seq)]
            self.runners[n_seq, n_ctx] = (self.runner, self.slots)
        self.lengths = [0] * n_seq
        self.pending = None

    def prefill(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        return np.stack([np.array(x) for x in self._step([list(p) for p in prompts])])

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        return np.stack([np.array(x) for x in self._step([[t] for t in tokens])])

    def greedy(self, tokens: Sequence[int]) -> list[int]:
        """One decode step and the argmax of every row, over the step's packed logits (as
        the scheduler samples), not a slice per row."""
        from engine.kernels import host_pool
        from engine.kernels.argmax_cuda import argmax_rows
        from engine.runner import last_logits

        if self.ahead:
            return self._greedy_ahead(list(tokens))
        t0 = time.perf_counter()
        out = self._run([[t] for t in tokens])
        t1 = time.perf_counter()
        ids = argmax_rows(last_logits(out.rows))
        tokens = [int(t) for t in host_pool.to_host(ids)]  # (as the engine reads them)
        self.phases["step"].append(t1 - t0)
        self.phases["host"].append(self.runner.last_host_s)
        self.phases["sample"].append(time.perf_counter() - t1)
        return tokens

    def _greedy_ahead(self, tokens: list[int]) -> list[int]:
        """`greedy` with the next step queued before this one's tokens are read: the step
        queued last time (on the device tokens this call is given back) is adopted whole, its
        argmax feeds a new step queued at once, and only then is the argmax read. `step` is the
        host time up to the read, `sample` the wait for it (the device's share); within `step`:
        `adopt` (the last step's state into the pool), `argmax` (queued and evaluated
        asynchronously), `host` (the new step's inputs and graph) and `launch` (the rest of
        `ModelRunner.launch`: MLX encoding and launching the step's kernels)."""
        import mlx.core as mx

        from engine.kernels import host_pool
        from engine.kernels.argmax_cuda import argmax_rows
        from engine.runner import last_logits

        t0 = time.perf_counter()
        if self.pending is None or self.pending_on != tokens:
            self.pending = self.runner.launch(self.slots, mx.array(tokens, dtype=mx.int32))
        ta = time.perf_counter()
        out = self.runner.adopt(self.pending, range(len(self.slots)))
        tb = time.perf_counter()
        nxt = argmax_rows(last_logits(out.rows)).astype(mx.int32)
        # its own evaluation: evaluated within the next step's, it would be ready (and
        # readable) only when that whole step is
        mx.async_eval(nxt)
        tc = time.perf_counter()
        self.pending = self.runner.launch(self.slots, nxt)
        host = self.runner.last_host_s
        t1 = time.perf_counter()
        self.phases["adopt"].append(tb - ta)
        self.phases["argmax"].append(tc - tb)
        self.phases["launch"].append(t1 - tc - host)
        tokens = [int(t) for t in host_pool.to_host(nxt)]
        self.pending_on = tokens
        self.lengths = [n + 1 for n in self.lengths]
        self.phases["step"].append(t1 - t0)
        self.phases["host"].append(host)
        self.phases["sample"].append(time.perf_counter() - t1)
        return tokens

    def settle(self) -> None:
        """Wait for the step queued past the last `greedy` (ahead), so that a timed run pays
        for the device work it started."""
        import mlx.core as mx

        if self.pending is not None:
            mx.eval(self.pending.logits, *self.pending.new)

    def timings(self) -> dict[str, float]:
        """Median ms of each phase of the `greedy` calls since the last call: `step`
        (`ModelRunner.step`), `host` (its part before evaluation), `sample` (argmax and
        `tolist`). What the wall time per step holds beyond them is the driver's."""
        out = {k: 1e3 * float(np.median(v)) for k, v in self.phases.items() if v}
        self.phases = {k: [] for k in self.phases}
        return out

    def _step(self, rows: list[list[int]]) -> list[Any]:
        """One runner step; each row's last-position logits (`mx.array [vocab]`)."""
        return [r.logits[-1] for r in self._run(rows).rows]

    def _run(self, rows: list[list[int]]) -> Any:
        from engine.runner import Row

        batch = [
            Row(slot, toks, start)
            for slot, toks, start in zip(self.slots, rows, self.lengths, strict=True)
        ]
        out = self.runner.step(batch)
        self.lengths = [n + len(toks) for n, toks in zip(self.lengths, rows, strict=True)]
        return out


GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16 = 0, 1, 30
_SILENT_LOG: Any = None  # kept alive: llama.cpp holds a pointer to it


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API, one `llama_decode` per call.

    The model is loaded with `use_extra_bufts = False`, as `tests/conftest.py` does: on CPUs
    reporting AMX, llama.cpp otherwise repacks quantized weights into an AMX buffer that dies
    with SIGILL in our sandbox (MODEL_SPEC §16). That also turns off its CPU weight repacking
    (e.g. Q8_0 -> interleaved rows), so this peer is somewhat slower than a stock llama.cpp.

    Every sequence gets its own `seq_id`; `kv_unified=False` gives each its own KV stream of
    `n_ctx` cells (the layout llama.cpp recommends for sequences without a shared prefix).
    """

    def __init__(
        self,
        path: str | Path,
        name: str = "llama.cpp",
        n_threads: int = 2,
        kv_dtype: str = "float32",
        kv_unified: bool = False,
    ) -> None:
        import llama_cpp.llama_cpp as capi

        self.capi = capi
        self.name = name
        self.n_threads = n_threads
        self.kv_type = {
            "float32": GGML_TYPE_F32,
            "float16": GGML_TYPE_F16,
            "bfloat16": GGML_TYPE_BF16,
        }[kv_dtype]
        self.kv_unified = kv_unified
        global _SILENT_LOG
        if _SILENT_LOG is None:  # llama.cpp's loader warnings would drown the table
            _SILENT_LOG = capi.llama_log_callback(lambda level, text, user_data: None)
            capi.llama_log_set(_SILENT_LOG, ctypes.c_void_p(0))
        capi.llama_backend_init()
        mp = capi.llama_model_default_params()
        mp.use_extra_bufts = False
        self.model = capi.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"{path}: llama.cpp could not load the model")
        self.n_vocab = capi.llama_vocab_n_tokens(capi.llama_model_get_vocab(self.model))
        self.contexts: dict[tuple[int, int], tuple[Any, Any]] = {}  # (context, batch)
        self.ctx: Any = None
        self.batch: Any = None
        self.lengths: list[int] = []

    def start(self, n_seq: int, n_ctx: int) -> None:
        capi = self.capi
        self.lengths = [0] * n_seq
        if (n_seq, n_ctx) in self.contexts:
            self.ctx, self.batch = self.contexts[n_seq, n_ctx]
            capi.llama_memory_clear(capi.llama_get_memory(self.ctx), True)
            return
        per_seq = -(-n_ctx // 256) * 256  # llama.cpp pads the context to 256 cells
        cp = capi.llama_context_default_params()
        cp.n_ctx = per_seq * n_seq
        cp.n_batch = cp.n_ubatch = max(512, n_ctx * n_seq)
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.type_k = cp.type_v = self.kv_type
        cp.kv_unified = self.kv_unified
        self.ctx = capi.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
        self.batch = capi.llama_batch_init(cp.n_batch, 0, 1)
        self.contexts[n_seq, n_ctx] = (self.ctx, self.batch)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        return self._decode([list(p) for p in prompts])

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        return self._decode([[t] for t in tokens])

    def greedy(self, tokens: Sequence[int]) -> list[int]:
        return [int(t) for t in np.argmax(self.decode(tokens), axis=-1)]

    def _decode(self, rows: list[list[int]]) -> np.ndarray:
        capi, batch = self.capi, self.batch
        i, last = 0, []
        for seq, toks in enumerate(rows):
            start = self.lengths[seq]
            for j, tok in enumerate(toks):
                batch.token[i] = tok
                batch.pos[i] = start + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = j == len(toks) - 1
                i += 1
            last.append(i - 1)
            self.lengths[seq] = start + len(toks)
        batch.n_tokens = i
        rc = capi.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = np.empty((len(rows), self.n_vocab), dtype=np.float32)
        for seq, at in enumerate(last):
            ptr = capi.llama_get_logits_ith(self.ctx, at)
            out[seq] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return out


class MlxLm:
    """mlx-lm (0.32.2) on the same weights: the GGUF converted by bench/to_mlx_lm.py (once,
    into a directory beside it), loaded with `mlx_lm.utils.load_model`.

    Driven the way its `BatchGenerator` drives a batch: one `make_prompt_cache(model)` per
    sequence merged into batch caches (`_merge_caches`), the prompt minus its last token in one
    model call of which only the caches are evaluated (so no LM head over the prompt), then
    one model call per step with one token per row, on mlx-lm's generation stream. Greedy
    argmax on the device, as its `greedy_sampler`. Prompts of one call must be equally long
    (the benchmarks' are; mlx-lm would right-pad and mask otherwise).
    """

    PREFILL_STEP = 512  # prompt tokens a row a prefill forward

    def __init__(
        self,
        path: str | Path,
        name: str = "mlx-lm",
        dtype: str = "float32",
        kv_dtype: str = "float32",
        compile: bool = False,
    ) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream
        from mlx_lm.utils import load_model
        from to_mlx_lm import convert

        del kv_dtype, compile  # mlx-lm keeps its KV cache in the compute dtype, uncompiled
        self.name = name
        self.mx = mx
        self.stream = generation_stream
        src = Path(path)
        converted = src.with_name(f"{src.stem}.mlx-lm-{dtype}")
        if not (converted / "config.json").exists():
            tmp = converted.with_name(converted.name + ".tmp")
            convert(src, tmp, getattr(mx, dtype))
            tmp.replace(converted)
        self.model, _ = load_model(converted)
        self.cache: list[Any] = []

    def start(self, n_seq: int, n_ctx: int) -> None:
        from mlx_lm.generate import _merge_caches
        from mlx_lm.models.cache import make_prompt_cache

        del n_ctx  # mlx-lm's caches grow as needed
        self.cache = _merge_caches([make_prompt_cache(self.model) for _ in range(n_seq)])

    def prefill(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        mx = self.mx
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("MlxLm.prefill takes prompts of one length")
        with mx.stream(self.stream):
            # in pieces, each evaluated, as mlx-lm's own generate prefills: 8 prompts of
            # 4,096 tokens at once ran the H200 out of memory (session 22)
            for at in range(0, len(prompts[0]) - 1, self.PREFILL_STEP):
                piece = [list(p[at : min(at + self.PREFILL_STEP, len(p) - 1)]) for p in prompts]
                self.model(mx.array(piece), cache=self.cache)
                mx.eval([c.state for c in self.cache])
            logits = self._logits([p[-1] for p in prompts])
        return np.array(logits.astype(mx.float32))

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        with self.mx.stream(self.stream):
            return np.array(self._logits(tokens).astype(self.mx.float32))

    def greedy(self, tokens: Sequence[int]) -> list[int]:
        mx = self.mx
        with mx.stream(self.stream):
            return [int(t) for t in mx.argmax(self._logits(tokens), axis=-1).tolist()]

    def _logits(self, tokens: Sequence[int]) -> Any:
        return self.model(self.mx.array(list(tokens))[:, None], cache=self.cache)[:, -1, :]
