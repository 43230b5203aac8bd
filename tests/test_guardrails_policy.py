"""The guardrails file and its matchers, without HTTP: a bad file is refused naming its line (and a
regex that needs backtracking is refused by RE2), each PII kind finds what it should and nothing
that only looks like it, and a stream split at any point gives what the whole text gives."""
import hashlib
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbospark_wsgi.config import ConfigError
from turbospark_wsgi.serving.guarded import _Choice
from turbospark_wsgi.serving.guardrails import (Guardrails, RuleSet, fold, parse_policy, regex_charset,
                                                regex_prefix, regex_width)

GOOD = """
[[rules]]
id = "codename"
match = "literal"
patterns = ["nightingale"]
action = "block"
"""


def rule(**fields):
    body = {"id": '"r"', "match": '"literal"', "patterns": '["x"]', "action": '"block"'}
    body.update(fields)
    return "\n\n# a comment\n[[rules]]\n" + "".join(f"{k} = {v}\n" for k, v in body.items() if v is not None)


@pytest.mark.parametrize("text, says", [
    (rule(stage='"sideways"'), "'stage' must be one of input, output, both"),
    (rule(match='"glob"'), "'match' must be one of literal, regex, pii"),
    (rule(action='"warn"'), "'action' must be one of block, redact"),
    (rule(patterns="[]"), "'patterns' must be a non-empty array"),
    (rule(patterns='[""]'), "'patterns' must be a non-empty array"),
    (rule(patterns='["\u200b "]'), "empty once folded"),
    (rule(colour='"red"'), "unknown rule setting 'colour'"),
    (rule(id='"has space"'), "'id' must be 1-64 letters"),
    (rule(id=None), "'id' must be"),
    (rule(match='"pii"', patterns='["passport"]'), "unknown PII kind 'passport'"),
    (rule(match='"regex"', patterns=r"['(a)\1']"), "need backtracking"),
    (rule(match='"regex"', patterns="['foo(?=bar)']"), "need backtracking"),
    (rule(match='"regex"', patterns="['(unclosed']"), "refused by the linear-time regex engine"),
    (rule(match='"regex"', patterns="['a*']"), "matches the empty string"),
    (rule(keys='["sk-plain-text"]'), "sha256 (64 hex digits)"),
    (rule(max_length="-3"), "'max_length' must be a whole number"),
])
def test_a_bad_rule_is_refused_naming_its_line(text, says):
    with pytest.raises(ConfigError) as e:
        parse_policy(GOOD + text, "g.toml")
    assert says in str(e.value)
    assert "g.toml line 10" in str(e.value)          # the second [[rules]] header


@pytest.mark.parametrize("text, says", [
    ("rules = 3", "'rules' must be an array of tables"),
    ('colour = "red"', "unknown setting 'colour'"),
    ('routes = ["/v1/embeddings"]', "'routes' must list some of"),
    ("[[rules]\n", "not valid TOML"),
])
def test_a_bad_file_is_refused(text, says):
    with pytest.raises(ConfigError, match=says):
        parse_policy(text)


def test_duplicate_ids_name_both_lines():
    with pytest.raises(ConfigError) as e:
        parse_policy(GOOD + rule(id='"codename"'), "g.toml")
    assert "g.toml line 10" in str(e.value) and "line 2" in str(e.value)


def test_the_keys_table_is_checked():
    digest = hashlib.sha256(b"sk-1").hexdigest()
    policy = parse_policy(GOOD + f'\n[keys.alice]\nsha256 = "{digest}"\nrules = []\n')
    assert policy.keys[digest] == ("alice", ())
    assert policy.rules_for(digest, "/v1/chat/completions") == ()
    assert [r.id for r in policy.rules_for(None, "/v1/chat/completions")] == ["codename"]
    assert policy.rules_for(None, "/v1/completions") == ()          # not listed in routes
    for bad, says in [('rules = ["nope"]', "no rule has the id 'nope'"),
                      ('sha256 = "sk-1"\nrules = []', "give the key's sha256"),
                      ('rules = []\nextra = 1', "unknown setting 'extra'")]:
        body = bad if "sha256" in bad else f'sha256 = "{digest}"\n{bad}'
        with pytest.raises(ConfigError, match=says) as e:
            parse_policy(GOOD + f"\n[keys.alice]\n{body}\n", "g.toml")
        assert "g.toml line 8" in str(e.value)


def test_a_missing_or_binary_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        Guardrails(str(tmp_path / "nope.toml"))
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[[rules]]")
    with pytest.raises(ConfigError, match="not UTF-8"):
        Guardrails(str(tmp_path / "bin.toml"))


