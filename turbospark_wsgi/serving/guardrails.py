"""Guardrails (TURBOSPARK_GUARDRAILS): input and output policies on the chat routes.

    policy = Guardrails.from_config(config)        # ConfigError naming the file's line when bad
    rules = policy.rules_for(digest, "/v1/chat/completions")    # a RuleSet, or None: nothing applies
    fired = rules.check_input(texts)               # Blocked (400 content_filter); redacts in place
    events = GuardedEvents(events, rules, ...)     # output: held back, redacted or cut while streaming

The file (TOML) holds `[[rules]]` (id, stage, match, patterns, action, optional keys and
max_length), an optional top-level `routes` list (default: the three chat routes; name
"/v1/completions" there to guard it too) and an optional `[keys.NAME]` table giving a key (by its
sha256, as the limits file does) its own rule set. `reload_all()` re-reads every file (SIGHUP); a
bad file keeps the previous policy.

NOTE(matching): every rule compares folded text: NFKC per character, case folded, format characters
(zero-width joiners and spaces, soft hyphens, bidi marks) dropped and each whitespace run one space.
Literals, and the literal prefix of each regex, go through one Aho-Corasick automaton
(pyahocorasick) per rule set; regexes through RE2 (google-re2), whose linear-time engine refuses
patterns that need backtracking. PII kinds are RE2
patterns plus a check (Luhn for cards, ISO 7064 mod 97 for IBANs, ranges for IPv4 and US SSNs).
"""
import functools
import logging
import re
import re._parser as sre_parse
import threading
import tomllib
import unicodedata
import weakref
from dataclasses import dataclass, field

import ahocorasick
import re2

from .. import metrics
from ..config import ConfigError
from ..errors import InvalidRequest

log = logging.getLogger("turbospark.guardrails")

STAGES = ("input", "output", "both")
MATCHES = ("literal", "regex", "pii")
ACTIONS = ("block", "redact")
CHAT_ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
ROUTES = CHAT_ROUTES + ("/v1/completions",)
RULE_FIELDS = ("id", "stage", "match", "patterns", "action", "keys", "max_length")
# NOTE(holdback): a regex whose matches have no bounded length is searched for matches of at most
# this many characters (its `max_length`), which is what a stream holds back for it
DEFAULT_MAX_LENGTH = 128
MAX_PATTERN_LENGTH = 1000
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_all = weakref.WeakSet()


def reload_all():
    """SIGHUP: every Guardrails of this process re-reads its file (a bad file keeps the old policy)."""
    for policy in list(_all):
        policy.reload()


class Blocked(InvalidRequest):
    """An input rule refused the request: 400 `content_filter` naming the rule (never the text)."""

    code = "content_filter"

    def __init__(self, rule_id, param):
        super().__init__(f"The request was refused by the server's guardrail rule '{rule_id}' ({param}).",
                         param=param)
        self.rule_id = rule_id


# ---------------------------------------------------------------------------------------- folding

@functools.lru_cache(maxsize=1 << 16)
def _fold_char(c):
    if c.isspace():
        return " "
    if unicodedata.category(c) == "Cf":
        return ""
    return unicodedata.normalize("NFKC", c).casefold()


_ASCII_SPACE = str.maketrans({c: " " for c in map(chr, range(128)) if c.isspace()})


class Folded:
    """Text folded for matching, grown by `feed`; `origin[p]` is the raw index folded char p came from."""

    __slots__ = ("chars", "origin", "raw_len")

    def __init__(self, text=""):
        self.chars, self.origin, self.raw_len = [], [], 0
        self.feed(text)

    def feed(self, text):
        chars, origin, base = self.chars, self.origin, self.raw_len
        if text.isascii():
            # NOTE(ascii): most chunks: lower case and one space per whitespace character, unless a run collapses
            low = text.lower().translate(_ASCII_SPACE)
            if "  " not in low and not (low[:1] == " " and chars and chars[-1] == " "):
                chars.extend(low)
                origin.extend(range(base, base + len(text)))
                self.raw_len = base + len(text)
                return
        for i, c in enumerate(text):
            out = _fold_char(c) if not c.isascii() or c.isspace() or c.isupper() else c
            if not out:
                continue
            if out == " " and chars and chars[-1] == " ":
                continue        # a whitespace run folds to one space
            for f in out:
                chars.append(f)
                origin.append(base + i)
        self.raw_len = base + len(text)

    def __len__(self):
        return len(self.chars)

    def text(self, start=0):
        return "".join(self.chars[start:])

    def raw_at(self, p):
        """The raw index where folded position `p` begins (the raw length past the end)."""
        return self.origin[p] if p < len(self.origin) else self.raw_len


