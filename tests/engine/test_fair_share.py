"""The batch's rows shared between clients: a client over its share has its extra sequences paused
(slot and K/V kept) while another client's run at the next step; paused runs end as they would have."""
import threading

import pytest

from turbospark_wsgi.serving import compute
from turbospark_wsgi.serving.cancel import CancelToken
from turbospark_wsgi.config import Config
from turbospark_wsgi.engine import Finish, FinishReason, Paused, Prefill, SamplingParams, Token, load_engine
from turbospark_wsgi.serving.generation import TextDelta
from turbospark_wsgi.serving.params import Sampling
from turbospark_wsgi.serving.service import GenerationRequest, Service

TEXTS = ["Once upon a time", "The little dog", "One day, Lily went to the park and", "Tom", "A cat sat",
         "The sun was", "Ben and Mia", "There was a big"]


@pytest.fixture(params=["stories", "tiny_q8"])
def path(request, tiny_gguf):
    if request.param == "stories":
        return request.getfixturevalue("stories_gguf")
    return tiny_gguf(qtype="Q8_0").path


def engine_for(path, max_batch=4, max_paused=4):
    return load_engine(path, device="cpu", max_batch=max_batch, max_paused=max_paused, prefill_chunk=8)


def params_for(i, n=24):
    # even runs greedy, odd ones seeded sampling
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=7 + i, max_new_tokens=n, ignore_eos=True)


class Runs:
    """Generators driven round-robin, as the request threads drive them through the compute thread."""

    def __init__(self, engine):
        self.engine, self.gens, self.tokens, self.paused, self.first_token_step = engine, [], [], [], []
        self.finish = []

    def add(self, prompt, params, client, should_stop=None):
        self.gens.append(self.engine.generate(prompt, params, should_stop=should_stop, client=client))
        self.tokens.append([])
        self.paused.append(0)
        self.first_token_step.append(None)
        self.finish.append(None)
        return len(self.gens) - 1

    def round(self):
        for i, gen in enumerate(self.gens):
            if self.finish[i] is not None:
                continue
            event = next(gen)
            while isinstance(event, Prefill):                # progress: read on at once, as a thread would
                event = next(gen)
            if isinstance(event, Token):
                self.tokens[i].append(event.id)
                if self.first_token_step[i] is None:
                    self.first_token_step[i] = self.engine.scheduler.steps
            elif isinstance(event, Paused):
                self.paused[i] += 1
            elif isinstance(event, Finish):
                self.finish[i] = event
                gen.close()

    def until_token(self, i):
        """Reads run i alone until its first Token: the steps its polls run are the ones it waited."""
        event = next(self.gens[i])
        while not isinstance(event, Token):
            event = next(self.gens[i])
        self.tokens[i].append(event.id)
        self.first_token_step[i] = self.engine.scheduler.steps

    def drain(self):
        while any(f is None for f in self.finish):
            self.round()


def solo(path, prompt, params):
    engine = engine_for(path, max_batch=1, max_paused=0)
    return [e.id for e in engine.generate(prompt, params) if isinstance(e, Token)]


def test_a_newcomer_runs_within_two_steps_and_paused_runs_equal_their_solo_runs(path):
    engine = engine_for(path)
    prompts = [engine.encode(t, add_bos=True) for t in TEXTS]
    runs = Runs(engine)
    for i in range(4):                                      # client a fills the batch
        runs.add(prompts[i], params_for(i), "a")
    for _ in range(8):
        runs.round()
    assert all(len(t) > 0 for t in runs.tokens)
    runs.paused = [0] * 4                                    # (a prompt also waits while another's chunk runs)
    arrived = engine.scheduler.steps
    for i in range(4, 6):                                   # client b: two runs
        runs.add(prompts[i], params_for(i), "b")
        runs.until_token(i)
    assert all(runs.first_token_step[i] - arrived <= 2 for i in (4, 5)), (arrived, runs.first_token_step)
    runs.drain()
    assert all(f.reason == FinishReason.LENGTH and f.completion_tokens == 24 for f in runs.finish)
    assert runs.tokens == [solo(path, prompts[i], params_for(i)) for i in range(6)]
    assert min(runs.paused[2:4]) >= 3                        # a's last two waited for b's two rows, then went on
    assert runs.paused[0] == runs.paused[1] == 0             # a's first two kept theirs (FIFO within a)
    assert not any(s.busy for s in engine.scheduler.slots) and len(engine.scheduler.slots) == 4   # spares dropped


