"""ReplayEngine: given completions in order per rid / prompt / default queue, cut like a real
engine at stop ids and max_new_tokens, explicit finish reasons, log-probs, emulated prefix
cache, delayed requests and aborts, and clear errors when completions run out."""

from __future__ import annotations

import asyncio

import pytest

from ptrain.data.tokenizer import build_tokenizer, stop_token_ids
from ptrain.rollout.protocol import GenerateRequest, RequestError, RolloutEngine, SamplingParams
from ptrain.rollout.replay import Completion, ReplayEngine


def req(prompt, rid="", **sp):
    return GenerateRequest(tuple(prompt), SamplingParams(**sp), rid=rid)


def test_protocol_and_keys_in_order():
    engine = ReplayEngine({"a": [[1, 2], [3]], (7, 8): [[4]], None: [[5], [6]]})
    assert isinstance(engine, RolloutEngine) and engine.weight_version == "replay"
    (s,) = engine.submit(req([9], rid="a")).result()
    assert s.output_ids == (1, 2) and s.logprobs == (0.0, 0.0) and s.weight_version == "replay"
    assert s.finish_reason.type == "stop" and s.rid == "a"
    (s,) = engine.submit(req([9], rid="a#2")).result()  # a second concurrent request of task "a"
    assert s.output_ids == (3,)
    (s,) = engine.submit(req([7, 8], rid="other")).result()  # by prompt ids
    assert s.output_ids == (4,)
    (s,) = engine.submit(req([7, 8], rid="x")).result()  # (7, 8) is used up: the default queue
    assert s.output_ids == (5,)
    assert engine.remaining() == 1 and engine.remaining("a") == 0
    assert [r.rid for r in engine.requests] == ["a", "a#2", "other", "x"]


def test_n_samples_take_the_next_n_and_shortage_loses_nothing():
    engine = ReplayEngine([[1], [2], [3]])
    with pytest.raises(RequestError, match="asks for 4 samples but only 3"):
        engine.submit(req([0], n=4))
    assert engine.remaining() == 3
    samples = engine.generate_many([req([0], n=2)])[0]
    assert [s.output_ids for s in samples] == [(1,), (2,)] and [s.index for s in samples] == [0, 1]
    asyncio.run(engine.generate(req([0])))
    with pytest.raises(RequestError, match="no completion left"):
        engine.submit(req([0]))


def test_cut_like_an_engine_at_stops_and_length():
    engine = ReplayEngine(
        [[1, 2, 9, 3], [1, 2, 3, 4, 5], [1, 8], [1, 2, 3, 4, 5], Completion(output_ids=(1, 2, 3), finish="abort")],
        eos_token_ids=[8],
    )
    s = engine.submit(req([0], stop_token_ids=[9])).result()[0]
    assert s.output_ids == (1, 2, 9) and s.finish_reason.type == "stop" and s.finish_reason.matched == 9
    s = engine.submit(req([0], max_new_tokens=3)).result()[0]
    assert s.output_ids == (1, 2, 3) and s.finish_reason.type == "length" and s.finish_reason.length == 3
    s = engine.submit(req([0])).result()[0]
    assert s.output_ids == (1, 8) and s.finish_reason.matched == 8  # the engine's eos
    s = engine.submit(req([0], max_new_tokens=2, ignore_eos=True)).result()[0]
    assert s.output_ids == (1, 2) and s.finish_reason.type == "length"
    s = engine.submit(req([0], max_new_tokens=1)).result()[0]  # explicit finish: used as given
    assert s.output_ids == (1, 2, 3) and s.finish_reason.type == "abort"


def test_text_completions_end_their_turn():
    tok = build_tokenizer(vocab_size=300)
    stop = stop_token_ids(tok)
    engine = ReplayEngine(["Answer: 42", {"text": "cut", "finish": "length"}], tokenizer=tok)
    a, b = engine.submit(req([0], n=2, stop_token_ids=stop)).result()
    assert a.output_ids[-1] == stop[0] and a.finish_reason.matched == stop[0]
    assert tok.decode(list(a.output_ids), skip_special_tokens=True) == "Answer: 42"
    assert stop[0] not in b.output_ids and b.finish_reason.type == "length"
    with pytest.raises(RequestError, match="tokenizer"):
        ReplayEngine(["text"]).submit(req([0]))


def test_logprobs_and_bad_completions():
    engine = ReplayEngine([Completion(output_ids=(1, 2), logprobs=(-0.5, -1.5))])
    (s,) = engine.submit(req([0])).result()
    assert s.logprobs == (-0.5, -1.5) and s.sampling_logprobs == (-0.5, -1.5)
    with pytest.raises(ValueError, match="2 logprobs for 1 output ids"):
        Completion(output_ids=(1,), logprobs=(0.0, 0.0))
    with pytest.raises(ValueError, match="exactly one of"):
        Completion()
    with pytest.raises(ValueError, match="finish='done'"):
        Completion(output_ids=(1,), finish="done")
    with pytest.raises(ValueError, match="valid keys"):
        ReplayEngine([{"ids": [1]}])
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.submit(req([]))


def test_prefix_cache_is_emulated():
    engine = ReplayEngine([[5, 6], [7], [8]])
    assert engine.submit(req([1, 2, 3])).result()[0].cached_tokens == 0
    # A follow-up turn extends prompt + output: all but its last token count as cached.
    assert engine.submit(req([1, 2, 3, 5, 6, 9])).result()[0].cached_tokens == 5
    assert engine.submit(req([1, 2, 4])).result()[0].cached_tokens == 2


def test_delayed_requests_overlap_and_abort():
    engine = ReplayEngine([[1], [2], [3]], delay_s=0.3)

    async def both():
        return await asyncio.gather(engine.generate(req([0], rid="p")), engine.generate(req([0], rid="q")))

    loop = asyncio.new_event_loop()
    start = loop.time()
    p, q = loop.run_until_complete(both())
    assert loop.time() - start < 0.55  # concurrent, not 0.6 s in a row
    loop.close()
    assert p[0].output_ids == (1,) and q[0].output_ids == (2,)
    future = engine.submit(req([0], rid="r"))
    assert engine.abort("r") == 1
    (s,) = future.result()
    assert s.finish_reason.type == "abort" and s.output_ids == ()