def fold(text):
    return "".join(Folded(text).chars)


# ---------------------------------------------------------------------------------------- detectors

@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    stage: str
    match: str
    patterns: tuple
    action: str
    keys: frozenset | None = None       # sha256 hex digests; None: every key
    max_length: int = 0

    def applies(self, stage):
        return self.stage in (stage, "both")

    def label(self, kind=None):
        return kind if self.match == "pii" and kind else self.id


@dataclass(frozen=True, slots=True)
class Hit:
    start: int              # in the searched text
    end: int
    rule: Rule
    label: str              # what a redaction says: the PII kind, else the rule id


def _options():
    options = re2.Options()
    options.case_sensitive = False      # on folded text: a pattern's capitals match too
    options.log_errors = False
    options.max_mem = 8 << 20
    return options


class _Regex:
    """One regex (or PII kind) of a rule. `charset`: a character class (Python syntax) that every
    character of a match is in, or None; `prefix`: the folded literal every match starts with."""

    def __init__(self, rule, pattern, max_length, kind=None, check=None, charset=None, prefix=""):
        self.rule, self.kind, self._check, self.prefix = rule, kind, check, prefix
        self.pattern, self.max_length = pattern, max_length
        self._rx = re2.compile(pattern, _options())
        # NOTE(charset): matched on the reversed tail: the run of class characters the text ends with, in one scan
        self._run = re.compile(f"{charset}*", re.I) if charset else None

    def takes(self, text, start):
        """Whether every character of text[start:] is one a match may hold."""
        return self._run is None or self._run.fullmatch(text, start) is not None

    def find(self, text, pos):
        hits, n = [], len(text)
        while pos < n:
            m = self._rx.search(text, pos)
            if m is None:
                break
            start, end = m.start(), m.end()
            if end == start:
                pos = start + 1
                continue
            end = min(end, start + self.max_length)
            end = end if self._check is None else self._check(text, start, end)
            if end is not None:
                hits.append(Hit(start, end, self.rule, self.rule.label(self.kind)))
                pos = end
            else:
                pos = start + 1     # NOTE(overlap): a valid match may start inside a rejected one
        return hits

    def holdback(self, text):
        """How much of the end of `text` may be the start of a match still growing, for a regex
        with no literal prefix (_Detectors.scan reads those from its automaton): the run of the
        class's characters the text ends with, below max_length."""
        n = len(text)
        run = min(self.max_length - 1, n)
        if self._run is not None:
            run = self._run.match(text[n - run:][::-1]).end()
        return run


# ---- PII kinds: (pattern, check, the character class a match is made of, the longest match). A check gets
# the text and a match's span and returns the span's end that holds (a greedy match may have taken
# a group too many: a card's next number, an IBAN's next word) or None.

def _digits(s):
    return [int(c) for c in s if c.isdigit()]


def _bounded(text, start, end, inner=str.isdigit):
    """No digit (or `inner` character) right before or after the span: it is not part of a longer run."""
    return not (start > 0 and inner(text[start - 1])) and not (end < len(text) and inner(text[end]))


def _ends(text, start, end, keep):
    """The span's possible ends, longest first: after each character `keep` accepts."""
    return (e for e in range(end, start, -1) if keep(text[e - 1]))


def _luhn_ok(digits):
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d *= 2
            d -= 9 if d > 9 else 0
        total += d
    return total % 10 == 0


