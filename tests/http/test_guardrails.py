"""Guardrails (TURBOSPARK_GUARDRAILS) on every chat route, streamed and not, against the fake engine:
input rules refuse (400 content_filter) or redact before the model sees the text; output rules
redact, or cut the reply with each API's own finish (content_filter, refusal, incomplete); evasions
(format characters inside a word, fullwidth letters, mixed case, a match split over chunks, inside
tool-call arguments and reasoning) are matched all the same, and no stream ever carries the blocked
text. Per-key rule sets, /v1/completions only when listed, /v1/moderations, the metric and the
access log (rule ids, never the text), reload, and the official SDKs reading the new reasons."""
import hashlib
import json
import logging
import re
import threading
from types import SimpleNamespace

import pytest

from tests.conftest import OFFSET, FakeEngine
from tests.http.test_limits import start
from turbospark_wsgi import metrics
from turbospark_wsgi.engine import Finish, Prefill, Token
from turbospark_wsgi.serving.guardrails import reload_all

HERMES = "{% if tools %}<tool_call>{% endif %}{{ messages }}"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567"}
CARD = "4111 1111 1111 1111"
BLOCKED = "project nightingale"

POLICY = f"""
[[rules]]
id = "no-cards"
stage = "both"
match = "pii"
patterns = ["credit_card"]
action = "redact"

[[rules]]
id = "no-email"
stage = "output"
match = "pii"
patterns = ["email"]
action = "redact"

[[rules]]
id = "codename"
match = "literal"
patterns = ["{BLOCKED}", "forbidden term"]
action = "block"

[[rules]]
id = "live-keys"
match = "regex"
patterns = ['sk-live-[a-z0-9]{{8,}}']
action = "redact"

[[rules]]
id = "launch-code"
stage = "output"
match = "regex"
patterns = ['launch code [0-9]{{4}}']
action = "block"
"""


def sha(key):
    return hashlib.sha256(key.encode()).hexdigest()


class CharEngine(FakeEngine):
    """The fake engine, replying one character per token (any Unicode), logprobs when asked."""

    def _run(self, ids, params, should_stop):
        self._active += 1
        try:
            yield Prefill(done=len(ids), total=len(ids))
            n = 0
            for ch in self.reply:
                if should_stop():
                    yield Finish("cancelled", prompt_tokens=len(ids), completion_tokens=n)
                    return
                if n >= params.max_new_tokens:
                    break
                self._wait_step(n)
                n += 1
                lp = None if params.logprobs is None else -0.5
                yield Token(id=OFFSET + ord(ch) % 256, text=ch, logprob=lp, top_logprobs=[] if lp else None)
            yield Finish("length" if n >= params.max_new_tokens else "stop", prompt_tokens=len(ids),
                         completion_tokens=n)
        finally:
            self._active -= 1
            self.closed += 1


def guarded(make_harness, tmp_path, policy=POLICY, reply="Hello", **config):
    path = tmp_path / "guardrails.toml"
    path.write_text(policy)
    h = make_harness(guardrails=str(path), **config)
    h.path = path
    set_reply(h, reply)
    return h


def set_reply(h, reply, **kw):
    engine = h.engines["fake"] = CharEngine(name="fake", reply=reply, max_context=2048, **kw)
    engine.template = SimpleNamespace(source=HERMES)
    return engine


def prompt_of(h):
    engine = h.engines["fake"]
    return engine.decode(engine.runs[-1].ids)


# ---- the routes, each with how to read its reply and its stream -----------------------------------

def _chat_body(text, stream, **extra):
    return {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": 400,
            "stream": stream, **extra}


def _messages_body(text, stream, **extra):
    return {"model": "fake", "max_tokens": 400, "messages": [{"role": "user", "content": text}],
            "stream": stream, **extra}


def _responses_body(text, stream, **extra):
    return {"model": "fake", "input": text, "stream": stream, **extra}


def _completions_body(text, stream, **extra):
    return {"model": "fake", "prompt": text, "max_tokens": 400, "stream": stream, **extra}


