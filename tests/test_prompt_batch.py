"""Prompt lists on the service (fake engine): side by side in their own queue places, never
holding a place after they end, and never taking one when the queue cannot hold them all."""
import json
import threading

from turbospark_wsgi.serving.cancel import CancelToken
from turbospark_wsgi.errors import Overloaded
from turbospark_wsgi.serving.generation import Finished, KeepAlive, TextDelta, collect_choices
from turbospark_wsgi.serving.service import GenerationRequest


def run(h, req):
    return h.service.run(req, CancelToken())


def test_prompts_of_a_list_run_at_the_same_time(make_harness):
    h = make_harness(max_batch=2)
    engine = h.engine("fake", reply="abcdef", step_delay=0.002)
    choices, finished = collect_choices(run(h, GenerationRequest(prompts=["x", "yz"], max_tokens=6)))
    assert [c.text for c in choices] == ["abcdef", "abcdef"] and engine.overlaps > 0
    assert sorted(len(r.ids) for r in engine.runs) == [2, 3]      # BOS + the prompt's bytes
    assert (finished.usage.prompt_tokens, finished.usage.completion_tokens) == (5, 12) and finished.last


def test_choices_are_numbered_prompt_times_n_plus_j(make_harness):
    h = make_harness(max_batch=4)
    h.engine("fake", reply="ab")
    events = list(run(h, GenerationRequest(prompts=["x", "y"], n=2, max_tokens=2)))
    finishes = [e for e in events if isinstance(e, Finished)]
    assert sorted(e.index for e in finishes) == [0, 1, 2, 3]
    assert [e.last for e in finishes] == [False, False, False, True]
    assert {e.index for e in events if isinstance(e, TextDelta)} == {0, 1, 2, 3}


def test_a_list_waits_for_places_one_prompt_at_a_time(make_harness):
    """With one running slot the prompts take turns; the list still answers every prompt."""
    h = make_harness(max_batch=1, max_waiting=4)
    engine = h.engine("fake", reply="ab")
    choices, finished = collect_choices(run(h, GenerationRequest(prompts=["x", "y", "z"], max_tokens=2)))
    assert [c.text for c in choices] == ["ab"] * 3 and engine.overlaps == 0 and finished is not None
    assert h.service.queue.running == 0 and h.service.queue.depth == 0


def test_a_finished_prompt_gives_its_place_to_the_next_waiter(make_harness):
    h = make_harness(max_batch=2, max_waiting=4)
    h.engine("fake", reply="abcdefghijklmn", max_context=16, step_delay=0.002)
    # no max_tokens: each prompt may fill the context (14 tokens and 2), so the longer prompt ends first
    events = run(h, GenerationRequest(prompts=["x", "x" * 13], max_tokens=None))
    other = run(h, GenerationRequest(prompt="z", max_tokens=1))     # waits behind the list's two places
    finished = next(e for e in events if isinstance(e, Finished))
    assert finished.index == 1 and not finished.last
    assert other._ticket.wait(1) is True           # while prompt 0 still runs
    assert [e.index for e in events if isinstance(e, Finished)] == [0]
    other.close()


def test_a_list_the_queue_cannot_hold_takes_no_place(make_harness):
    h = make_harness(max_batch=1, max_waiting=2)
    h.engine("fake")
    holder = h.service.queue.enqueue()
    try:
        try:
            run(h, GenerationRequest(prompts=["a", "b", "c"], max_tokens=1))
        except Overloaded as e:
            assert e.status == 503
        else:
            raise AssertionError("admitted a list the queue cannot hold")
        assert h.service.queue.depth == 0 and h.service.queue.running == 1
    finally:
        holder.release()


def test_a_list_longer_than_the_queue_is_refused_before_any_model_loads(make_harness):
    h = make_harness(max_batch=1, max_waiting=2)
    r = h.client().post_json("/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 1}, status=400)
    assert r.json["error"]["param"] == "prompt" and "at most 3 at once" in r.json["error"]["message"]
    assert h.loads == [] and h.service.queue.depth == 0


def test_closing_a_list_stops_every_run_and_frees_every_place(make_harness, wait_until):
    h = make_harness(max_batch=2, max_waiting=4)
    gate = threading.Event()
    engine = h.engine("fake", reply="abcdef", gate=gate)
    events = run(h, GenerationRequest(prompts=["x", "y", "z"], max_tokens=6, stream=True))
    threading.Timer(0.05, gate.set).start()
    first = next(e for e in events if isinstance(e, TextDelta))
    assert first.text == "a"
    events.close()
    assert h.service.queue.running == 0 and h.service.queue.depth == 0
    wait_until(lambda: engine.closed == len(engine.runs))
    assert events.usage is None or events.usage.completion_tokens <= 18


def test_a_queued_list_sends_keepalives_and_leaves_when_cancelled(make_harness):
    h = make_harness(max_batch=1, max_waiting=4)
    h.engine("fake")
    holder = h.service.queue.enqueue()
    cancel = CancelToken()
    events = h.service.run(GenerationRequest(prompts=["a", "b"], max_tokens=1), cancel)
    assert isinstance(next(events), KeepAlive)          # keepalive is 0.05 s in the harness
    cancel.cancel("client disconnected")
    assert list(events) == []
    assert h.service.queue.depth == 0
    holder.release()


def test_the_http_route_streams_every_prompts_chunks(make_harness):
    h = make_harness(max_batch=2)
    h.engine("fake", reply="hi")
    body = h.client().post_json("/v1/completions", {"prompt": ["a", "b"], "stream": True, "max_tokens": 2}).body
    chunks = [json.loads(f[6:]) for f in body.decode().split("\n\n") if f.startswith("data: {")]
    texts = {}
    for c in chunks:
        texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert texts == {0: "hi", 1: "hi"} and body.endswith(b"data: [DONE]\n\n")
