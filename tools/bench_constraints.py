"""Cost of constrained decoding per token: the grammar mask (llguidance) and the sampler's masking,
against the model's own decode step.

    python tools/bench_constraints.py [--model PATH] [--tokens 64] [--repeats 5] [--device cpu]

For one JSON schema it generates --tokens tokens with the constraint (temperature 0.8, fixed seed),
(interleaved with unconstrained runs), then replays the same tokens to time, per token: `allowed_mask()` (mask fill + unpack to bool[V]),
`advance()`, and the sampler's `np.where` masking. It also times a plain decode step. Medians in ms.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.engine import SamplingParams, Token, load_engine  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402

DEFAULT_MODEL = str(default_model_path())
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "address"], "properties": {
    "name": {"type": "string", "maxLength": 40}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                    "pattern": "^[0-9]{5}$"}}}}}
GRAMMAR = {"grammars": [{"json_schema": {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}}]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t) * 1e3


def generate(engine, prompt, grammar, n):
    params = SamplingParams(max_new_tokens=n, temperature=0.8, seed=0, ignore_eos=False)
    start, ids, times = None, [], []
    for event in engine.generate(prompt, params, constraint=grammar.start() if grammar else None):
        now = time.perf_counter()
        if isinstance(event, Token):
            if start is not None:
                times.append((now - start) * 1e3)
            ids.append(event.id)
        start = now
    return ids, times


def replay(engine, grammar, ids, vocab):
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    c = grammar.start()
    mask_ms, advance_ms, where_ms = [], [], []
    for token in ids:
        mask, t = timed(c.allowed_mask)
        mask_ms.append(t)
        where_ms.append(timed(np.where, mask, logits, -np.inf)[1])
        advance_ms.append(timed(c.advance, token)[1])
    return mask_ms, advance_ms, where_ms


def main(argv=None):
    args = parse_args(argv)
    engine = load_engine(args.model, device=args.device)
    t = time.perf_counter()
    grammar = engine.compile_grammar(GRAMMAR)
    first_compile = (time.perf_counter() - t) * 1e3
    compile_ms = [timed(engine.compile_grammar, GRAMMAR)[1] for _ in range(args.repeats)]
    prompt = engine.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    ids, constrained, plain = None, [], []
    for _ in range(args.repeats):     # interleaved, so a busy neighbour hurts both alike
        out, times = generate(engine, prompt, grammar, args.tokens)
        ids, constrained = ids or out, constrained + times
        plain += generate(engine, prompt, None, args.tokens)[1]
    mask, advance, where = [], [], []
    for _ in range(args.repeats):
        m, a, w = replay(engine, grammar, ids, engine.config.vocab_size)
        mask, advance, where = mask + m, advance + a, where + w
    med = statistics.median
    print(f"model {os.path.basename(args.model)}  vocab {engine.config.vocab_size}  backend {engine.backend}")
    print(f"compile: first {first_compile:.0f} ms (builds the tokenizer tables), then {med(compile_ms):.2f} ms")
    print(f"per token (median over {len(mask)}): mask {med(mask):.3f} ms, advance {med(advance):.3f} ms, "
          f"np.where {med(where):.3f} ms; p90 mask {np.percentile(mask, 90):.3f} ms")
    print(f"decode step: plain {med(plain):.2f} ms, constrained {med(constrained):.2f} ms "
          f"(ratio {med(constrained) / med(plain):.3f}); output: {engine.decode(ids)!r}")


if __name__ == "__main__":
    main()