def events_of(resp):
    return [json.loads(line[6:]) for line in resp.text.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def chat_reply(resp, stream):
    """(every text the client got, in order, joined; the finish reason)."""
    if not stream:
        choice = resp.json["choices"][0]
        msg = choice["message"]
        calls = "".join(c["function"]["arguments"] for c in msg.get("tool_calls", []))
        return (msg.get("reasoning_content") or "") + (msg["content"] or "") + calls, choice["finish_reason"]
    text, reason = [], None
    for chunk in events_of(resp):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text += [delta.get("reasoning_content") or "", delta.get("content") or ""]
            text += [c["function"].get("arguments", "") for c in delta.get("tool_calls", [])]
            reason = choice["finish_reason"] or reason
    return "".join(text), reason


def messages_reply(resp, stream):
    if not stream:
        blocks = resp.json["content"]
        text = "".join(b.get("text") or b.get("thinking") or json.dumps(b.get("input", "")) for b in blocks)
        return text, resp.json["stop_reason"]
    text, reason = [], None
    for event in events_of(resp):
        delta = event.get("delta", {})
        text += [delta.get("text", ""), delta.get("thinking", ""), delta.get("partial_json", "")]
        reason = delta.get("stop_reason") or reason
    return "".join(text), reason


def responses_reply(resp, stream):
    body = resp.json if not stream else events_of(resp)[-1]["response"]
    if stream:
        text = "".join(e.get("delta", "") for e in events_of(resp) if e["type"].endswith(".delta"))
    else:
        text = "".join(p.get("text", "") for item in body["output"] for p in item.get("content", []))
        text += "".join(item.get("arguments", "") for item in body["output"])
    reason = (body["incomplete_details"] or {}).get("reason") or body["status"]
    return text, reason


def completions_reply(resp, stream):
    if not stream:
        return resp.json["choices"][0]["text"], resp.json["choices"][0]["finish_reason"]
    chunks = [c["choices"][0] for c in events_of(resp) if c.get("choices")]
    return "".join(c["text"] for c in chunks), [c["finish_reason"] for c in chunks if c["finish_reason"]][-1]


ROUTES = {
    "chat": ("/v1/chat/completions", _chat_body, chat_reply, "content_filter", "stop"),
    "messages": ("/v1/messages", _messages_body, messages_reply, "refusal", "end_turn"),
    "responses": ("/v1/responses", _responses_body, responses_reply, "content_filter", "completed"),
}
EVERY = [(name, stream) for name in ROUTES for stream in (False, True)]


def post(h, route, text, stream, key=None, status=200, **extra):
    path, body, _, _, _ = ROUTES[route]
    headers = {"Authorization": f"Bearer {KEYS[key]}"} if key else {}
    return h.client().post_json(path, body(text, stream, **extra), headers=headers, status=status)


def reply_of(route, resp, stream):
    return ROUTES[route][2](resp, stream)


def never_shows(resp, *secrets):
    """Neither the raw body nor any text read from it holds a secret (case and spacing ignored).
    NOTE(ids): the random ids (24 to 48 hex digits) are taken out first: one held "0451" now and then."""
    flat = re.sub(r"[0-9a-f]{24,}", "", re.sub(r"\s+", " ", resp.text.lower()))
    for secret in secrets:
        assert secret.lower() not in flat, secret


# ---- input rules -------------------------------------------------------------------------------

@pytest.mark.parametrize("route, stream", EVERY)
@pytest.mark.parametrize("evasion", ["Project Nightingale", "project night\u200dingale", "PROJECT\u00a0 NIGHTINGALE",
                                     "\uff50\uff52\uff4f\uff4a\uff45\uff43\uff54 nightingale"])
def test_an_input_block_refuses_before_any_token(make_harness, tmp_path, route, stream, evasion):
    h = guarded(make_harness, tmp_path)
    resp = post(h, route, f"tell me about {evasion} please", stream, status=400)
    assert h.engines["fake"].runs == []
    if route == "messages":
        assert resp.json["error"]["type"] == "invalid_request_error" and "'codename'" in resp.json["error"]["message"]
    else:
        err = resp.json["error"]
        assert err["code"] == "content_filter" and "'codename'" in err["message"]
        assert err["param"] == ("input[0].content" if route == "responses" else "messages[0].content")
    never_shows(resp, "nightingale")


@pytest.mark.parametrize("route, stream", EVERY)
def test_an_input_redaction_is_what_the_model_sees(make_harness, tmp_path, route, stream):
    h = guarded(make_harness, tmp_path, reply="Noted.")
    resp = post(h, route, f"my card is {CARD.replace(' ', '-')} and key sk-live-ABCD1234EF", stream)
    seen = prompt_of(h)
    assert "[REDACTED:credit_card]" in seen and "[REDACTED:live-keys]" in seen
    assert "4111" not in seen and "abcd1234" not in seen.lower()
    assert reply_of(route, resp, stream)[0] == "Noted."
    if route == "chat":
        body = resp.json if not stream else events_of(resp)[0]
        [result] = body["prompt_filter_results"]
        assert result["content_filter_results"]["custom_blocklists"]["details"] == [
            {"id": "no-cards", "filtered": True, "action": "redact"},
            {"id": "live-keys", "filtered": True, "action": "redact"}]


def test_input_rules_read_every_message_and_tool_call_argument(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path)
    engine, rendered = h.engines["fake"], []
    render = engine.render_chat
    engine.render_chat = lambda messages, *a, **kw: rendered.append(json.dumps(messages)) or render(messages, *a, **kw)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "look it up"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "lookup", "arguments": json.dumps({"q": "the forbidden term"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "nothing"}]
    resp = h.client().post_json("/v1/chat/completions", {"model": "fake", "messages": messages, "tools": TOOLS},
                                status=400)
    assert resp.json["error"]["param"] == "messages[2].tool_calls[0].function.arguments.q"
    messages[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"q": f"card {CARD}"})
    h.client().post_json("/v1/chat/completions", {"model": "fake", "messages": messages, "tools": TOOLS})
    assert "[REDACTED:credit_card]" in rendered[-1] and "4111" not in rendered[-1]


