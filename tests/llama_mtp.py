"""llama.cpp's MTP head, driven through its C API: the oracle for `test_mtp_parity.py`.

The high-level `llama_cpp.Llama` has no MTP entry, so this loads the model itself with
`load_mtp = True` and keeps two contexts on it (MODEL_SPEC §16, "Running llama.cpp's MTP head
from Python"):

* the target context decodes the trunk with next-n embeddings on, so every position yields
  its logits and the post-`output_norm` hidden state h_t;
* a context of type `LLAMA_CONTEXT_TYPE_MTP` decodes batches whose entries carry both a token
  and an embedding — (x_{t+1}, h_t) at position t — and yields the draft logits and the MTP
  block's own hidden h'. Its KV cache holds the MTP block's keys, so consecutive `draft` calls
  continue one sequence.

`llama_batch_ext_set_embd_state` is a stub in this build (it returns false), so the draft batch
is a plain `llama_batch` with both `token` and `embd` filled: for an MTP context llama.cpp
embeds the token and reads `embd` as the hidden input. The next-n functions are exported only
under their C++ names and are bound here by mangled name.

Both contexts use an F32 KV cache and no flash attention: either default costs ~1e-4 relative
on these models, far above the parity we check.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from types import TracebackType
from typing import Any

import llama_cpp.llama_cpp as capi
import numpy as np


class LlamaError(RuntimeError):
    """llama.cpp is missing an entry point, or refused to load, build a context or decode."""


def _bind(name: str, mangled: str, argtypes: list[Any], restype: Any) -> Any:
    try:
        fn = getattr(capi._lib, mangled)
    except AttributeError:
        raise LlamaError(
            f"libllama exports no {name} ({mangled}); built for llama-cpp-python 0.3.36"
        ) from None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


# void llama_set_embeddings_nextn(llama_context *, bool value, bool masked)
_set_embeddings_nextn = _bind(
    "llama_set_embeddings_nextn",
    "_Z26llama_set_embeddings_nextnP13llama_contextbb",
    [capi.llama_context_p_ctypes, ctypes.c_bool, ctypes.c_bool],
    None,
)
# float * llama_get_embeddings_nextn_ith(llama_context *, int32_t i)
_get_embeddings_nextn_ith = _bind(
    "llama_get_embeddings_nextn_ith",
    "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
    [capi.llama_context_p_ctypes, ctypes.c_int32],
    ctypes.POINTER(ctypes.c_float),
)

GGML_TYPE_F32 = 0
LLAMA_FLASH_ATTN_TYPE_DISABLED = 0


class LlamaMTP:
    """One sequence on a GGUF model with an MTP block, through llama.cpp.

    `prefill(tokens)` runs the trunk once from position 0; `draft(tokens, hidden, start)`
    runs the MTP block on rows (x_{t+1}, h_t) at positions `start, start+1, ...`. Neither
    may be repeated over positions already decoded.
    """

    def __init__(self, path: str | Path, n_ctx: int = 128, n_threads: int = 2) -> None:
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's log
        capi.llama_backend_init()
        mp = capi.llama_model_default_params()
        mp.use_extra_bufts = False  # the AMX repack buffer dies with SIGILL here (§16)
        mp.load_mtp = True
        self.model = capi.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise LlamaError(f"{path}: llama.cpp could not load the model")
        self.contexts: list[Any] = []
        if capi.llama_model_n_layer_nextn(self.model) < 1:
            self.close()
            raise LlamaError(f"{path}: llama.cpp sees no MTP block (nextn_predict_layers)")
        self.n_vocab = capi.llama_vocab_n_tokens(capi.llama_model_get_vocab(self.model))
        self.n_embd = capi.llama_model_n_embd(self.model)
        self.target = self._context(n_ctx, n_threads, capi.LLAMA_CONTEXT_TYPE_DEFAULT, None)
        self.mtp = self._context(n_ctx, n_threads, capi.LLAMA_CONTEXT_TYPE_MTP, self.target)
        for ctx in self.contexts:
            _set_embeddings_nextn(ctx, True, False)  # hidden rows for every position

    def _context(self, n_ctx: int, n_threads: int, kind: int, other: Any) -> Any:
        cp = capi.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.type_k = cp.type_v = GGML_TYPE_F32
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.ctx_type = kind
        cp.ctx_other = other
        ctx = capi.llama_init_from_model(self.model, cp)
        if not ctx:
            self.close()
            raise LlamaError(f"llama.cpp could not create a context of type {kind}")
        self.contexts.append(ctx)
        return ctx

    def prefill(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Trunk logits `[T, V]` and post-norm hidden states `[T, E]` at every position."""
        batch = capi.llama_batch_init(len(tokens), 0, 1)
        try:
            self._fill(batch, tokens, 0)
            return self._decode(self.target, batch, len(tokens))
        finally:
            capi.llama_batch_free(batch)

    def draft(
        self, tokens: list[int], hidden: np.ndarray, start: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """MTP draft logits `[n, V]` and MTP hidden h' `[n, E]` for rows (tokens[i], hidden[i])."""
        n, E = len(tokens), self.n_embd
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        if h.shape != (n, E):
            raise ValueError(f"hidden has shape {h.shape}, want {(n, E)}")
        batch = capi.llama_batch_init(n, E, 1)  # allocates `embd` only; `token` is ours
        token_buf = (capi.llama_token * n)()
        batch.token = ctypes.cast(token_buf, ctypes.POINTER(capi.llama_token))
        try:
            self._fill(batch, tokens, start)
            ctypes.memmove(batch.embd, h.ctypes.data, h.nbytes)
            return self._decode(self.mtp, batch, n)
        finally:
            batch.token = None  # llama_batch_free would free our buffer
            capi.llama_batch_free(batch)

    @staticmethod
    def _fill(batch: Any, tokens: list[int], start: int) -> None:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1

    def _decode(self, ctx: Any, batch: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
        rc = capi.llama_decode(ctx, batch)
        if rc != 0:
            raise LlamaError(f"llama_decode returned {rc}")
        logits = np.stack(
            [self._row(capi.llama_get_logits_ith(ctx, i), self.n_vocab) for i in range(n)]
        )
        hidden = np.stack(
            [self._row(_get_embeddings_nextn_ith(ctx, i), self.n_embd) for i in range(n)]
        )
        return logits, hidden

    @staticmethod
    def _row(ptr: Any, width: int) -> np.ndarray:
        if not ptr:
            raise LlamaError("llama.cpp returned no output row")
        return np.ctypeslib.as_array(ptr, shape=(width,)).copy()

    def close(self) -> None:
        for ctx in reversed(self.contexts):
            capi.llama_free(ctx)
        self.contexts = []
        if self.model:
            capi.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> LlamaMTP:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
