"""The scheduler's pieces on their own: stop strings, the wait queue, request validation,
a sequence's commit of a plain step."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import SlotId
from engine.gguf import GGUFFile
from engine.sampling import RequestRng, SamplingParams
from engine.spec.speculator import DecodingSlot
from engine.tokenizer import Tokenizer
from scheduler.handle import StreamOutlet
from scheduler.outcome import FinishReason
from scheduler.queue import Policy, Rejected, RejectReason, WaitQueue
from scheduler.request import (
    EmptyPrompt,
    InvalidRequest,
    ParameterOutOfRange,
    PromptTooLong,
    Request,
    UnknownTokenId,
    prepare,
)
from scheduler.sequence import Phase, Sequence, commit_plain_step
from scheduler.stop import StopMatcher

# -- stop strings -------------------------------------------------------------------------------

ALPHABET = "ab\n"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_stop_matcher_cuts_at_the_first_stop_and_never_leaks_one(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    matcher = StopMatcher(stops)
    emitted, matched = "", None
    for piece in pieces:
        safe, matched = matcher.push(piece)
        emitted += safe
        assert not any(s in emitted for s in stops), "a stop string leaked into the stream"
        if matched is not None:
            break
    if matched is None:
        emitted += matcher.flush()
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(hits)[1]] if hits else text  # the stop that completes first
    assert emitted == expected
    assert (matched is not None) == bool(hits)


def test_stop_matcher_holds_back_a_partial_match_until_it_resolves() -> None:
    m = StopMatcher(["</end>"])
    assert m.push("hello </e") == ("hello ", None)
    assert m.push("nd") == ("", None)
    assert m.push("x more") == ("</endx more", None)
    assert m.push("</en") == ("", None)
    assert m.push("d> tail") == ("", "</end>")


# -- the wait queue -----------------------------------------------------------------------------


def test_fcfs_queue_admits_in_arrival_order_whatever_the_priority() -> None:
    q: WaitQueue[str] = WaitQueue(8, Policy.FCFS, aging_per_s=1.0)
    for i, prio in enumerate([0, 5, -3, 9]):
        q.push(f"r{i}", prio, now=float(i))
    assert [q.pop(10.0) for _ in range(4)] == ["r0", "r1", "r2", "r3"]


def test_priority_queue_prefers_priority_and_ages_waiting_requests() -> None:
    q: WaitQueue[str] = WaitQueue(8, Policy.PRIORITY, aging_per_s=2.0)
    q.push("old-low", 0, now=0.0)
    q.push("new-high", 5, now=1.0)  # 0 + 2*t vs 5 + 2*(t-1): high wins by 3 points
    q.push("later-high", 5, now=4.0)  # old-low has gained 8 points by now: it wins
    assert [q.pop(5.0) for _ in range(3)] == ["new-high", "old-low", "later-high"]


def test_full_queue_rejects_with_a_retry_after_hint() -> None:
    q: WaitQueue[str] = WaitQueue(2, Policy.FCFS, aging_per_s=0.0)
    q.push("a", 0, 0.0)
    q.push("b", 0, 0.0)
    with pytest.raises(Rejected) as e:
        q.push("c", 0, 0.0)
    assert e.value.reason == RejectReason.QUEUE_FULL
    assert e.value.retry_after_s is not None and e.value.retry_after_s > 0
    q.pop(1.0)
    q.pop(1.5)  # admissions 0.5 s apart: the hint follows them
    q.push("c", 0, 2.0)
    q.push("d", 0, 2.0)
    with pytest.raises(Rejected) as e:
        q.push("e", 0, 2.0)
    assert e.value.retry_after_s == pytest.approx(0.5)


# -- validation ---------------------------------------------------------------------------------

VOCAB, CONTEXT = 512, 64


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(make_model("tiny")).metadata)


@pytest.mark.parametrize(
    ("request_", "error", "words"),
    [
        (Request(prompt=""), EmptyPrompt, "empty"),
        (Request(prompt=[]), EmptyPrompt, "empty"),
        (Request(prompt=[1, 2, VOCAB]), UnknownTokenId, "512"),
        (Request(prompt=[1, -1]), UnknownTokenId, "-1"),
        (Request(prompt=list(range(CONTEXT))), PromptTooLong, "context"),
        (Request(prompt=[1] * 60, max_tokens=5), PromptTooLong, "at most 4"),
        (Request(prompt=[1], max_tokens=0), ParameterOutOfRange, "max_tokens"),
        (Request(prompt=[1], sampling=SamplingParams(top_p=0.0)), ParameterOutOfRange, "top_p"),
        (
            Request(prompt=[1], sampling=SamplingParams(temperature=-1)),
            ParameterOutOfRange,
            "temperature",
        ),
        (
            Request(prompt=[1], sampling=SamplingParams(logit_bias=((VOCAB, 1.0),))),
            ParameterOutOfRange,
            "logit_bias",
        ),
        (Request(prompt=[1], stop=("",)), ParameterOutOfRange, "stop"),
        (Request(prompt=[1], stop_token_ids=(VOCAB,)), UnknownTokenId, "stop_token_ids"),
        (Request(prompt=[1], deadline_s=0.0), ParameterOutOfRange, "deadline_s"),
        (Request(prompt=[1], speculation="sometimes"), ParameterOutOfRange, "speculation"),  # type: ignore[arg-type]
        (Request(prompt=[{"content": "hi"}]), InvalidRequest, "role"),
        (Request(prompt=[1.5, 2]), InvalidRequest, "token ids"),  # type: ignore[arg-type]
    ],
)
def test_invalid_requests_raise_a_specific_error_naming_the_problem(
    tokenizer: Tokenizer, request_: Request, error: type[InvalidRequest], words: str
) -> None:
    with pytest.raises(error, match=words):
        prepare(request_, "r", tokenizer, VOCAB, CONTEXT)


def test_prompts_as_ids_text_and_chat_messages_become_token_ids(tokenizer: Tokenizer) -> None:
    text = "hello world"
    chat = [{"role": "user", "content": "hi"}]
    assert prepare(Request(prompt=[5, 6]), "r", tokenizer, VOCAB, CONTEXT).prompt == [5, 6]
    assert prepare(Request(prompt=text), "r", tokenizer, VOCAB, CONTEXT).prompt == (
        tokenizer.encode(text)
    )
    assert prepare(Request(prompt=chat), "r", tokenizer, VOCAB, CONTEXT).prompt == (
        tokenizer.encode(tokenizer.render_chat(chat))
    )


def test_max_tokens_defaults_to_the_rest_of_the_context_and_eos_stops(
    tokenizer: Tokenizer,
) -> None:
    p = prepare(Request(prompt=[1, 2, 3], stop_token_ids=(7,)), "r", tokenizer, VOCAB, CONTEXT)
    assert p.max_tokens == CONTEXT - 3
    assert p.stop_ids == {7} | tokenizer.eog_ids
    q = prepare(Request(prompt=[1], ignore_eos=True), "r", tokenizer, VOCAB, CONTEXT)
    assert q.stop_ids == frozenset()


@pytest.fixture(params=["host", "device"])
def finite_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """FiniteCheck both ways on any machine: numpy over the logits where MLX computes on the
    CPU ("host"), MLX's reductions read back as one flag an array ("device", a GPU's way)."""
    import scheduler.step

    monkeypatch.setattr(scheduler.step, "on_host", lambda: request.param == "host")
    return str(request.param)


def test_non_finite_logits_mark_only_their_rows_packed_or_not(finite_path: str) -> None:
    from engine.runner import RowOutput
    from scheduler.step import FiniteCheck

    logits = mx.where(mx.arange(5)[:, None] == 3, mx.nan, mx.zeros((5, 8)))  # position 3
    rows = [
        RowOutput(packed=(logits, None, 0, 2)),
        RowOutput(packed=(logits, None, 2, 2)),  # holds position 3
        RowOutput(packed=(logits, None, 4, 1)),
        RowOutput(logits=mx.array([[1.0, mx.inf]])),
        RowOutput(logits=mx.array([[1.0, 2.0]])),
    ]
    assert FiniteCheck(rows).read() == [True, False, True, False, True]


def test_rows_over_two_packed_arrays_are_each_checked_against_their_own(finite_path: str) -> None:
    from engine.runner import RowOutput
    from scheduler.step import FiniteCheck

    a = mx.where(mx.arange(3)[:, None] == 1, mx.inf, mx.zeros((3, 4)))  # position 1
    b = mx.zeros((3, 4))
    rows = [
        RowOutput(packed=(a, None, 0, 1)),
        RowOutput(packed=(b, None, 0, 2)),
        RowOutput(packed=(a, None, 1, 2)),  # holds position 1
        RowOutput(packed=(b, None, 2, 1)),
    ]
    assert FiniteCheck(rows).read() == [True, True, False, True]


def test_a_non_finite_position_no_row_reads_fails_no_row(finite_path: str) -> None:
    """(A queued step's logits hold the rows the next step dropped, too.)"""
    from engine.runner import RowOutput
    from scheduler.step import FiniteCheck

    logits = mx.where(mx.arange(5)[:, None] == 2, mx.nan, mx.ones((5, 4)))  # position 2
    rows = [RowOutput(packed=(logits, None, 0, 2)), RowOutput(packed=(logits, None, 3, 2))]
    assert FiniteCheck(rows).read() == [True, True]
    finite = mx.ones((2, 4))
    check = FiniteCheck([RowOutput(packed=(finite, None, i, 1)) for i in (0, 1)])
    assert check.read() == [True] * 2
    if finite_path == "device":  # what the host reads: one flag, not a flag a row
        assert [a.size for a in check.arrays] == [1]


# -- a plain step's commit ------------------------------------------------------------------------


def _decoding_sequence(tokenizer: Tokenizer, request: Request, first: int) -> Sequence:
    """A sequence as the loop leaves it after its first token: decoding from slot 0."""
    prepared = prepare(request, "r", tokenizer, VOCAB, CONTEXT)
    seq = Sequence(prepared, StreamOutlet(), tokenizer, 0.0, 0, RequestRng(1))
    seq.phase = Phase.DECODE
    seq.decoding = DecodingSlot(
        SlotId(0), first, list(prepared.prompt), request.sampling, seq.rng, "off"
    )
    seq.commit([first], [])
    return seq


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
    max_tokens=st.integers(1, 20),
    stops=st.lists(st.sampled_from(["e", "he", " s", "!\n", "string"]), max_size=2),
    stop_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    ignore_eos=st.booleans(),
    publish_every=st.integers(1, 4),
)
def test_commit_plain_streams_exactly_what_the_general_commit_does(
    tokenizer: Tokenizer,
    tokens: list[int],
    max_tokens: int,
    stops: list[str],
    stop_ids: list[int],
    ignore_eos: bool,
    publish_every: int,
) -> None:
    """A plain step commits with `commit_plain_step`; the general path is `commit` with the step
    counted by hand. Fed the same tokens and published at the same steps, both give the
    same Deltas (tokens, text), the same end and the same decode state."""
    request = Request(
        prompt=[1, 2, 3],
        sampling=SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        stop=tuple(stops),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
    )
    fast, general = (_decoding_sequence(tokenizer, request, tokens[0]) for _ in range(2))
    streams: tuple[list[object], list[object]] = ([], [])
    for step, token in enumerate(tokens[1:], 1):
        commit_plain_step([fast], [token], None, [])
        if general.live:
            general.plain_steps += 1
            general.commit([token], [])
        if step % publish_every == 0:
            for seq, stream in zip((fast, general), streams, strict=True):
                stream.append(seq.take_delta(float(step)))
        assert fast.ending == general.ending
        assert fast.decoding is not None and general.decoding is not None
        state = (fast.decoding.history, fast.decoding.pending, fast.decoding.remaining)
        assert state == (
            general.decoding.history,
            general.decoding.pending,
            general.decoding.remaining,
        )
    for seq, stream in zip((fast, general), streams, strict=True):
        stream.append(seq.take_delta(99.0, final=True))
        end = seq.finished(FinishReason.LENGTH, 100.0)
        stream.append((end.reason, end.matched_stop, end.usage, end.spec))
    assert streams[0] == streams[1]
