"""Stop strings matched on text, with hold-back: no part of a stop string is ever released."""


class StopMatcher:
    def __init__(self, stops=()):
        self.stops = tuple(s for s in stops if s)
        self.buffer = ""

    def feed(self, text):
        """Adds text; returns (releasable text, matched stop string or None)."""
        if not self.stops:
            return text, None
        self.buffer += text
        hit = self._earliest_match()
        if hit is not None:
            at, stop = hit
            out, self.buffer = self.buffer[:at], ""
            return out, stop
        keep = self._held_suffix()
        cut = len(self.buffer) - keep
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, None

    def flush(self):
        out, self.buffer = self.buffer, ""
        return out

    def _earliest_match(self):
        found = [(self.buffer.find(s), s) for s in self.stops]
        found = [(at, s) for at, s in found if at >= 0]
        return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None

    def _held_suffix(self):
        # NOTE(holdback): the longest buffer suffix that is a proper prefix of some stop string.
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buffer)), best, -1):
                if self.buffer.endswith(s[:n]):
                    best = n
                    break
        return best
