"""Time to first token per turn of a growing multi-turn chat: with and without our prefix cache,
and llama.cpp (llama-cpp-python) on the same GGUF and the same prompt tokens.

The trace: `--turns` user turns, each a slice of the vocabulary's training corpus (Python
standard library sources), each followed in the history by a fixed assistant reply, rendered
with the model's chat template; the last prompt has about `--tokens` tokens. Every turn asks
for `--max-tokens` greedy tokens. TTFT is wall time from submitting the prompt to the first
token, measured in the contender's own process; "tokens prefilled" is how many prompt tokens
the contender actually ran through the model for that turn (counted, not timed).

Contenders, each in a process of its own for the whole conversation, warmed up on turn 1
(without leaving anything cached); turn by turn every contender runs the turn before the next
turn starts, so each turn's numbers see the same machine:
* ours: the real Scheduler (one slot, speculation off), prefix cache off;
* ours+cache: the same with the prefix cache (`PrefixCacheConfig()` defaults);
* llama.cpp: one `llama_cpp.Llama` kept across turns — its own reuse of the context when the
  new prompt extends what it evaluated (a hybrid model's memory cannot be cut back, so only
  when nothing past the common prefix was evaluated: never here, as the reply in the history
  is not the one the model generated);
* llama.cpp+ram: the same with `LlamaRAMCache` (its state saved after each completion, the
  longest-prefix state loaded before the next).

    python bench/prefix_chat.py [--preset demo] [--quant f32] [--turns 10] [--tokens 4000]

Prints a markdown table; writes JSON to out/bench/prefix_chat.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import harness
import mlx.core as mx

from engine.cache import SlotPool
from engine.corpus import corpus_text
from engine.gguf import GGUFFile
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.spec.speculator import Speculator
from engine.tokenizer import Tokenizer
from scheduler import Delta, Finished, PrefixCacheConfig, Request, Scheduler, SchedulerConfig

REPLY = "Understood. Here is a short summary of that code, and what to look at next."
"""The assistant's reply in the history of every later turn (not what the model generated)."""


def trace(tokenizer: Tokenizer, turns: int, tokens: int) -> list[list[int]]:
    """The prompt tokens of every turn (the conversation so far, generation prompt added)."""
    text = corpus_text()
    # Size the user turns so the last prompt comes out near `tokens`.
    chars_per_token = len(text[:20000]) / len(tokenizer.encode(text[:20000]))
    reply = len(tokenizer.encode(REPLY)) + 10
    per_turn = int((tokens / turns - reply) * chars_per_token)
    messages: list[dict[str, str]] = []
    prompts = []
    for k in range(turns):
        messages.append({"role": "user", "content": text[k * per_turn : (k + 1) * per_turn]})
        prompts.append(tokenizer.encode(tokenizer.render_chat(messages)))
        messages.append({"role": "assistant", "content": REPLY})
    return prompts


class OursTurns:
    """The real Scheduler (one slot, speculation off) running on a loop thread of its own,
    one turn per `turn` call."""

    def __init__(self, model_path: Path, prompts: list[list[int]], cache: bool) -> None:
        model = load_model(model_path)
        tokenizer = Tokenizer.from_metadata(GGUFFile(model_path).metadata)
        pool = SlotPool(model.config, 1, max(len(p) for p in prompts) + 64, kv_dtype=mx.float32)
        runner = ModelRunner(model, pool)
        config = SchedulerConfig(prefix_cache=PrefixCacheConfig() if cache else None)
        # Made on this thread, which loaded the model (MLX evaluates its weights here).
        self.scheduler = Scheduler(runner, tokenizer, config, Speculator(runner, 0))
        self._exit = ExitStack()
        self.portal = self._exit.enter_context(anyio.from_thread.start_blocking_portal())
        self._exit.enter_context(self.portal.wrap_async_context_manager(self.scheduler.running()))

    def turn(self, prompt: list[int], max_tokens: int, cache: bool = True) -> dict[str, Any]:
        return self.portal.call(self._turn, prompt, max_tokens, cache)

    async def _turn(self, prompt: list[int], max_tokens: int, cache: bool) -> dict[str, Any]:
        before = self.scheduler.stats().prompt_tokens
        greedy = SamplingParams(temperature=0.0)
        request = Request(
            prompt=prompt,
            sampling=greedy,
            max_tokens=max_tokens,
            ignore_eos=True,
            prefix_cache=cache,
        )
        t0 = time.perf_counter()
        first, tokens, cached = None, list[int](), 0
        async for event in self.scheduler.submit(request):
            if isinstance(event, Delta):
                first = first or time.perf_counter()
                tokens += event.token_ids
            else:
                assert isinstance(event, Finished), event
                cached = event.usage.cached_tokens
        assert first is not None
        evaluated = self.scheduler.stats().prompt_tokens - before
        return {"ttft_s": first - t0, "cached": cached, "evaluated": evaluated, "output": tokens}

    def stats(self) -> dict[str, Any]:
        return vars(self.scheduler.stats().prefix_cache)


