"""How far the default (int8) CPU path is from the float32 path, beside llama.cpp on the same GGUF.

    python tools/accuracy.py [--model GGUF] [--llama-server URL] [--steps 48] [--json] [--kv-cache q8_0]
        [--float-products head,wqkv,wo,w_gate_up,w_down]

The float32 path (float kernels, dequantized weights' exact values) equals transformers to ~1e-4 on
every logit (tests/engine/test_parity_hf.py), so it is the reference. Measured against it:
- greedy first divergence: over PROMPTS (72; `--prompts N`: the first N), each path runs free `--steps` greedy tokens; the step
  at which it first leaves the reference's tokens (= steps when identical). Median, how many differ
  at the first token, how many are identical to the end;
- along a teacher-forced text (TEXT, the method of llama.cpp's `llama-perplexity --kl-divergence`):
  mean and 99th-percentile KL(reference || path) of the next-token distribution, top-1 agreement,
  and the perplexity of each.
With `--llama-server URL` (a running llama-server on the same GGUF) the same figures for it: greedy
through /completion at temperature 0, and the teacher-forced figures from its /completion top-N
probabilities at each position (n_probs; KL over the reference's top-N with the rest of each side's
mass as one bucket, a lower bound of the full KL). `--float-products` runs the named products of
our int8 path on the float kernels instead, to find where its error comes from.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.engine import load_engine  # noqa: E402
from turbospark_wsgi.engine.options import KV_CACHE  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The theory of relativity states that", "List three fruits:", "import numpy as np\n",
    "Dear Sir or Madam,", "Water boils at", "The best way to learn a new language is",
    "In 1969, the first humans", "SELECT name, age FROM users WHERE", "The mitochondria is",
    "Here is a haiku about autumn:\n", "To make a cup of tea, first", "The three primary colors are",
    "class Stack:\n    def __init__(self):", "The quick brown fox", "Photosynthesis is the process by which",
    "My favourite book is", "The stock market", "How do airplanes fly?", "Recipe for pancakes:\n1.",
    "The largest planet in the solar system is", "for i in range(10):\n    print(",
]
# NOTE(accuracy): a first-divergence median over 24 prompts is decided by a few near-ties (one
# attention rewrite moved it from 25 to 17.5 with the teacher-forced figures unchanged), so the
# default set adds 48 more; `--prompts 24` is the first set alone.
PROMPTS += [
    "The Great Wall of China was built", "A good night's sleep helps", "The speed of light is",
    "function add(a, b) {", "Shakespeare wrote", "The human heart has four", "Rain forms when",
    "The first step in solving a problem is", "Berlin is the capital of", "#include <stdio.h>\n",
    "The difference between weather and climate is", "An apple a day", "The recipe calls for two cups of",
    "In the year 2050, cities will", "Electric cars are", "The Pythagorean theorem says that",
    "She opened the door and saw", "git commit -m", "The ocean covers about", "A triangle has",
    "The moon orbits", "Vaccines work by", "Once the meeting ended, the team", "The Roman Empire fell",
    "To install the package, run", "The best thing about summer is", "Dogs are known for their",
    "The Eiffel Tower is located in", "Machine learning is a field of", "He picked up the guitar and",
    "The boiling point of water at sea level", "def is_prime(n):\n", "The weather today is",
    "In a small town in Italy,", "The ingredients for a salad are", "Mount Everest is the",
    "The author of Pride and Prejudice", "The sun rises in the", "CREATE TABLE orders (",
    "The most important lesson I learned", "The train left the station at", "Bees make honey by",
    "A computer's memory stores", "The Amazon river flows through", "Please write a short poem about the sea:\n",
    "The opposite of hot is", "My plan for the weekend is to", "The number pi is approximately",
]
TEXT = """The history of computing is longer than the history of computing hardware and modern computing
technology and includes the history of methods intended for pen and paper or for chalk and slate, with or
without the aid of tables. Digital computing is intimately tied to the representation of numbers. But long
before abstractions like the number arose, there were mathematical concepts to serve the purposes of
civilization. These concepts are implicit in concrete practices such as one-to-one correspondence, the basis
of counting, and comparison to a standard, used for measurement.

A recipe for bread needs only four things: flour, water, salt and yeast. Mix them, knead the dough for ten
minutes until it is smooth, let it rise for an hour in a warm place, shape it, let it rise again, and bake it
in a hot oven until the crust is brown and the loaf sounds hollow when tapped underneath.

