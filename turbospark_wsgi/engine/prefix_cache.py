"""The prefix cache: slots, each a KV cache and the token ids whose K/V it holds, and which
leading ids a later prompt may reuse bit for bit. The scheduler owns the slots and alone changes them."""
from .model import SMALL_WINDOW


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Slot:
    """One KV cache and the token ids whose K/V it holds. The first `exact_len` ids hold K/V that a run
    without the cache would compute bit for bit, so a later prompt that starts with them reuses them,
    if it comes with the same `salt`.

    NOTE(salt): runs with different salts (API keys kept apart, or a request's cache_salt) never
    reuse each other's ids: a cache hit shortens the time to the first token, which would tell
    one client that another has sent the same prefix. A slot changing salts starts empty.

    Which ids are exact depends on the model. Where `model.decode_exact` (quantized products and
    fused attention on the CPU: every row computed on its own), every position, the reply's decode
    steps included. Else where `model.rows_exact`, every position of a prompt of more than
    SMALL_WINDOW tokens: such prompts run all their rows on the row-exact path, in any pieces
    (reused in whole tokens), while short prompts and decode steps run on few-row products whose
    bits differ. Otherwise only whole prefill chunks aligned to multiples of the chunk size."""

    __slots__ = ("cache", "ids", "exact_len", "busy", "used", "granule", "every_row", "salt", "background")

    def __init__(self, cache, granule, every_row=False):
        self.cache, self.ids, self.exact_len, self.busy, self.used = cache, [], 0, False, 0
        self.granule = granule      # 1 where any prefix is exact, else the prefill chunk (also
                                    # when chunks are short windows themselves)
        self.every_row = every_row  # short prompts and decode steps are exact too
        self.salt = ""
        self.background = False     # last held by a background run (a batch line): reused first

    def reusable(self, prompt, salt=None):
        """Leading ids of `prompt` this slot can give a run salted `salt` (None: the slot's own)."""
        if salt is not None and salt != self.salt:
            return 0
        # NOTE(prefix-cache): the last prompt token always runs, so there are logits to sample from
        n = min(common_prefix(self.ids, prompt), self.exact_len, len(prompt) - 1)
        return n - n % self.granule

    def keep(self, n):
        self.cache.truncate(n)
        del self.ids[n:]
        self.exact_len = min(self.exact_len, n)

    def forget(self):
        self.keep(0)

    def take_prefix(self, donor, n):
        """Holds donor's first n ids (n <= donor.reusable of them) and their K/V, copied: the bits a
        prefill of them gives, as both slots' exact ids are."""
        self.cache.copy_prefix(donor.cache, n)
        self.ids, self.exact_len = list(donor.ids[:n]), n

    def claim(self, salt):
        """Takes the slot for a run salted `salt`: another salt's ids are forgotten."""
        if salt != self.salt:
            self.forget()
            self.salt = salt

    def pieces(self, prompt, chunk):
        """The next prompt piece to run after the held ids, and whether it runs row-exact."""
        start, n = len(self.ids), len(prompt)
        if self.granule > 1:                                            # whole aligned chunks
            return prompt[start:start - start % chunk + chunk], False
        end = start + chunk if n - (start + chunk) > SMALL_WINDOW else n   # no short tail call
        return prompt[start:end], n > SMALL_WINDOW or self.every_row

    def decoded(self, token):
        """Records that a decode step put `token`'s K/V at the next position."""
        self.ids.append(token)
        if self.every_row and self.exact_len == len(self.ids) - 1:
            self.exact_len = len(self.ids)

    def prefill(self, model, piece, logits, row_exact, adapter=None):
        """Runs prompt tokens `piece` after the held ones, on the row-exact path if `row_exact`, with
        LoRA `adapter` (or none), and extends the exact prefix where the piece keeps it exact."""
        stays_exact = self.exact_len == len(self.ids) and (
            row_exact if self.granule == 1 else len(piece) == self.granule)
        kw = {} if adapter is None else {"adapter": adapter}        # a draft or device model takes none
        out = model.forward(piece, self.cache, logits=logits, row_exact=row_exact, **kw)
        self.ids.extend(piece)
        if stays_exact:
            self.exact_len = len(self.ids)
        return out


def copy_shared_prefix(slot, slots, prompt, salt):
    """NOTE(copied-prefix): where another of `slots` (free or busy) holds a longer reusable prefix of
    `prompt` under `salt` than `slot` does (NOTE(related) kept the run off it, or it is busy), `slot`
    takes a copy of those positions' K/V: a copy of a few hundred KB where a prefill would compute
    every row again, and the other slot keeps its own ids. A shared system prompt or the fixed start
    of a prompt family costs its prefill once. Runs on the compute thread, as every slot change does."""
    n, donor = max(((s.reusable(prompt, salt), s) for s in slots if s is not slot), key=lambda c: c[0],
                   default=(0, None))
    if n > slot.reusable(prompt, salt):
        slot.take_prefix(donor, n)
