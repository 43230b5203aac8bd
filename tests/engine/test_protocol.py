"""engine/protocol.py: the real engine and encoder, and the suite's fake engine, have every member
the protocols name (nested ones too: tokenizer, config, template), methods with the same parameters."""
import inspect
import typing

from turbospark_wsgi.engine import load_engine, protocol
from turbospark_wsgi.engine.encoder import load_encoder


def _public(proto):
    return {n: v for n, v in vars(proto).items() if not n.startswith("_")}


def missing(obj, proto, where="engine"):
    """What `obj` lacks of `proto`, or has with other parameters, as readable lines."""
    out = []
    for name, kind in typing.get_type_hints(proto).items():
        if not hasattr(obj, name):
            out.append(f"{where}.{name}")
        elif isinstance(kind, type) and issubclass(kind, typing.Protocol) and kind is not proto:
            out += missing(getattr(obj, name), kind, f"{where}.{name}")
    for name, member in _public(proto).items():
        if not hasattr(obj, name):
            out.append(f"{where}.{name}")
        elif inspect.isfunction(member):
            want = list(inspect.signature(member).parameters.values())[1:]
            got = list(inspect.signature(getattr(obj, name)).parameters.values())
            if [(p.name, p.default) for p in got] != [(p.name, p.default) for p in want]:
                out.append(f"{where}.{name}{inspect.signature(getattr(obj, name))}")
    return out


def test_the_fake_engine_implements_the_whole_text_engine_protocol(harness):
    fake = harness.engine("fake")
    assert missing(fake, protocol.TextEngine) == []
    assert isinstance(fake, protocol.TextEngine) and fake.kind == "generation"


def test_the_engine_implements_the_text_engine_protocol(tiny_gguf):
    engine = load_engine(tiny_gguf().path, device="cpu")
    assert missing(engine, protocol.TextEngine) == []
    assert isinstance(engine, protocol.TextEngine) and engine.kind == "generation"


def test_the_engine_implements_the_embedding_engine_protocol_too(tiny_gguf):
    engine = load_engine(tiny_gguf().path, device="cpu")
    assert missing(engine, protocol.EmbeddingEngine) == []
    assert isinstance(engine, protocol.EmbeddingEngine) and engine.capabilities == ("generation", "embedding")


def test_the_fake_scores_as_the_engine_does_one_entry_per_prompt_token(harness):
    from turbospark_wsgi.engine import Finish, Scores
    events = list(harness.engine("fake").score([1, 70, 71, 72], top=2))
    entries = [e for ev in events if isinstance(ev, Scores) for e in ev.entries]
    assert entries[0] == (None, []) and len(entries) == 4 and all(len(top) == 2 for _, top in entries[1:])
    assert isinstance(events[-1], Finish) and events[-1].prompt_tokens == 4


def test_the_encoder_implements_the_embedding_engine_protocol(minilm_dir):
    encoder = load_encoder(str(minilm_dir))
    assert missing(encoder, protocol.EmbeddingEngine) == []
    assert isinstance(encoder, protocol.EmbeddingEngine) and encoder.kind == "embedding"