def test_rows_are_dealt_round_robin_between_clients_in_arrival_order(path):
    engine = engine_for(path, max_batch=4, max_paused=6)
    prompts = [engine.encode(t, add_bos=True) for t in TEXTS]
    runs = Runs(engine)
    clients = ["a", "a", "a", "b", "b", "b", "c", "a"]
    for i, client in enumerate(clients):
        runs.add(prompts[i], params_for(i, 40), client)
    for _ in range(8):                                       # the four prompts' chunks run on the way
        runs.round()
    ran = [i for i, t in enumerate(runs.tokens) if t]
    assert ran == [0, 1, 3, 6]                              # a, b and c one row each, then a's second
    runs.drain()
    assert runs.tokens == [solo(path, prompts[i], params_for(i, 40)) for i in range(len(clients))]


def test_one_client_over_the_batch_runs_its_sequences_in_order(path):
    engine = engine_for(path, max_batch=2, max_paused=2)
    prompts = [engine.encode(t, add_bos=True) for t in TEXTS[:4]]
    runs = Runs(engine)
    for i in range(4):
        runs.add(prompts[i], params_for(i, 8), "a")
    runs.drain()
    assert max(runs.first_token_step[:2]) < min(runs.first_token_step[2:])
    assert runs.tokens == [solo(path, prompts[i], params_for(i, 8)) for i in range(4)]


def test_cancelling_a_paused_sequence_ends_it_and_frees_its_slot(path):
    engine = engine_for(path, max_batch=2, max_paused=2)
    prompts = [engine.encode(t, add_bos=True) for t in TEXTS[:3]]
    stop, runs = [], Runs(engine)
    runs.add(prompts[0], params_for(0, 16), "a")
    runs.add(prompts[1], params_for(1, 16), "a", should_stop=lambda: bool(stop))
    for _ in range(6):
        runs.round()
    paused = engine.scheduler.active[1]
    runs.add(prompts[2], params_for(2, 16), "b")
    for _ in range(4):
        runs.round()
    assert runs.paused[1] > 0 and runs.tokens[1] and runs.finish[1] is None
    stop.append(True)
    runs.round()
    assert runs.finish[1].reason == FinishReason.CANCELLED
    assert not paused.slot.busy and paused not in engine.scheduler.active
    assert runs.tokens[1] == solo(path, prompts[1], params_for(1, 16))[:len(runs.tokens[1])]
    runs.drain()
    assert [runs.tokens[0], runs.tokens[2]] == [solo(path, prompts[i], params_for(i, 16)) for i in (0, 2)]


def test_a_sixteen_stream_burst_from_one_key_delays_another_keys_first_token_by_at_most_a_few_steps(
        stories_gguf, tmp_path, wait_until):
    service = Service(Config(models_dir=str(tmp_path), model=str(stories_gguf), max_batch=8, max_paused=8,
                             max_waiting=16, load_default=False, prefill_chunk=8))
    engine = service.registry.resolve(None)
    steps = lambda: engine.scheduler.steps      # noqa: E731
    prompt = engine.encode("Once upon a time", add_bos=True)

    def start(client):
        sampling = Sampling(temperature=0, ignore_eos=True)
        return service.run(GenerationRequest(prompt_ids=prompt, max_tokens=96, sampling=sampling, client=client,
                                             stream=True), CancelToken())

    texts = {}

    def drain(i, gen):
        texts[i] = "".join(e.text for e in gen if isinstance(e, TextDelta))

    burst = [start("key:a") for _ in range(16)]             # 8 run, 8 wait in the queue
    assert (service.queue.running, service.queue.depth) == (8, 8)
    threads = [threading.Thread(target=drain, args=(i, gen)) for i, gen in enumerate(burst)]
    for t in threads:
        t.start()
    wait_until(lambda: steps() >= 24, 30)                   # a's first eight are decoding
    arrived, late = steps(), start("key:b")
    first = next(e for e in late if isinstance(e, TextDelta) and e.text)
    seen = steps()
    # the step that made b's first token: b runs every step from then on (read on the compute thread)
    made = compute.run(lambda: steps() - next(s for s in engine.scheduler.active if s.client == "key:b").completion)
    # made at the next step; read within a few more (each read of the stream may wait for a step in progress)
    assert made + 1 - arrived <= 2 and seen - arrived <= 12, (arrived, made + 1, seen)
    rest = "".join(e.text for e in late if isinstance(e, TextDelta))
    for t in threads:
        t.join(60)
    assert len(texts) == 16 and len(set(texts.values())) == 1 and texts[0] == first.text + rest


