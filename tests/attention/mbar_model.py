"""The mbarrier of the synchronisation models (test_sm90_sync_model.py for the forward,
test_sm90_bwd_sync_model.py for the backward): an arrival count and a transaction count per
phase, and parity waits as try_wait.parity answers them; and the random interleaving of the
actors. Fail is any hazard a model finds."""


class Fail(Exception):
    pass


class MBar:
    def __init__(self, name, count, negative_tx=False):
        self.name, self.count, self.pending, self.tx, self.phase = name, count, count, 0, 0
        # A multicast pair's full barriers: the other CTA's half of a tile may land before this
        # CTA's own expect_tx (the hardware's transaction count goes negative meanwhile).
        self.negative_tx = negative_tx

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, n=1):
        if n > self.pending:
            raise Fail(f"{self.name}: {n} arrivals > {self.pending} pending")
        self.pending -= n
        self._maybe_complete()

    def expect_tx(self, units):  # mbarrier.arrive.expect_tx
        self.tx += units
        self.arrive(1)

    def complete_tx(self, units):
        self.tx -= units
        if self.tx < 0 and not self.negative_tx:
            raise Fail(f"{self.name}: tx < 0")
        self._maybe_complete()

    def done(self, parity):  # try_wait.parity: the phase of that parity has completed
        return (self.phase & 1) != parity


def interleave(actors, events, rng, max_steps, speed=None):
    """Runs the actors (generators that yield the condition they wait for) and the pending
    asynchronous completions (events: callables, which may append more) in a random order until
    all are done: a deadlock (nothing can move) or max_steps steps raise Fail. speed: optional
    relative weights of the actors by name and of the events ("e")."""
    conds = {k: (lambda: True) for k in actors}
    steps = 0
    while actors or events:
        steps += 1
        if steps > max_steps:
            raise Fail("too many steps")
        choices = [("a", k) for k in actors if conds[k]()]
        choices += [("e", i) for i in range(len(events))]
        if not choices:
            raise Fail(f"DEADLOCK: blocked {sorted(actors)}")
        if speed is None:
            kind, x = rng.choice(choices)
        else:
            kind, x = rng.choices(choices, [speed[x if k == "a" else "e"] for k, x in choices])[0]
        if kind == "e":
            events.pop(x)()
            continue
        try:
            conds[x] = next(actors[x])
        except StopIteration:
            del actors[x], conds[x]