def merge_sort(items):
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    merged = []
    while left and right:
        merged.append(left.pop(0) if left[0] <= right[0] else right.pop(0))
    return merged + left + right

The river rose slowly through the night. By morning the fields along the valley were under water, and the
farmers who had stayed moved their animals to the hills. Nobody in the village could remember a flood like
it; the oldest of them said that her grandmother had told of one, a hundred years before, when the bridge
was carried away and the church stood alone in a lake for a week.

Photosynthesis takes place mainly in the leaves of plants. Sunlight is absorbed by chlorophyll, and the
energy is used to split water into oxygen and hydrogen. The hydrogen is combined with carbon dioxide from
the air to make sugars, which the plant uses to grow or stores as starch. The oxygen is released through
small openings in the leaves called stomata, which also let carbon dioxide in and water vapour out.

Dear Ms Patel,
Thank you for your letter of 3 March. I am sorry to hear that the parcel arrived damaged. We have sent a
replacement by courier, and it should reach you within five working days. There is no need to return the
damaged item. If anything else is wrong with your order, please reply to this email or call our customer
service team on weekdays between nine and five.
Kind regards,
James Fletcher

class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n):
        return sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)[:n]

SELECT customers.name, COUNT(orders.id) AS total
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.name
ORDER BY total DESC
LIMIT 10;

The first bicycles had no pedals at all: riders pushed themselves along with their feet. Pedals were added
to the front wheel in the 1860s, and because each turn of the pedals turned the wheel once, makers built
front wheels larger and larger to go faster. These high-wheelers were dangerous, and the safety bicycle,
with two wheels of the same size and a chain driving the rear one, replaced them within a few years. Air
filled tyres followed soon after, and the basic shape of the bicycle has hardly changed since.