def _card(text, start, end):
    for e in _ends(text, start, end, str.isdigit):
        digits = _digits(text[start:e])
        if 13 <= len(digits) <= 19 and _bounded(text, start, e) and _luhn_ok(digits):
            return e
    return None


def _iban(text, start, end):
    for e in _ends(text, start, end, str.isalnum):
        s = text[start:e].replace(" ", "").upper()
        if 15 <= len(s) <= 34 and _bounded(text, start, e, str.isalnum):
            if int("".join(str(int(c, 36)) for c in s[4:] + s[:4])) % 97 == 1:
                return e
    return None


def _ipv4(text, start, end):
    before = text[start - 1] if start > 0 else ""
    after = text[end:end + 2]
    if before.isdigit() or before == "." or after[:1].isdigit() or (after[:1] == "." and after[1:].isdigit()):
        return None
    return end


def _ssn(text, start, end):
    d = "".join(str(x) for x in _digits(text[start:end]))
    area, group, serial = d[:3], d[3:5], d[5:]
    ok = area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"
    return end if ok and _bounded(text, start, end) else None


def _phone(text, start, end):
    for e in _ends(text, start, end, str.isdigit):
        if 10 <= len(_digits(text[start:e])) <= 15 and _bounded(text, start, e):
            return e
    return None


def _email(text, start, end):
    return None if start > 0 and (text[start - 1].isalnum() or text[start - 1] in "._%+-") else end


_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_SEP = r"[ .\-]?"
PII = {
    "email": (r"[a-z0-9._%+\-]{1,64}@[a-z0-9\-]{1,63}(?:\.[a-z0-9\-]{1,63}){0,6}\.[a-z]{2,24}", _email,
              r"[a-z0-9._%+@\-]", 320),
    "phone": (r"(?:\+[0-9]{1,3}" + _SEP + r")?(?:\([0-9]{1,4}\)" + _SEP + r"|[0-9]{2,4}[ .\-])"
              r"[0-9]{2,4}" + _SEP + r"[0-9]{2,4}(?:" + _SEP + r"[0-9]{2,4})?", _phone,
              r"[0-9 +().\-]", 24),
    "credit_card": (r"[0-9](?:[ \-]?[0-9]){12,18}", _card, r"[0-9 \-]", 38),
    "iban": (r"[a-z]{2}[0-9]{2}(?: ?[a-z0-9]){11,30}", _iban, None, 42),
    "ipv4": (r"(?:" + _OCTET + r"\.){3}" + _OCTET, _ipv4, r"[0-9.]", 15),
    "us_ssn": (r"[0-9]{3}[ \-][0-9]{2}[ \-][0-9]{4}", _ssn, r"[0-9 \-]", 11),
}


# NOTE(syntax): RE2 syntax that Python's parser would read as something else (POSIX classes,
# Unicode classes, \C, \Q...\E, \z): such a pattern gets no width, class or prefix from it
_RE2_ONLY = re.compile(r"\[:|\\[pPCQEz]")


def _parsed(pattern):
    if _RE2_ONLY.search(pattern):
        return None
    try:
        return sre_parse.parse(pattern)
    except (re.error, OverflowError, RecursionError, ValueError):
        return None


def regex_width(pattern):
    """The longest match of `pattern` when bounded, else None (also when Python cannot parse it)."""
    parsed = _parsed(pattern)
    if parsed is None:
        return None
    try:
        _, most = parsed.getwidth()
    except (re.error, OverflowError, RecursionError, ValueError):
        return None
    return most if most < sre_parse.MAXREPEAT else None


