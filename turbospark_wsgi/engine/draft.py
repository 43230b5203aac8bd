"""Draft-model proposals (TURBOSPARK_DRAFT_MODEL): a smaller model with the same tokenizer writes
the next tokens of each proposing sequence, greedily, one batched decode step per token; the
target model then checks them like any proposal (speculative.py: exact).

NOTE(draft-greedy): the draft proposes its argmax, one token, not a distribution, so the check is
the same rule as for prompt lookup and a seed gives the target's own tokens. (vLLM and llama.cpp
also accept a sampled draft by min(1, p/q); that keeps more tokens at high temperatures, but the
same seed no longer gives the same tokens.)
"""
import numpy as np

from .prefix_cache import common_prefix

# PERF(draft): a sequence's draft cache catches up on the prompt in pieces of this many tokens
CATCH_UP = 128


def load_draft(path, options, target_tokenizer, target_model):
    """A Draft for the target from the model at `path` (ValueError when its tokenizer differs)."""
    from .loader import load_model
    from .tokenizer import Tokenizer
    loaded = load_model(path, options)
    tokenizer = (Tokenizer.from_gguf_metadata(loaded.metadata) if loaded.kind == "gguf"
                 else Tokenizer.from_hf_dir(path))
    if tokenizer.backend.get_vocab(with_added_tokens=True) != target_tokenizer.backend.get_vocab(with_added_tokens=True):
        raise ValueError("the draft model's tokenizer is not the model's own")
    return Draft(loaded.model, target_model.cfg.vocab_size, weight_bytes(loaded.model) / weight_bytes(target_model))


def weight_bytes(model):
    """Bytes of a model's layer products and head: what one decode step reads."""
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    return sum(getattr(getattr(lw, n), "nbytes", 0) for lw in model.w.layers for n in names) + model.w.head.nbytes


class Draft:
    """The draft model and, on each sequence (`seq.draft`), its own KV cache and the ids it holds."""

    def __init__(self, model, vocab_size, cost):
        self.model, self.vocab_size = model, vocab_size
        self.cost = cost            # one draft token, as a fraction of a target decode step

    def propose(self, seqs, counts):
        """counts[i] greedy draft tokens to follow seqs[i]'s pending token (lists; [] for 0)."""
        out = [[] for _ in seqs]
        live = [i for i, n in enumerate(counts) if n > 0]
        for i in live:
            out[i].append(self._catch_up(seqs[i]))
        for _ in range(1, max(counts, default=0)):
            rows = [i for i in live if len(out[i]) < counts[i]]
            if not rows:
                break
            logits = self.model.decode_batch([out[i][-1] for i in rows], [seqs[i].draft[0] for i in rows])
            for i, row in zip(rows, logits):
                seqs[i].draft[1].append(out[i][-1])
                out[i].append(int(np.argmax(row)))
        # NOTE(vocab): a draft's padded vocabulary may hold ids past the target's: such a proposal ends there
        return [p[:next((j for j, t in enumerate(p) if t >= self.vocab_size), len(p))] for p in out]

    def _catch_up(self, seq):
        """Brings the sequence's draft cache to its ids and pending token (keeping the common
        prefix, dropping proposals not kept); returns the draft's first token."""
        if seq.draft is None:
            seq.draft = (self.model.new_cache(seq.max_context), [])
        cache, ids = seq.draft
        want = seq.slot.ids + [seq.pending]
        keep = min(common_prefix(ids, want), len(want) - 1)
        cache.truncate(keep)
        del ids[keep:]
        while len(ids) < len(want):
            piece = want[len(ids):len(ids) + CATCH_UP]
            logits = self.model.forward(piece, cache, "last" if len(ids) + len(piece) == len(want) else "none")
            ids.extend(piece)
        return int(np.argmax(logits))