def test_a_newcomers_short_prompt_goes_before_the_chunks_of_a_running_clients_long_prompt(path):
    engine = engine_for(path)
    prompts = [engine.encode(t, add_bos=True) for t in TEXTS]
    long_prompt = [t for p in prompts for t in p[1:]][:60]        # several chunks of 8
    runs = Runs(engine)
    for i in range(2):
        runs.add(prompts[i], params_for(i), "a")
    for _ in range(3):
        runs.round()
    runs.add(long_prompt, params_for(2), "a")
    arrived = engine.scheduler.steps
    runs.add(prompts[3], params_for(3), "b")
    runs.until_token(3)
    assert runs.first_token_step[3] - arrived <= 2 and runs.first_token_step[2] is None
    runs.drain()
    assert runs.tokens == [solo(path, p, params_for(i)) for i, p in enumerate([*prompts[:2], long_prompt, prompts[3]])]


def test_one_client_never_holds_more_caches_than_the_batch(path):
    engine = engine_for(path, max_batch=2, max_paused=2)
    for text in TEXTS:                                      # unrelated prompts, one after another
        list(engine.generate(engine.encode(text, add_bos=True), params_for(0, 4), client="a"))
    assert len(engine.scheduler.slots) <= 2


def test_a_background_run_gives_way_while_a_live_prompt_prefills_and_ends_as_it_would_alone(path):
    """A batch line (background) steps only where live runs leave room: no step at all while a
    live prompt is in prefill, so the live run's first token waits for no batch line; batching
    never changes a row, so the batch line's tokens are those it gets alone."""
    engine = engine_for(path)
    alone = [e.id for e in engine.generate(engine.encode(TEXTS[0], True), params_for(0, 12)) if isinstance(e, Token)]
    bg = engine.generate(engine.encode(TEXTS[0], True), params_for(0, 12), client="k", background=True)
    tokens, event = [], next(bg)
    while not isinstance(event, Token):
        event = next(bg)
    tokens.append(event.id)
    live = engine.generate(engine.encode(TEXTS[2] * 3, True), params_for(2, 4), client="k")
    assert isinstance(next(live), Prefill)
    skipped = 0
    while True:
        event = next(live)
        if isinstance(event, Token):
            break
        prefilling = any(s.state == "prefill" and not s.background for s in engine.scheduler.active)
        seen = next(bg)                 # a poll of the batch line: it runs a step
        if prefilling:
            assert isinstance(seen, Paused)     # no decode step for it while the live prompt prefills
            skipped += 1
        tokens += [seen.id] if isinstance(seen, Token) else []
    assert skipped >= 2
    for event in bg:
        if isinstance(event, Token):
            tokens.append(event.id)
    list(live)
    assert tokens == alone


def test_batch_lines_reuse_each_others_slots_and_leave_live_prefixes_cached(path):
    def reused_after(background):
        engine = engine_for(path, max_batch=2, max_paused=0)
        warm = engine.encode(TEXTS[2], True)
        list(engine.generate(warm, params_for(0, 2), client="live"))              # a live conversation's slot
        for i in (3, 4, 5, 6):                                                     # other runs, one after another
            list(engine.generate(engine.encode(TEXTS[i], True), params_for(0, 2), client="k", background=background))
        again = engine.generate(warm, params_for(0, 2), client="live")
        first = next(again)
        list(again)
        return first.done

    assert reused_after(background=True) > 1            # its prefix was still cached
    assert reused_after(background=False) <= 1          # live runs take the least recently used slot
