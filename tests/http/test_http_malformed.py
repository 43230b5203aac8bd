"""Malformed bodies: every one gets its status and an OpenAI envelope, never a 500."""
import io
import json

import falcon.testing
import pytest
import webob

BIG_PROMPT = json.dumps({"prompt": "x" * (2 * 1024 * 1024)}).encode()

CASES = [
    # (name, raw body, content type, status, param)
    ("prompt wrong type", b'{"prompt": 5}', "application/json", 400, "prompt"),
    ("prompt object", b'{"prompt": {"a": [1, {"b": null}]}}', "application/json", 400, "prompt"),
    ("negative max_tokens", b'{"prompt": "hi", "max_tokens": -5}', "application/json", 400, "max_tokens"),
    ("huge max_tokens", b'{"prompt": "hi", "max_tokens": 1000000000000000000000000000000}', "application/json", 400, "max_tokens"),
    ("float max_tokens", b'{"prompt": "hi", "max_tokens": 1.5}', "application/json", 400, "max_tokens"),
    ("overflowing float", b'{"prompt": "hi", "temperature": 1e999}', "application/json", 400, "temperature"),
    ("NaN literal", b'{"prompt": "hi", "temperature": NaN}', "application/json", 400, None),
    ("Infinity literal", b'{"prompt": "hi", "top_p": -Infinity}', "application/json", 400, None),
    ("5000-digit integer", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "application/json", 400, None),
    ("deep nesting", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "application/json", 400, None),
    ("nested junk in stop", b'{"prompt": "hi", "stop": [["a"], {"b": 1}]}', "application/json", 400, "stop"),
    ("nested junk in logit_bias", b'{"prompt": "hi", "logit_bias": {"1": [1]}}', "application/json", 400, "logit_bias"),
    ("too many stops", json.dumps({"prompt": "hi", "stop": ["x"] * 1000}).encode(), "application/json", 400, "stop"),
    ("non-UTF-8 bytes", b'{"prompt": "\xff\xfe"}', "application/json", 400, None),
    ("array body", b"[1, 2]", "application/json", 400, None),
    ("string body", b'"hello"', "application/json", 400, None),
    ("null body", b"null", "application/json", 400, None),
    ("number body", b"1", "application/json", 400, None),
    ("truncated JSON", b'{"prompt": "hi"', "application/json", 400, None),
    ("empty body", b"", "application/json", 400, None),
    ("whitespace body", b"  \n", "application/json", 400, None),
    ("2 MB prompt", BIG_PROMPT, "application/json", 400, "prompt"),
    ("wrong content type", b'{"prompt": "hi"}', "text/plain", 415, None),
    ("form content type", b"prompt=hi", "application/x-www-form-urlencoded", 415, None),
    ("stream not bool", b'{"prompt": "hi", "stream": 1}', "application/json", 400, "stream"),
    ("n as list", b'{"prompt": "hi", "n": [2]}', "application/json", 400, "n"),
]


@pytest.mark.parametrize("name, raw, ctype, status, param", CASES, ids=[c[0] for c in CASES])
def test_malformed_bodies_get_an_envelope(client, name, raw, ctype, status, param):
    r = client.post("/v1/completions", raw, content_type=ctype, status=status)
    error = r.json["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_no_content_type_is_read_as_json(client):
    r = client.post("/v1/completions", b'{"prompt": "hi"}', headers={"Content-Type": ""})
    assert r.status_int == 200


def test_a_body_over_the_limit_is_413(make_harness):
    client = make_harness(max_body=1024).client()
    r = client.post("/v1/completions", BIG_PROMPT, content_type="application/json", status=413)
    assert r.json["error"]["code"] == "request_too_large" and "1024" in r.json["error"]["message"]


def test_an_invalid_content_length_is_400(harness):
    env = falcon.testing.create_environ("/v1/completions", method="POST", body=b"{}",
                                        headers={"Content-Type": "application/json"})
    env["CONTENT_LENGTH"] = "abc"           # webtest's lint refuses to send this
    r = falcon.testing.StartResponseMock()
    body = b"".join(harness.app()(env, r))
    assert r.status.startswith("400") and json.loads(body)["error"]["type"] == "invalid_request_error"


def call_chunked(app, raw):
    env = webob.Request.blank("/v1/completions", method="POST").environ
    env.pop("CONTENT_LENGTH", None)
    env.update({"CONTENT_TYPE": "application/json", "HTTP_TRANSFER_ENCODING": "chunked",
                "wsgi.input": io.BytesIO(raw), "wsgi.input_terminated": True})
    seen = {}
    body = b"".join(app(env, lambda status, headers, exc=None: seen.update(status=status)))
    return int(seen["status"][:3]), json.loads(body)


def test_chunked_bodies_are_read_and_limited(make_harness):
    h = make_harness(max_body=2048)
    app = h.app()
    status, body = call_chunked(app, b'{"prompt": "hi", "max_tokens": 2}')
    assert status == 200 and body["choices"][0]["text"] == "He"
    status, body = call_chunked(app, json.dumps({"prompt": "x" * 5000}).encode())
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = call_chunked(app, b"")
    assert status == 400


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1" * 5000: 1}}, "logit_bias"),    # was a 500
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"\u0663": 1}}, "logit_bias"),     # a non-ASCII digit
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "temperature": 1e308 * 10}, None),              # Infinity: not JSON
    ("/v1/messages", {**MESSAGES, "top_k": True}, "top_k"),
    ("/v1/messages", {**MESSAGES, "stream": "yes"}, "stream"),
])
def test_chat_and_messages_refuse_what_completions_refuses(harness, path, body, param):
    harness.engine("fake", reply="ok", max_context=512)
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"} if path == "/v1/messages" else {}
    r = harness.client().post(path, json.dumps(body), content_type="application/json", headers=headers,
                              status=400)
    error = r.json["error"]
    assert error["type"] == "invalid_request_error" and error.get("param", param) == param