def test_system_prompts_and_instructions_are_read_too(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path)
    c = h.client()
    resp = c.post_json("/v1/messages", {"model": "fake", "max_tokens": 8, "system": "mind the Forbidden Term",
                                        "messages": [{"role": "user", "content": "hi"}]}, status=400)
    assert "'codename'" in resp.json["error"]["message"]
    resp = c.post_json("/v1/messages", {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "the forbidden\u00a0\u200bterm"}]}]}, status=400)
    assert "'codename'" in resp.json["error"]["message"]
    resp = c.post_json("/v1/responses", {"model": "fake", "input": "hi", "instructions": "say FORBIDDEN TERM"},
                       status=400)
    assert resp.json["error"]["code"] == "content_filter"
    assert h.engines["fake"].runs == []


# ---- output rules ------------------------------------------------------------------------------

@pytest.mark.parametrize("route, stream", EVERY)
@pytest.mark.parametrize("said", [BLOCKED, "Project NIGHTINGALE", "project night\u200bingale",
                                  "\uff30roject \uff2eightingale", "project   nightingale", "launch code 0451"])
def test_an_output_block_ends_the_reply_before_the_blocked_text(make_harness, tmp_path, route, stream, said):
    h = guarded(make_harness, tmp_path, reply=f"Sure. It is {said}, as you know. More text follows.")
    resp = post(h, route, "tell me", stream)
    text, reason = reply_of(route, resp, stream)
    assert text == "Sure. It is " and reason == ROUTES[route][3]
    never_shows(resp, said, "nightingale", "0451", "as you know")
    assert h.engines["fake"].closed == 1 and h.service.queue.running == 0


@pytest.mark.parametrize("route, stream", EVERY)
def test_output_redactions_in_content_reasoning_and_tool_arguments(make_harness, tmp_path, route, stream):
    reply = (f"<think>her card is {CARD}</think>Write to Bob.Smith@Example.org, key sk-live-0123abcd9."
             '<tool_call>\n{"name": "lookup", "arguments": {"card": "' + CARD.replace(" ", "") + '"}}\n</tool_call>')
    h = guarded(make_harness, tmp_path, reply=reply)
    extra = {"tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]} \
        if route == "responses" else {"tools": TOOLS if route == "chat" else
                                      [{"name": "lookup", "input_schema": {"type": "object"}}]}
    resp = post(h, route, "go", stream, **extra)
    text, _ = reply_of(route, resp, stream)
    assert "[REDACTED:credit_card]" in text and "[REDACTED:email]" in text and "[REDACTED:live-keys]" in text
    never_shows(resp, "4111", "bob.smith", "0123abcd9")
    assert text.count("[REDACTED:credit_card]") == 2, text