Q: What is the difference between a virus and a bacterium?
A: A bacterium is a single living cell that can grow and divide on its own. A virus is much smaller and is
not a cell: it is a piece of genetic material inside a protein coat, and it can only make copies of itself
inside the cells of another organism. Antibiotics can kill many bacteria but have no effect on viruses.
"""
PRODUCTS = ("wqkv", "wo", "w_gate_up", "w_down")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"the first N of the {len(PROMPTS)} prompts")
    p.add_argument("--llama-server", default="", help="URL of a llama-server on the same GGUF")
    p.add_argument("--n-probs", type=int, default=40, help="top-N probabilities asked of llama-server")
    p.add_argument("--float-products", default="", help=f"comma list of head,{','.join(PRODUCTS)}")
    p.add_argument("--kv-cache", default="auto", choices=KV_CACHE, help="our KV cache's numbers (TURBOSPARK_KV_CACHE)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def greedy(model, ids, steps):
    cache = model.new_cache(len(ids) + steps + 1)
    logits, out = model.forward(ids, cache), []
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], cache)
    return out


def divergence(ref, got):
    """The first step at which `got` leaves `ref` (len(ref) when it never does; a `got` that ends
    early leaves it where it ends)."""
    return next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))


def greedy_figures(steps_at):
    return {"median_first_divergence": statistics.median(steps_at),
            "first_token_differs": sum(s == 0 for s in steps_at),
            "identical": sum(s == STEPS for s in steps_at), "steps": steps_at}


def teacher_forced(ref_lp, lp, ids):
    """Mean/p99 KL(ref || lp), top-1 agreement and both perplexities at positions 0..T-2 (predicting ids[1:])."""
    kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1)
    nxt = np.asarray(ids[1:])
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "top1_agreement": float((ref_lp.argmax(-1) == lp.argmax(-1)).mean()),
            "ppl": float(np.exp(-lp[np.arange(len(nxt)), nxt].mean())),
            "ppl_reference": float(np.exp(-ref_lp[np.arange(len(nxt)), nxt].mean())), "positions": len(nxt)}


def llama_figures(url, prompts, ref_paths, ids, ref_lp, n_probs):
    """The greedy and teacher-forced figures of a llama-server at `url` (see the module docstring)."""
    import requests

    def completion(tokens, n, probs=0):
        # ignore_eos: the reference's greedy path runs through end tokens too
        body = {"prompt": tokens, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": True,
                "n_probs": probs, "samplers": ["top_k"], "return_tokens": True, "ignore_eos": True}
        r = requests.post(url.rstrip("/") + "/completion", json=body, timeout=300)
        r.raise_for_status()
        return r.json()
    steps_at = [divergence(ref, completion(p, STEPS)["tokens"][:STEPS]) for p, ref in zip(prompts, ref_paths)]
    kl, agree = [], []
    for t in range(1, len(ids)):
        top = completion(ids[:t], 1, n_probs)["completion_probabilities"][0]["top_logprobs"]
        theirs = {e["id"]: np.exp(e["logprob"]) for e in top}
        r = np.exp(ref_lp[t - 1])
        keys = np.argsort(-r)[:n_probs]
        p = np.append(r[keys], max(0.0, 1 - r[keys].sum()))
        q = np.array([theirs.get(int(k), 1e-10) for k in keys] + [0.0])
        q[-1] = max(1e-10, 1 - q[:-1].sum())
        p, q = np.maximum(p, 1e-30), np.maximum(q, 1e-30)
        kl.append(float((p * np.log(p / q)).sum()))
        agree.append(int(max(theirs, key=theirs.get)) == int(r.argmax()))
    return {"greedy": greedy_figures(steps_at),
            "teacher_forced": {"kl_mean_lower_bound": float(np.mean(kl)), "kl_p99_lower_bound": float(np.percentile(kl, 99)),
                               "top1_agreement": float(np.mean(agree)), "positions": len(kl)}}


def measure(args):
    global STEPS, PROMPTS
    STEPS = args.steps
    PROMPTS = PROMPTS[:max(1, args.prompts)]
    ref_engine = load_engine(args.model, device="cpu", activations="float32")
    ours = load_engine(args.model, device="cpu", kv_cache=args.kv_cache)
    model, ref = ours.model, ref_engine.model
    for name in filter(None, args.float_products.split(",")):
        targets = [ours.model.w.head] if name == "head" else [getattr(lw, name) for lw in model.w.layers]
        for t in targets:
            if hasattr(t, "activations"):                               # float32 weights are already float
                t.activations = "float32"
        model.plan = dataclasses.replace(model.plan, fused=False)     # the per-weight switch is step by step
    prompts = [ours.encode(p, add_bos=ours.add_bos) for p in PROMPTS]
    ref_paths = [greedy(ref, p, STEPS) for p in prompts]
    ids = ours.encode(TEXT, add_bos=ours.add_bos)
    ref_lp = log_softmax(ref.forward(ids, ref.new_cache(len(ids)), logits="all")[:-1])
    lp = log_softmax(model.forward(ids, model.new_cache(len(ids)), logits="all")[:-1])
    result = {"model": os.path.basename(args.model), "kernels": ours.kernels, "kv_cache": args.kv_cache,
              "float_products": args.float_products,
              "this_server": {"greedy": greedy_figures([divergence(r, greedy(model, p, STEPS))
                                                        for p, r in zip(prompts, ref_paths)]),
                              "teacher_forced": teacher_forced(ref_lp, lp, ids)}}
    if args.llama_server:
        result["llama_server"] = llama_figures(args.llama_server, prompts, ref_paths, ids, ref_lp, args.n_probs)
        # the same lower bound for this server, for a like-for-like comparison with llama-server's
        result["this_server"]["teacher_forced"]["kl_mean_lower_bound"] = _topn_kl(ref_lp, lp, args.n_probs)
    return result


def _topn_kl(ref_lp, lp, n):
    out = []
    for r, q in zip(np.exp(ref_lp), np.exp(lp)):
        keys = np.argsort(-r)[:n]
        a = np.maximum(np.append(r[keys], max(0.0, 1 - r[keys].sum())), 1e-30)
        b = np.maximum(np.append(q[keys], max(0.0, 1 - q[keys].sum())), 1e-30)
        out.append(float((a * np.log(a / b)).sum()))
    return float(np.mean(out))


def main(argv=None):
    args = parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return
    print(f"model {result['model']}; this server's kernels: {result['kernels']}")
    for who in ("this_server", "llama_server"):
        if who not in result:
            continue
        g, t = result[who]["greedy"], result[who]["teacher_forced"]
        print(f"{who:12} greedy first divergence median {g['median_first_divergence']} of {STEPS}, "
              f"first token differs {g['first_token_differs']}/{len(PROMPTS)}, identical {g['identical']}/{len(PROMPTS)}")
        print(f"{'':12} teacher-forced: " + ", ".join(f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in t.items()))


STEPS = 48

if __name__ == "__main__":
    main()