def test_a_bad_file_stops_the_server_at_start(make_harness, tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(GOOD + rule(match='"regex"', patterns=r"['(a)\1']"))
    with pytest.raises(ConfigError, match="line 10.*need backtracking"):
        make_harness(guardrails=str(path))


def test_regex_width_class_and_prefix():
    assert regex_width("launch code [0-9]{4}") == 16
    assert regex_width("sk-[a-z]+") is None
    assert regex_width("[[:alpha:]]{3}") is None         # RE2's own syntax: not read by Python's parser
    cls = re.compile(regex_charset("SK-[a-z0-9]{8,}") + "+", re.I)
    assert cls.fullmatch("sk-abcz09") and not cls.match(" ") and not cls.match("!")
    assert regex_charset("a.b") is None and regex_charset("[^x]+") is None and regex_charset(r"\pL+") is None
    assert regex_prefix("SK-live-[a-z]+") == "sk-live-" and regex_prefix("ab?c") == "a"
    assert regex_prefix("(?:ab|cd)[0-9]") == "" and regex_prefix("^order #[0-9]") == "order #"


@pytest.mark.parametrize("text, held", [
    ("the key is sk-li", len("sk-li")), ("the key is sk-live-abc1", len("sk-live-abc1")),
    ("the key is s", 1), ("the key is sky", 0), ("a plain sentence ", 0), ("sk-live-abc1 done.", 0),
])
def test_a_regex_holds_back_only_what_may_start_a_match(text, held):
    rules = RuleSet(parse_policy(rule(match='"regex"', patterns="['sk-live-[a-z0-9]{8,}']", action='"redact"')).rules)
    assert rules.output.scan(text, 0)[1] == held


# ---- PII kinds: each finds its own and leaves look-alikes ------------------------------------------

PII_CASES = {
    "email": (["write to ann.lee+tag@example.co.uk today", "A@B.IO"],
              ["user@localhost", "at @example.com", "a@b.c"]),
    "phone": (["call +1 415 555 0123 now", "(020) 7946 0958", "415-555-0123"],
              ["version 1.2.3", "year 2024", "12 34"]),
    "credit_card": (["card 4111 1111 1111 1111.", "5500-0000-0000-0004", "378282246310005"],
                    ["4111 1111 1111 1112", "order 1234567890123", "41111111111111111111111"]),
    "iban": (["IBAN GB82 WEST 1234 5698 7654 32 please", "de89370400440532013000"],
             ["GB82 WEST 1234 5698 7654 33", "AB12 hello world"]),
    "ipv4": (["host 192.168.0.1 up", "10.0.0.255"],
             ["256.1.1.1", "1.2.3", "version 1.2.3.4.5", "01234.1.1.1"]),
    "us_ssn": (["ssn 123-45-6789", "123 45 6789"],
               ["000-12-3456", "666-12-3456", "923-45-6789", "123-00-4567", "123-45-0000", "1123-45-6789"]),
}


def pii(kind):
    return RuleSet(parse_policy(rule(id=f'"{kind}"', match='"pii"', patterns=f'["{kind}"]',
                                     action='"redact"')).rules)


@pytest.mark.parametrize("kind", sorted(PII_CASES))
def test_each_pii_kind(kind):
    rules = pii(kind)
    found, missed = PII_CASES[kind]
    for text in found:
        assert rules.moderate(text) == {kind}, text
        fields = [("p", text, lambda new: out.append(new))]
        out = []
        rules.check_input(fields)
        assert out and f"[REDACTED:{kind}]" in out[0], (text, out)
    for text in missed:
        assert rules.moderate(text) == set(), text


def test_a_card_beside_other_digits_keeps_the_other_digits():
    out = []
    pii("credit_card").check_input([("p", "4111 1111 1111 1111 2024", out.append)])
    assert out == ["[REDACTED:credit_card] 2024"]


# ---- streams: split anywhere, the same text comes out --------------------------------------------

STREAM_POLICY = """
[[rules]]
id = "codename"
stage = "output"
match = "literal"
patterns = ["project nightingale"]
action = "block"

[[rules]]
id = "keys"
stage = "output"
match = "regex"
patterns = ['sk-live-[a-z0-9]{8,}']
action = "redact"

[[rules]]
id = "pii"
stage = "output"
match = "pii"
patterns = ["credit_card", "email"]
action = "redact"
"""


def run(rules, pieces):
    choice, out, block = _Choice(rules.output), [], None
    for i, piece in enumerate(pieces):
        text, _, block = choice.feed(piece, None, final=i == len(pieces) - 1)
        out.append(text)
        if block is not None:
            break
    return "".join(out), block and block.rule.id


@pytest.mark.parametrize("text", [
    "Try sk-live-abc123xyz9 and mail b\u00f6b@example.com or 4111-1111-1111-1111 \u2014 done.",
    "The \uff30\uff32\uff2f\uff2a\uff25\uff23\uff34 night\u00adingale plan, and sk-live-zzzzzzzz9 \u00e9t\u00e9.",
    "Nothing here but caf\u00e9 and na\u00efve \u65e5\u672c\u8a9e text.",
])
def test_a_stream_split_anywhere_gives_what_the_whole_text_gives(text):
    rules = RuleSet(parse_policy(STREAM_POLICY).rules)
    whole = run(rules, [text])
    assert "sk-live-abc" not in whole[0] and "4111" not in whole[0] and "nightingale" not in fold(whole[0])
    for cut in range(1, len(text)):
        assert run(rules, [text[:cut], text[cut:]]) == whole, cut
    assert run(rules, list(text)) == whole


PIECES = ["sk-", "live-", "abc123", "9", " ", "project", " nightingale", "\u200d", "\uff30", "4111", "-1111",
          " 1111", "@", "b.com", "mail", "x", ".", "\u00e9", "\n"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=40), st.data())
def test_any_stream_of_pieces_gives_what_the_whole_text_gives(pieces, data):
    rules = RuleSet(parse_policy(STREAM_POLICY).rules)
    text = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)]) if a < b]
    assert run(rules, chunks) == run(rules, [text])