@pytest.mark.parametrize("route, stream", EVERY)
def test_a_clean_reply_is_unchanged(make_harness, tmp_path, route, stream):
    h = guarded(make_harness, tmp_path, reply="Nothing to see: 2024-01-15, 3.14159, version 1.2.3.4.5.")
    resp = post(h, route, "hi", stream)
    assert reply_of(route, resp, stream) == ("Nothing to see: 2024-01-15, 3.14159, version 1.2.3.4.5.",
                                             ROUTES[route][4])
    if route == "chat":
        body = resp.json if not stream else events_of(resp)[-1]
        assert "content_filter_results" not in body["choices"][0] and "prompt_filter_results" not in body


def test_chat_reports_the_rules_that_acted_per_choice(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path, reply=f"card {CARD} then {BLOCKED}")
    body = post(h, "chat", "hi", False).json
    assert body["choices"][0]["content_filter_results"]["custom_blocklists"] == {
        "filtered": True, "details": [{"id": "no-cards", "filtered": True, "action": "redact"},
                                      {"id": "codename", "filtered": True, "action": "block"}]}
    assert body["usage"]["completion_tokens"] > len("card [REDACTED:credit_card] then ")   # what was generated


def test_n_choices_all_end_when_one_is_blocked(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path, reply=f"ok {BLOCKED}")
    for stream in (False, True):
        resp = post(h, "chat", "hi", stream, n=3)
        if stream:
            ends = [c["choices"][0] for c in events_of(resp) if c["choices"] and c["choices"][0]["finish_reason"]]
            assert sorted(c["index"] for c in ends) == [0, 1, 2] and resp.text.rstrip().endswith("[DONE]")
        else:
            assert [c["finish_reason"] for c in resp.json["choices"]] == ["content_filter"] * 3
        never_shows(resp, "nightingale")