class LlamaTurns:
    """One `llama_cpp.Llama` kept across turns (optionally with `LlamaRAMCache`); counts the
    prompt tokens it evaluates."""

    def __init__(self, model_path: Path, prompts: list[list[int]], threads: int, ram: bool):
        import llama_cpp
        from llama_cpp import llama_cpp as capi

        # As tests/conftest.py: no AMX repacking of weights (it dies with SIGILL here).
        default = capi.llama_model_default_params

        def params() -> Any:
            p = default()
            p.use_extra_bufts = False
            return p

        capi.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(
                str(model_path),
                n_ctx=max(len(p) for p in prompts) + 64,
                n_batch=512,
                n_threads=threads,
                n_threads_batch=threads,
                type_k=0,
                type_v=0,
                verbose=False,
            )
        finally:
            capi.llama_model_default_params = default
        self.ram, self.evaluated = ram, 0
        evaluate = self.llm.eval

        def counting(tokens: Any) -> None:
            self.evaluated += len(tokens)
            evaluate(tokens)

        self.llm.eval = counting  # type: ignore[method-assign]

    def turn(self, prompt: list[int], max_tokens: int, cache: bool = True) -> dict[str, Any]:
        llm = self.llm
        if not cache:  # the warm-up: leave nothing behind
            llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)
            llm.reset()
            if self.ram:
                llm.set_cache(llama_cpp_ram_cache())
            return {}
        before = self.evaluated
        t0 = time.perf_counter()
        first = None
        for _ in llm.create_completion(
            prompt, max_tokens=max_tokens, temperature=0.0, top_k=1, stream=True
        ):
            first = first or time.perf_counter()
        assert first is not None
        output = [int(t) for t in llm._input_ids[len(prompt) : llm.n_tokens]]
        # Prompt tokens evaluated before the first token (the rest are the output's).
        evaluated = self.evaluated - before - len(output)
        return {"ttft_s": first - t0, "cached": None, "evaluated": evaluated, "output": output}

    def stats(self) -> dict[str, Any]:
        return {}


def llama_cpp_ram_cache() -> Any:
    import llama_cpp

    return llama_cpp.LlamaRAMCache(capacity_bytes=2 << 30)


_TURNS: OursTurns | LlamaTurns | None = None  # the contender of this worker process


def _start(kind: str, model_path: Path, prompts: list[list[int]], threads: int) -> None:
    global _TURNS
    if kind.startswith("ours"):
        _TURNS = OursTurns(model_path, prompts, cache=kind == "ours+cache")
    else:
        _TURNS = LlamaTurns(model_path, prompts, threads, ram=kind == "llama.cpp+ram")


def _turn(prompt: list[int], max_tokens: int, cache: bool) -> dict[str, Any]:
    assert _TURNS is not None
    return _TURNS.turn(prompt, max_tokens, cache)


def _stats() -> dict[str, Any]:
    assert _TURNS is not None
    return _TURNS.stats()


CONTENDERS = ("ours", "ours+cache", "llama.cpp", "llama.cpp+ram")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--quant", default="f32")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4000, help="about the last prompt's length")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    args = ap.parse_args()

    path = harness.bench_model(args.preset, args.quant)
    tokenizer = Tokenizer.from_metadata(GGUFFile(path).metadata)
    prompts = trace(tokenizer, args.turns, args.tokens)
    spawn = mp.get_context("spawn")
    results: dict[str, dict[str, Any]] = {n: {"turns": []} for n in CONTENDERS}
    with ExitStack() as stack:
        pools = {}
        for name in CONTENDERS:  # one process each, alive for the whole conversation
            pools[name] = stack.enter_context(
                spawn.Pool(1, _start, (name, path, prompts, args.threads))
            )
            pools[name].apply(_turn, (prompts[0], 2, False))  # warm up on turn 1, uncached
        # Turn by turn, every contender in turn: each turn's numbers see the same machine.
        for k, prompt in enumerate(prompts):
            for name in CONTENDERS:
                got = pools[name].apply(_turn, (prompt, args.max_tokens, True))
                results[name]["turns"].append(got)
            ttfts = ", ".join(
                f"{n} {results[n]['turns'][-1]['ttft_s'] * 1000:.0f}" for n in CONTENDERS
            )
            print(f"turn {k + 1} ({len(prompt)} tokens): TTFT ms {ttfts}", flush=True)
        for name in CONTENDERS:
            results[name]["stats"] = pools[name].apply(_stats)

    turns = {n: results[n]["turns"] for n in CONTENDERS}
    exact = [t["output"] for t in turns["ours"]] == [t["output"] for t in turns["ours+cache"]]
    rows: list[list[object]] = []
    for k, prompt in enumerate(prompts):
        shared = harness.common_prefix(prompts[k - 1], prompt) if k else 0
        cells = [f"{t[k]['ttft_s'] * 1000:.0f} ({t[k]['evaluated']})" for t in turns.values()]
        rows.append([k + 1, len(prompt), len(prompt) - shared, *cells])
    totals = [
        f"{sum(x['ttft_s'] for x in t) * 1000:.0f} ({sum(x['evaluated'] for x in t)})"
        for t in turns.values()
    ]
    rows.append(["all", sum(len(p) for p in prompts), "", *totals])
    header = ["turn", "prompt tokens", "new since last turn"]
    header += [f"{n} TTFT ms (tokens prefilled)" for n in CONTENDERS]
    print(harness.markdown_table(header, rows))
    print(f"\nours+cache outputs token-identical to ours: {exact}")
    print(f"ours+cache prefix cache: {results['ours+cache']['stats']}")
    for t in turns.values():
        for x in t:
            del x["output"]
    record = {
        "args": vars(args) | {"out": str(args.out)},
        "model": str(path),
        "machine": harness.machine(),
        "prompt_tokens": [len(p) for p in prompts],
        "results": results,
        "exact": exact,
    }
    print(f"JSON: {harness.write_json('prefix_chat', record, args.out)}")


if __name__ == "__main__":
    main()
