"""The mbarrier of the synchronisation models (test_sm90_sync_model.py for the forward,
test_sm90_bwd_sync_model.py for the backward): an arrival count and a transaction count per
phase, and parity waits as try_wait.parity answers them. Fail is any hazard a model finds."""


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