def test_logprobs_never_carry_blocked_or_redacted_text(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path, reply=f"pay {CARD} now {BLOCKED}")
    for stream in (False, True):
        resp = post(h, "chat", "hi", stream, logprobs=True, top_logprobs=0)
        never_shows(resp, "nightingale")
        tokens = [e["token"] for c in ([resp.json] if not stream else events_of(resp))
                  for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
        assert "".join(tokens).startswith("pay [REDACTED]") and "4" not in "".join(tokens)
        assert "[REDACTED]" in tokens


def test_a_stream_holds_back_only_what_may_still_match(make_harness, tmp_path):
    """Text that cannot become a match is sent at once: here no more than the word being written
    is held back (it may still become an e-mail address or a key)."""
    h = guarded(make_harness, tmp_path, reply="one two three four five six seven")
    chunks = [c["choices"][0]["delta"].get("content") for c in events_of(post(h, "chat", "hi", True))]
    pieces = [c for c in chunks if c]
    assert len(pieces) >= 7 and max(map(len, pieces)) <= len(" three")
    assert "".join(pieces) == "one two three four five six seven"


# ---- routes and keys ---------------------------------------------------------------------------

def test_completions_are_guarded_only_when_the_file_names_them(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path, reply=f"a {BLOCKED}")
    assert h.client().post_json("/v1/completions", _completions_body(BLOCKED, False)).status_int == 200
    h = guarded(make_harness, tmp_path, POLICY.replace("[[rules]]", 'routes = ["/v1/completions", '
                '"/v1/chat/completions"]\n[[rules]]', 1), reply=f"a {BLOCKED}")
    resp = h.client().post_json("/v1/completions", _completions_body(BLOCKED, False), status=400)
    assert resp.json["error"]["code"] == "content_filter"
    for stream in (False, True):
        resp = h.client().post_json("/v1/completions", _completions_body("hi", stream))
        assert completions_reply(resp, stream) == ("a ", "content_filter")
        never_shows(resp, "nightingale")
    resp = h.client().post_json("/v1/completions", {"model": "fake", "prompt": [72, 105]}, status=400)
    assert "token ids" in resp.json["error"]["message"]
    post(h, "messages", BLOCKED, False)         # not listed: not guarded


KEYED = POLICY + f"""
[[rules]]
id = "bob-only"
keys = ["{sha(KEYS['bob'])}"]
match = "literal"
patterns = ["quarterly numbers"]
action = "block"

[keys.alice]
sha256 = "{sha(KEYS['alice'])}"
rules = ["no-cards"]
"""


def test_rules_per_key(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path, KEYED, api_keys=tuple(KEYS.values()))
    post(h, "chat", "the quarterly numbers", False, key="bob", status=400)
    post(h, "chat", "the quarterly numbers", False, key="alice")
    post(h, "chat", BLOCKED, False, key="alice")                   # her own set: cards only
    post(h, "chat", BLOCKED, False, key="bob", status=400)
    post(h, "chat", f"card {CARD}", False, key="alice")
    assert "[REDACTED:credit_card]" in prompt_of(h)


def test_moderations_run_the_input_rules_of_the_key(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path, KEYED, api_keys=tuple(KEYS.values()))
    auth = {"Authorization": f"Bearer {KEYS['bob']}"}
    body = h.client().post_json("/v1/moderations", {"input": [f"a {BLOCKED}", "fine", f"pay {CARD}"]},
                                headers=auth).json
    assert body["id"].startswith("modr-") and len(body["results"]) == 3
    flagged = [r["flagged"] for r in body["results"]]
    assert flagged == [True, False, True]
    first = body["results"][0]
    assert first["categories"]["codename"] is True and first["categories"]["no-cards"] is False
    assert set(first["categories"]) == {"no-cards", "codename", "live-keys", "bob-only"}   # input rules only
    body = h.client().post_json("/v1/moderations", {"input": [{"type": "text", "text": BLOCKED}]},
                                headers={"Authorization": f"Bearer {KEYS['alice']}"}).json
    assert body["results"][0]["flagged"] is False and set(body["results"][0]["categories"]) == {"no-cards"}
    resp = h.client().post_json("/v1/moderations", {"input": 3}, headers=auth, status=400)
    assert resp.json["error"]["param"] == "input"


@pytest.mark.parametrize("raw, param", [
    (b'{"input": "a\\ud800b"}', "input"), (b'{"input": ["ok", "\\udfff"]}', "input[1]"),
    (b'{"input": ' + b"[" * 100 + b"]" * 100 + b"}", None), (b'{"input": []}', "input"),
    (b'{"input": [{"type": "text", "text": 3}]}', "input[0].text"), (b'{"input": [{"type": "audio"}]}', "input[0]"),
    (b'{"input": "x", "model": 7}', "model"), (b'[1, 2]', None), (b'{"nope": 1}', "input"),
])
def test_moderations_answer_hostile_bodies_with_a_400_and_keep_serving(make_harness, tmp_path, raw, param):
    h = guarded(make_harness, tmp_path)
    resp = h.client().post("/v1/moderations", raw, content_type="application/json", status=400)
    assert resp.json["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert resp.json["error"]["param"] == param
    assert h.client().post_json("/v1/moderations", {"input": f"say {BLOCKED}"}).json["results"][0]["flagged"]
    assert post(h, "chat", "hello", False).json["choices"][0]["message"]["content"] == "Hello"


def test_moderations_refuse_more_inputs_than_embeddings_take(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path, max_embedding_inputs=4)
    resp = h.client().post_json("/v1/moderations", {"input": ["a"] * 5}, status=400)
    assert resp.json["error"]["param"] == "input" and "at most 4" in resp.json["error"]["message"]


# ---- what operators see ------------------------------------------------------------------------

def test_the_metric_and_the_access_log_name_the_rule_never_the_text(make_harness, tmp_path, caplog):
    before = metrics.GUARDRAIL_ACTIONS.labels("codename", "output", "block")._value.get()
    h = guarded(make_harness, tmp_path, reply=f"x {BLOCKED}")
    with caplog.at_level(logging.INFO):
        post(h, "chat", "hi", True)
        post(h, "chat", BLOCKED, False, status=400)
        post(h, "chat", f"card {CARD}", False)
    assert metrics.GUARDRAIL_ACTIONS.labels("codename", "output", "block")._value.get() == before + 2   # two replies
    assert metrics.GUARDRAIL_ACTIONS.labels("codename", "input", "block")._value.get() >= 1
    assert metrics.GUARDRAIL_ACTIONS.labels("no-cards", "input", "redact")._value.get() >= 1
    lines = [r.getMessage() for r in caplog.records if r.name == "turbospark.access"]
    assert any("guardrails=codename:block" in line and "finish=content_filter" in line for line in lines)
    assert any("guardrails=codename:block" in line and " 400 " in line for line in lines)
    assert any("guardrails=no-cards:redact" in line for line in lines)
    assert "nightingale" not in caplog.text.lower() and "4111" not in caplog.text


def test_reload_applies_a_new_policy_and_keeps_running_streams(make_harness, tmp_path):
    h = guarded(make_harness, tmp_path, reply="a long answer that keeps going", max_batch=2)
    gate = threading.Event()
    set_reply(h, "a long answer that keeps going", gate=gate)
    _, _, running = start(h.app(), "/v1/chat/completions", _chat_body("hi", True), "alice")
    h.path.write_text(POLICY.replace('"forbidden term"', '"forbidden term", "keeps going"'))
    reload_all()
    gate.set()
    body = b"".join(running).decode()
    running.close()
    assert body.rstrip().endswith("data: [DONE]")
    assert "keeps going" in "".join(chat_reply(SimpleNamespace(text=body), True)[0])   # admitted under the old policy
    set_reply(h, "a long answer that keeps going")
    assert reply_of("chat", post(h, "chat", "hi", False), False) == ("a long answer that ", "content_filter")


def test_a_bad_file_on_reload_keeps_the_previous_policy(make_harness, tmp_path, caplog):
    h = guarded(make_harness, tmp_path)
    h.path.write_text(POLICY + '\n[[rules]]\nid = "x"\nmatch = "regex"\npatterns = ["(a)\\\\1"]\naction = "block"\n')
    with caplog.at_level(logging.ERROR):
        h.service.guardrails.reload()
    assert "not reloaded" in caplog.text and "backtracking" in caplog.text
    post(h, "chat", BLOCKED, False, status=400)


# ---- the official SDKs -------------------------------------------------------------------------

def sdk(cls, h, base_url):
    httpx2 = pytest.importorskip("httpx2")
    return cls(base_url=base_url, api_key="unused", max_retries=0,
               http_client=httpx2.Client(transport=httpx2.WSGITransport(app=h.app())))


def test_the_openai_sdk_reads_content_filter_and_incomplete(make_harness, tmp_path):
    openai = pytest.importorskip("openai")
    h = guarded(make_harness, tmp_path, reply=f"fine, {BLOCKED}")
    client = sdk(openai.OpenAI, h, "http://guard.test/v1")
    reply = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason == "content_filter" and reply.choices[0].message.content == "fine, "
    with client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                        stream=True) as stream:
        reasons = [c.choices[0].finish_reason for c in stream if c.choices]
    assert reasons[-1] == "content_filter"
    response = client.responses.create(model="fake", input="hi")
    assert response.status == "incomplete" and response.incomplete_details.reason == "content_filter"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": BLOCKED}])
    assert refused.value.code == "content_filter"
    moderation = client.moderations.create(input=BLOCKED)
    assert moderation.results[0].flagged


def test_the_anthropic_sdk_reads_refusal(make_harness, tmp_path):
    anthropic = pytest.importorskip("anthropic")
    h = guarded(make_harness, tmp_path, reply=f"fine, {BLOCKED}")
    client = sdk(anthropic.Anthropic, h, "http://guard.test")
    message = client.messages.create(model="fake", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    assert message.stop_reason == "refusal" and message.content[0].text == "fine, "
    with client.messages.stream(model="fake", max_tokens=100, messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "refusal"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="fake", max_tokens=5, messages=[{"role": "user", "content": BLOCKED}])