_CATEGORIES = {sre_parse.CATEGORY_DIGIT: r"\d", sre_parse.CATEGORY_SPACE: r"\s", sre_parse.CATEGORY_WORD: r"\w"}
_REPEATS = (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", None))


def regex_charset(pattern):
    """A character class (Python `re` syntax, to compile case-insensitive) holding every character
    a match of `pattern` can have, or None when it may hold any (a dot, a negated class) or Python
    cannot read the pattern."""
    parsed = _parsed(pattern)
    if parsed is None:
        return None
    parts = []

    def literal(code):
        parts.append(re.escape(chr(code)))

    def walk(items):
        for op, av in items:
            if op is sre_parse.LITERAL:
                literal(av)
            elif op is sre_parse.IN:
                for inner, value in av:
                    if inner is sre_parse.LITERAL:
                        literal(value)
                    elif inner is sre_parse.RANGE:
                        parts.append(f"{re.escape(chr(value[0]))}-{re.escape(chr(value[1]))}")
                    elif inner is sre_parse.CATEGORY and value in _CATEGORIES:
                        parts.append(_CATEGORIES[value])
                    else:
                        return False        # a negated class or category: almost any character
            elif op is sre_parse.BRANCH:
                if not all(walk(branch) for branch in av[1]):
                    return False
            elif op is sre_parse.SUBPATTERN:
                if not walk(av[-1]):
                    return False
            elif op in _REPEATS:
                if not walk(av[2]):
                    return False
            elif op is getattr(sre_parse, "ATOMIC_GROUP", None):
                if not walk(av):
                    return False
            elif op is not sre_parse.AT:
                return False                # a dot, a negated literal, a reference
        return True

    if not walk(parsed) or not parts:
        return None
    return "[" + "".join(dict.fromkeys(parts)) + "]"


def regex_prefix(pattern):
    """The literal text every match of `pattern` starts with, folded ("" when none is sure: a
    character whose case folding is not plain lowercase ends it)."""
    parsed = _parsed(pattern)
    out = []
    for op, av in parsed or ():
        if op is sre_parse.AT and not out:
            continue
        if op is not sre_parse.LITERAL:
            break
        c = chr(av)
        if not c.isascii() or c.isspace() and c != " ":
            break
        out.append(c.lower())
    return "".join(out)


class RuleSet:
    """The rules one request is under, compiled for each stage (`input`, `output`: _Detectors)."""

    def __init__(self, rules):
        self.rules = tuple(rules)
        self.input = _Detectors([r for r in self.rules if r.applies("input")])
        self.output = _Detectors([r for r in self.rules if r.applies("output")])

    def check_input(self, fields):
        """`fields`: [(param, text, set(new_text))]. Raises Blocked at the first block; redacts the
        rest in place; returns the [(rule id, action)] that fired."""
        fired = []
        for param, text, put in fields:
            if not text:
                continue
            folded = Folded(text)
            hits = select(self.input.find(folded.text(), 0))
            for hit in hits:
                if hit.rule.action == "block":
                    record(hit.rule, "input", "block")
                    raise Blocked(hit.rule.id, param)
            if hits:
                put(redact(text, folded, hits, 0, len(folded)))
                for hit in hits:
                    record(hit.rule, "input", "redact")
                    fired.append((hit.rule.id, "redact"))
        return unique(fired)

    def moderate(self, text):
        """The ids of the input rules that `text` matches (nothing is recorded: no action is taken)."""
        return {hit.rule.id for hit in self.input.find(fold(text), 0)}


class _Detectors:
    """The rules of one stage, compiled: `scan(text, pos)` -> (the hits starting at `pos` or later,
    how much of the end of `text` may still grow into a match).

    NOTE(cost): one Aho-Corasick automaton (pyahocorasick) holds every literal and every regex's
    literal prefix (the text each of its matches starts with); one pass over the text finds the
    literals, tells which prefixed regexes can match at all (only those run on RE2) and which may
    be growing at the end. Regexes without a prefix (the PII kinds among them) are screened by one
    RE2 set. So a token costs about the same for one rule as for hundreds."""

    def __init__(self, rules):
        self.rules = rules
        regexes = []
        for rule in rules:
            if rule.match == "regex":
                regexes += [_Regex(rule, p, rule.max_length, charset=regex_charset(p), prefix=regex_prefix(p))
                            for p in rule.patterns]
            elif rule.match == "pii":
                for kind in rule.patterns:
                    pattern, check, charset, longest = PII[kind]
                    regexes.append(_Regex(rule, pattern, longest, kind, check, charset))
        entries = {}
        for rule in rules:
            if rule.match == "literal":
                for pattern in rule.patterns:
                    word = fold(pattern)
                    entries.setdefault(word, []).append((rule, len(word)))
        for rx in regexes:
            if rx.prefix:
                entries.setdefault(rx.prefix, []).append((rx, len(rx.prefix)))
        self._auto = None
        if entries:
            self._auto = ahocorasick.Automaton()
            for word, found in entries.items():
                self._auto.add_word(word, tuple(found))
            self._auto.make_automaton()
        # NOTE(partial): a tail that is the start of a word, by its last character: the lengths to try
        ends = {}
        for word in entries:
            for k in range(1, len(word) + 1):
                ends.setdefault(word[k - 1], set()).add(k)
        self._partials = frozenset(w[:k] for w in entries for k in range(1, len(w) + 1))
        self._ends = {c: sorted(ks, reverse=True) for c, ks in ends.items()}
        self._free = [rx for rx in regexes if not rx.prefix]
        self._set = None
        if len(self._free) > 1:
            self._set = re2.Set.SearchSet(_options())
            for rx in self._free:
                self._set.Add(rx.pattern)
            self._set.Compile()

    def __bool__(self):
        return bool(self.rules)

    def find(self, text, pos):
        return self.scan(text, pos, final=True)[0]

    def scan(self, text, pos, final=False):
        n, hits, grow, gated = len(text), [], 0, {}
        if self._auto is not None and n:
            for end, found in self._auto.iter(text):
                for item, length in found:
                    start = end + 1 - length
                    if isinstance(item, Rule):
                        if start >= pos:
                            hits.append(Hit(start, end + 1, item, item.id))
                        continue
                    if start >= pos and item not in gated:
                        gated[item] = start
                    if not final and grow < n - start < item.max_length and item.takes(text, end + 1):
                        grow = n - start
        for rx, start in gated.items():
            hits += rx.find(text, start)
        free = self._free
        if self._set is not None:
            matched = self._set.Match(text) if pos < n else None
            free = [free[i] for i in sorted(matched)] if matched else ()
        for rx in free:
            hits += [h for h in rx.find(text, pos) if h.start >= pos]
        if final or not n:
            return hits, 0
        for k in self._ends.get(text[-1], ()):
            if k <= grow:
                break
            if k <= n and text[n - k:] in self._partials:
                grow = k
                break
        for rx in self._free:
            grow = max(grow, rx.holdback(text))
        return hits, grow


def select(hits):
    """Non-overlapping hits, leftmost first, the longest of those starting together; a block beats
    a redaction over the same text."""
    out, end = [], -1
    for hit in sorted(hits, key=lambda h: (h.start, h.rule.action != "block", -h.end)):
        if hit.start >= end:
            out.append(hit)
            end = hit.end
    return out


def redact(raw, folded, hits, start, stop, at=None, base=0):
    """The raw text of folded [start, stop) with each hit replaced by [REDACTED:label]; `at`: the
    raw index to start from instead of where folded `start` begins (what was sent before ends there:
    characters that fold to nothing at the end of a chunk are sent with it); `raw` may be the text
    from raw index `base` on."""
    parts, at = [], folded.raw_at(start) if at is None else at
    for hit in hits:
        parts.append(raw[at - base:folded.raw_at(hit.start) - base])
        parts.append(f"[REDACTED:{hit.label}]")
        at = folded.raw_at(hit.end)
    parts.append(raw[at - base:folded.raw_at(stop) - base])
    return "".join(parts)


def unique(fired):
    return list(dict.fromkeys(fired))


def record(rule, stage, action):
    metrics.record_guardrail(rule.id, stage, action)


# ---------------------------------------------------------------------------------------- the file

@dataclass(slots=True)
class Policy:
    """A guardrails file, parsed."""

    rules: tuple = ()
    routes: tuple = CHAT_ROUTES
    keys: dict = field(default_factory=dict)    # sha256 hex -> (name, rule ids)

    def rules_for(self, digest_hex, route):
        """The rules for a key (sha256 hex; None: no key) on `route`: those its [keys] table names,
        else those limited to no key; and in both cases those limited to keys that include it."""
        if route is not None and route not in self.routes:
            return ()
        named = self.keys.get(digest_hex) if digest_hex else None
        if named is not None:
            return tuple(r for r in self.rules if r.id in named[1] or (r.keys and digest_hex in r.keys))
        return tuple(r for r in self.rules if r.keys is None or (digest_hex and digest_hex in r.keys))


def _lines(raw, header):
    """Line numbers (1-based) of each `[[rules]]` or `[keys.X]` header, in order."""
    rx = re.compile(header, re.M)
    return [raw.count("\n", 0, m.start()) + 1 for m in rx.finditer(raw)]


def read_policy(path):
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"TURBOSPARK_GUARDRAILS cannot be read: {e.strerror} ({path})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"TURBOSPARK_GUARDRAILS is not UTF-8: {e} ({path})") from None
    return parse_policy(raw, path)


def parse_policy(raw, source="guardrails"):
    """A Policy from the file's TOML text; ConfigError naming the line of what is wrong."""
    try:
        data = tomllib.loads(raw)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    unknown = sorted(set(data) - {"rules", "routes", "keys"})
    if unknown:
        raise ConfigError(f"{source}: unknown setting {unknown[0]!r} (known: rules, routes, keys)")
    rule_lines = _lines(raw, r"^[ \t]*\[\[\s*rules\s*\]\]")
    entries = data.get("rules", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: 'rules' must be an array of tables ([[rules]])")
    rules, ids = [], {}
    for i, entry in enumerate(entries):
        line = rule_lines[i] if i < len(rule_lines) else None
        where = f"{source} line {line}" if line else f"{source} rules[{i}]"
        rule = _rule(entry, where)
        if rule.id in ids:
            raise ConfigError(f"{where}: rule id {rule.id!r} is also the id of the rule at {ids[rule.id]}")
        ids[rule.id] = where.removeprefix(f"{source} ")
        rules.append(rule)
    routes = data.get("routes", list(CHAT_ROUTES))
    if not isinstance(routes, list) or not routes or any(r not in ROUTES for r in routes):
        raise ConfigError(f"{source}: 'routes' must list some of {', '.join(ROUTES)}, got {routes!r}")
    keys = _keys(data.get("keys", {}), ids, raw, source)
    return Policy(tuple(rules), tuple(routes), keys)


def _rule(entry, where):
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: a rule must be a table")
    unknown = sorted(set(entry) - set(RULE_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown rule setting {unknown[0]!r} (known: {', '.join(RULE_FIELDS)})")
    rid = entry.get("id")
    if not isinstance(rid, str) or not _ID.fullmatch(rid):
        raise ConfigError(f"{where}: 'id' must be 1-64 letters, digits or _.:- , got {rid!r}")
    where = f"{where} (rule {rid!r})"
    stage = _choice(entry, "stage", STAGES, where, "both")
    match = _choice(entry, "match", MATCHES, where)
    action = _choice(entry, "action", ACTIONS, where)
    patterns = entry.get("patterns")
    if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError(f"{where}: 'patterns' must be a non-empty array of non-empty strings")
    too_long = next((p for p in patterns if len(p) > MAX_PATTERN_LENGTH), None)
    if too_long is not None:
        raise ConfigError(f"{where}: a pattern is over {MAX_PATTERN_LENGTH} characters ({too_long[:40]!r}...)")
    keys = entry.get("keys")
    if keys is not None:
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and _DIGEST.fullmatch(k.lower())
                                                              for k in keys):
            raise ConfigError(f"{where}: 'keys' must list API keys by their sha256 (64 hex digits); keys are "
                              f"never written in plain text")
        keys = frozenset(k.lower() for k in keys)
    max_length = entry.get("max_length", 0)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or not 0 <= max_length <= 4096:
        raise ConfigError(f"{where}: 'max_length' must be a whole number of characters 1-4096")
    if match == "pii":
        bad = next((p for p in patterns if p not in PII), None)
        if bad is not None:
            raise ConfigError(f"{where}: unknown PII kind {bad!r} (known: {', '.join(PII)})")
    elif match == "regex":
        max_length = _regex_length(patterns, max_length, where)
    elif any(not fold(p).strip() for p in patterns):
        raise ConfigError(f"{where}: a literal is empty once folded (only spaces or format characters)")
    return Rule(rid, stage, match, tuple(patterns), action, keys, max_length)


def _regex_length(patterns, max_length, where):
    widths = []
    for p in patterns:
        try:
            compiled = re2.compile(p, _options())
        except re2.error as e:
            reason = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
            raise ConfigError(f"{where}: pattern {p!r} is refused by the linear-time regex engine (RE2: {reason}); "
                              f"backreferences and lookaround need backtracking, which is not allowed") from None
        if compiled.search(""):
            raise ConfigError(f"{where}: pattern {p!r} matches the empty string")
        widths.append(regex_width(p))
    if max_length:
        return max_length
    if any(w is None for w in widths):
        return DEFAULT_MAX_LENGTH
    return max(widths)


def _choice(entry, name, allowed, where, default=None):
    value = entry.get(name, default)
    if value not in allowed:
        raise ConfigError(f"{where}: {name!r} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _keys(table, ids, raw, source):
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: 'keys' must be a table ([keys.NAME])")
    lines = dict(zip(re.findall(r"^[ \t]*\[\s*keys\.([^\]]+?)\s*\]", raw, re.M), _lines(raw, r"^[ \t]*\[\s*keys\.")))
    keys = {}
    for name, entry in table.items():
        line = lines.get(name) or lines.get(f'"{name}"')
        where = f"{source} line {line}" if line else f"{source} [keys.{name}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: [keys.{name}] must be a table")
        unknown = sorted(set(entry) - {"sha256", "rules"})
        if unknown:
            raise ConfigError(f"{where}: unknown setting {unknown[0]!r} (known: sha256, rules)")
        digest = str(entry.get("sha256", name if _DIGEST.fullmatch(name.lower()) else "")).lower()
        if not _DIGEST.fullmatch(digest):
            raise ConfigError(f"{where}: give the key's sha256 (64 hex digits) as 'sha256', or use it as the "
                              f"table's name; keys are never written in plain text")
        rules = entry.get("rules")
        if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
            raise ConfigError(f"{where}: 'rules' must list rule ids (an empty list: no rules for this key)")
        missing = next((r for r in rules if r not in ids), None)
        if missing is not None:
            raise ConfigError(f"{where}: no rule has the id {missing!r}")
        keys[digest] = (name, tuple(rules))
    return keys


class Guardrails:
    """The guardrails of one server process: the file's policy, compiled per set of rules."""

    def __init__(self, path="", policy=None):
        self.path = path
        self.policy = policy if policy is not None else (read_policy(path) if path else Policy())
        self._compiled, self._lock = {}, threading.Lock()
        _all.add(self)

    @classmethod
    def from_config(cls, config):
        return cls(config.guardrails)

    @property
    def routes(self):
        return self.policy.routes if self.policy.rules else ()

    def reload(self):
        if not self.path:
            return
        try:
            policy = read_policy(self.path)
        except ConfigError as e:
            log.error("guardrails not reloaded, the previous ones stay: %s", e)
            return
        with self._lock:
            self.policy, self._compiled = policy, {}
        log.info("guardrails reloaded from %s: %d rules", self.path, len(policy.rules))

    def rules_for(self, digest, route):
        """The RuleSet for a key with sha256 `digest` (bytes or None) on `route` (None: whatever the
        route, as /v1/moderations asks); None when no rule applies."""
        policy = self.policy
        rules = policy.rules_for(digest.hex() if digest else None, route)
        if not rules:
            return None
        with self._lock:
            found = self._compiled.get(rules)
            if found is None:
                found = self._compiled[rules] = RuleSet(rules)
            return found
