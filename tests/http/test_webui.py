"""The chat page at `/`: served from the package with an ETag and a strict CSP, open without a key,
off with TURBOSPARK_WEB_UI=0, and its script never hands model text to innerHTML."""
import re
from pathlib import Path

import pytest

from turbospark_wsgi.config import Config
from turbospark_wsgi.http.resources.webui import FILES

STATIC = Path(__file__).resolve().parents[2] / "turbospark_wsgi" / "http" / "static"


def test_root_serves_the_page_with_a_strict_csp(client):
    r = client.get("/", status=200)
    assert r.content_type == "text/html" and "<title>TurboSpark chat</title>" in r.text
    csp = r.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert r.headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_file_has_an_etag_and_answers_304_on_a_match(client, name):
    path = "/" if name == "index.html" else f"/ui/{name}"
    r = client.get(path, status=200)
    etag = r.headers["ETag"]
    assert r.body == (STATIC / name).read_bytes() and re.fullmatch(r'"[0-9a-f]{32}"', etag)
    assert r.headers["Cache-Control"] == "no-cache"
    again = client.get(path, headers={"If-None-Match": etag}, status=304)
    assert again.body == b"" and again.headers["ETag"] == etag
    client.get(path, headers={"If-None-Match": f'"other", W/{etag}'}, status=304)
    client.get(path, headers={"If-None-Match": '"stale"'}, status=200)


def test_the_page_has_no_inline_script_or_style():
    html = (STATIC / "index.html").read_text()
    assert re.findall(r"<script[^>]*>", html) == ['<script src="/ui/app.js" defer>']
    assert "<style" not in html and " style=" not in html
    assert not re.search(r"<[^>]+\son[a-z]+=", html)


def test_the_script_builds_nodes_never_html_from_text():
    js = (STATIC / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js


def test_unknown_files_and_other_methods_are_4xx_in_the_envelope(client):
    r = client.get("/ui/secret.py", status=404)
    assert r.json["error"]["code"] == "not_found"
    client.get("/ui/../app.py", status=404)
    client.get("/ui/index.html", status=404)
    r = client.post("/", status=405)
    assert r.json["error"]["code"] == "method_not_allowed" and r.headers["Allow"] == "GET, HEAD"


def test_web_ui_off_leaves_root_unknown(make_harness):
    client = make_harness(web_ui=False).client()
    r = client.get("/", status=404)
    assert r.json["error"]["message"] == "Unknown route: GET /"
    client.get("/ui/app.js", status=404)


def test_web_ui_setting_reads_from_the_environment():
    assert Config.from_env({"TURBOSPARK_WEB_UI": "0"}).web_ui is False
    assert Config.from_env({}).web_ui is True


def test_with_api_keys_the_page_loads_without_one_but_the_api_does_not(make_harness):
    client = make_harness(api_keys=("sk-page-test",)).client()
    for path in ("/", "/ui/app.js", "/ui/style.css", "/ui/favicon.svg"):
        client.get(path, status=200)
    client.get("/v1/models", status=401)
    client.get("/v1/models", headers={"Authorization": "Bearer sk-page-test"}, status=200)
