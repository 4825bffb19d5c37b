"""A model of the persistent sm90 attention backward's synchronisation, run under random
interleavings (CPU only; the kernel itself needs a Hopper GPU).

The actors follow bwd_kernel_sm90 of csrc/attention/attention_bwd_kernel_sm90.cuh with kPersist
(every kernel but the deterministic mode's and the 80-query steps'): the TMA thread (producer),
the two consumer warpgroups (each as one actor: its 128 threads' arrivals on an mbarrier as one
count of 128, on a named barrier as one arrival), and an asynchronous engine that completes TMA
loads and TMA-store reads at random moments. Shared memory: two K/V buffers, each with its tile
slot, its full barrier bar_kv (count 1 + transaction bytes) and its empty barrier bar_kv_empty
(256 consumer threads); S = 2 Q/dO/statistics stages with bar_full (1 + bytes) and bar_empty
(256); two dS^T buffers, step it of a tile writing buffer it & 1, each warpgroup its 64 key rows.
Both schedules: lockstep (named barrier 1 after each step's dS^T writes) and lagged (kLag: step
it forms dQ_part(it - 1) from the buffer both filled a step before, through the "ready" and
"free" barriers of each warpgroup and buffer). The epilogue after named barrier 1: dK and dV
staged in the warpgroup's rows of the K and V buffer and stored by TMA (one thread waits for the
store's read before its arrival on bar_kv_empty), or stored from registers. With the
overlapped dQ conversion (p.dq_done) a counting thread of the producer warpgroup follows the
tiles too: per tile it waits for the buffer's full barrier, reads the slot, waits for dQ-full
barrier kb (every consumer thread arrives once its tile's dQ additions are issued), counts, and
arrives on bar_kv_empty (whose count then includes it).

Over random tile lists (tiles without keys, which the producer passes over; 0..6 steps) and
random relative speeds it checks: no deadlock; every mbarrier parity wait observes the phase it
is meant to (none overtaken); every read of a K/V buffer, stage or dS^T buffer sees the tile's or
step's data, fully landed and not being written; no TMA load into a buffer being read (by a wgmma
or a TMA store) or loading; no write into rows another product still reads; every slot read
holds the tile written for it; every count follows both warpgroups' dQ additions of its tile; no
warpgroup arrives twice on a named-barrier generation before it completes, and none is left
half-arrived at exit. A change to the kernel's barriers, counts or release points must be made
here too; the mutation tests show that the model catches the classic mistakes.
"""
import itertools
import random

import pytest
from mbar_model import Fail, MBar, interleave

S = 2  # TilesBwdSm90::kStages


def until(bar, parity, nth):
    """A parity wait meant to observe bar's completion nth (-1: the phase before the first,
    complete from the start); a barrier already past that completion (phase overtaken: the
    parity would match a later one) is a failure."""
    assert parity == nth & 1

    def cond():
        if bar.phase > nth + 1:
            raise Fail(f"{bar.name}: wait for completion {nth} overtaken (phase {bar.phase})")
        return bar.done(parity)
    return cond


class NBar:
    """A named barrier of 256 threads over the two consumer warpgroups (bar.arrive / bar.sync):
    a generation completes once both warpgroups have arrived or synced."""

    def __init__(self, name):
        self.name, self.arrived, self.gen = name, set(), 0

    def arrive(self, w):
        if w in self.arrived:
            raise Fail(f"{self.name}: warpgroup {w} arrives twice on generation {self.gen}")
        self.arrived.add(w)
        if len(self.arrived) == 2:
            self.arrived, self.gen = set(), self.gen + 1

    def sync(self, w):
        g0 = self.gen
        self.arrive(w)
        yield lambda: self.gen != g0


class Buf:
    """Shared-memory rows: what they hold (tag), a TMA load in flight, a write in progress and
    the reads (wgmma operands, TMA-store sources) in progress."""

    def __init__(self, name):
        self.name, self.tag, self.inflight, self.writing, self.readers = name, None, False, False, 0

    def _idle(self, what):
        if self.readers or self.inflight or self.writing:
            raise Fail(f"{what} {self.name}: readers={self.readers} loading={self.inflight} "
                       f"writing={self.writing}")

    def load(self, tag):
        self._idle("TMA load into")
        self.tag, self.inflight = tag, True

    def write_start(self):
        self._idle("write into")
        self.writing = True

    def write_end(self, tag):
        self.writing = False
        self._idle("end of write into")
        self.tag = tag

    def read_start(self, tag):  # tag None: any content (a product that is dropped, a store)
        if self.inflight or self.writing:
            raise Fail(f"read of {self.name}: loading={self.inflight} writing={self.writing}")
        if tag is not None and self.tag != tag:
            raise Fail(f"read of {self.name}: holds {self.tag}, {tag} expected")
        self.readers += 1
        return self


ANY = lambda: True  # noqa: E731  (a scheduling point)


def run(tiles, lagged, seed, count=False, bug=None, defer=False):
    """tiles: (has_keys, n_it, (registers epilogue of warpgroup 0, of 1)) in the order the TMA
    thread takes them; count: the counting thread (p.dq_done) runs; defer: the storing thread's
    wait for its dK/dV store and its arrival on bar_kv_empty come after the next tile's first
    S^T / dP^T are issued (or before that tile's epilogue, or at the exit; p.dkv_defer)."""
    rng = random.Random(seed)
    nkv = 1 if bug == "one_kv_buffer" else 2
    kv_full = [MBar(f"bar_kv{k}", 1) for k in range(2)]
    kv_empty = [MBar(f"bar_kv_empty{k}", 256 + (count and bug != "counter_not_counted"))
                for k in range(2)]
    dq_full = [MBar(f"bar_dq_full{k}", 256) for k in range(2)]
    added = set()  # (j, w): warpgroup w's dQ additions of its j-th tile issued
    full = [MBar(f"bar_full{s}", 1) for s in range(S)]
    empty = [MBar(f"bar_empty{s}", 128 if bug == "empty_count_128" else 256) for s in range(S)]
    sK = [[Buf(f"K{k}h{h}") for h in range(2)] for k in range(2)]  # the warpgroups' 64 rows
    sV = [[Buf(f"V{k}h{h}") for h in range(2)] for k in range(2)]
    stage = [{x: Buf(f"{x}{s}") for x in ("Q", "dO", "lse", "delta")} for s in range(S)]
    sDs = [[Buf(f"dS{b}h{h}") for h in range(2)] for b in range(2)]
    bufs = [b for k in range(2) for b in sK[k] + sV[k]] + [b for st in stage for b in st.values()]
    bufs += sDs[0] + sDs[1]
    nb1 = NBar("bar1")
    ready = [[NBar(f"ready{w}.{b}") for b in range(2)] for w in range(2)]
    free = [[NBar(f"free{w}.{b}") for b in range(2)] for w in range(2)]
    slot = [None, None]
    sentinel = len(tiles)
    keyed = [t for t, x in enumerate(tiles) if x[0]] + [sentinel]  # the j-th tile of buffers
    events = []  # pending asynchronous completions: callables

    def tma_load(rows, tag, bar):
        for b in rows:
            b.load(tag)

        def landed():
            for b in rows:
                b.inflight = False
            bar.complete_tx(1)
        events.append(landed)

    def producer():
        t, gs = 0, 0
        for j in itertools.count():
            kb = j & 1 if nkv == 2 else 0
            if bug != "no_kv_empty_wait":
                yield until(kv_empty[kb], ((j >> 1) & 1) ^ 1, (j >> 1) - 1)
            while t < len(tiles) and not tiles[t][0]:
                t += 1  # no keys: passed over
            slot[kb] = t
            yield ANY
            if t >= len(tiles):
                kv_full[kb].arrive(1)
                return
            n = tiles[t][1]
            kv_full[kb].expect_tx(2)
            tma_load(sK[kb], t, kv_full[kb])
            tma_load(sV[kb], t, kv_full[kb])
            for it in range(n):
                g = it if bug == "stage_restart" else gs + it
                s = g % S
                yield until(empty[s], ((g // S) & 1) ^ 1, g // S - 1)
                full[s].expect_tx(4)
                for b in stage[s].values():  # Q, dO (TMA tiles), lse2, delta (bulk copies)
                    tma_load([b], gs + it, full[s])
                yield ANY
            gs += n
            t += 1

    def reads(*pairs):
        return [b.read_start(tag) for b, tag in pairs]

    def done(rs):
        for b in rs:
            b.readers -= 1

    def write(rows, tag):
        for b in rows:
            b.write_start()
        yield ANY
        for b in rows:
            b.write_end(tag)

    def read_slot(kb, j):
        if slot[kb] != keyed[j]:
            raise Fail(f"slot {kb} holds tile {slot[kb]}, tile {keyed[j]} expected")
        return slot[kb]

    def counter():  # the overlapped conversion's counting thread
        for j in itertools.count():
            kb = j & 1 if nkv == 2 else 0
            yield until(kv_full[kb], (j >> 1) & 1, j >> 1)
            if read_slot(kb, j) == sentinel:
                return
            if bug != "count_no_dq_wait":
                yield until(dq_full[kb], (j >> 1) & 1, j >> 1)
            yield ANY  # fence.acq_rel.gpu; the tile's query blocks counted
            if {(j, 0), (j, 1)} - added:
                raise Fail(f"tile {j} counted before its dQ additions: {sorted(added)}")
            read_slot(kb, j)
            kv_empty[kb].arrive(1)

    def consumer(w):
        gs = 0
        pend = []  # defer: the store (its reading flag) whose wait and arrival are deferred
        stores = []  # every store's reading flag: none may still read when the thread exits

        def release_pend(buf):  # buf: the last tile's buffer, kb ^ 1 at every release point
            while pend:
                reading = pend.pop()
                if bug != "defer_no_wait":
                    yield lambda reading=reading: not reading[0]  # tma_store_wait_read<0>
                kv_empty[buf].arrive(1)

        for j in itertools.count():
            kb = j & 1 if nkv == 2 else 0
            yield until(kv_full[kb], (j >> 1) & 1, j >> 1)
            t = read_slot(kb, j)
            if t == sentinel:
                if bug != "defer_no_exit_wait":
                    yield from release_pend(kb ^ 1 if nkv == 2 else 0)
                if any(r[0] for r in stores):
                    raise Fail(f"warpgroup {w} exits while a dK/dV store reads shared memory")
                return
            n, K, V = tiles[t][1], sK[kb], sV[kb]
            for it in range(n):
                g, b = gs + it, it & 1
                s, st = g % S, stage[g % S]
                yield until(full[s], (g // S) & 1, g // S)
                # S^T = K Q^T and dP^T = V dO^T over this warpgroup's keys, waited for together
                r = reads((K[w], t), (st["Q"], g), (V[w], t), (st["dO"], g))
                if it == 0:
                    yield from release_pend(kb ^ 1 if nkv == 2 else 0)
                yield ANY
                done(r)
                r = reads((st["lse"], g), (st["delta"], g))  # P^T and dS^T in registers
                yield ANY
                done(r)
                dv = reads((st["dO"], g))  # dV += P^T dO
                if lagged and it >= 1 and bug != "lag_no_free_sync":
                    yield from free[1 - w][b].sync(w)  # the other's dQ_part(it - 2) read it
                if lagged and bug == "lag_early_ready":
                    ready[w][b].arrive(w)
                yield from write([sDs[b][w]], (j, it))  # this warpgroup's half of dS^T(it)
                if lagged:
                    if bug != "lag_early_ready":
                        ready[w][b].arrive(w)
                    if it >= 1:
                        yield from ready[1 - w][(it - 1) & 1].sync(w)
                    want = (j, it - 1) if it >= 1 else None  # step 0: a product dropped
                    dq = reads(*((x, want) for x in sDs[(it - 1) & 1]), (K[0], t), (K[1], t))
                else:
                    if bug != "no_step_barrier":
                        yield from nb1.sync(w)
                    dq = reads(*((x, (j, it)) for x in sDs[b]), (K[0], t), (K[1], t))
                dk = reads((st["Q"], g))  # dK += dS^T Q
                yield ANY
                done(dv + dq)  # wgmma_wait<1>: dV and dQ_part have completed
                if lagged and it + 1 < n:
                    free[w][(it - 1) & 1].arrive(w)
                yield ANY
                done(dk)
                empty[s].arrive(128)  # Q, dO and the statistics of stage s released
            if lagged and n > 0:  # dQ_part(n - 1)
                yield from ready[1 - w][(n - 1) & 1].sync(w)
                dq = reads(*((x, (j, n - 1)) for x in sDs[(n - 1) & 1]), (K[0], t), (K[1], t))
                yield ANY
                done(dq)
            gs += n
            if count:
                added.add((j, w))
                dq_full[kb].arrive(128)
            if bug != "no_tile_barrier":
                yield from nb1.sync(w)
            yield from release_pend(kb ^ 1 if nkv == 2 else 0)  # (a tile without steps)
            read_slot(kb, j)  # the epilogue reads the tile's indices again
            if tiles[t][2][w]:  # from registers (a slab crossing lk, or p.dkv_regs)
                yield ANY
                kv_empty[kb].arrive(128)
                continue
            yield from write([K[w], V[w]], ("dKV", t))  # dK, dV staged in this warpgroup's rows
            yield ANY  # named barrier 2 + w (this warpgroup)
            kv_empty[kb].arrive(127)  # the threads that do not store
            rows = reads((K[w], None), (V[w], None))
            reading = [True]
            stores.append(reading)

            def store_read(rows=rows, reading=reading):
                done(rows)
                reading[0] = False
            events.append(store_read)
            if bug == "early_store_release":
                kv_empty[kb].arrive(1)
            elif defer:
                pend.append(reading)
                continue
            yield lambda reading=reading: not reading[0]  # tma_store_wait_read<0>
            if bug != "early_store_release":
                kv_empty[kb].arrive(1)

    actors = {"producer": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    if count:
        actors["counter"] = counter()
    # Each run's relative speeds of the actors and the copy engine (one may run far ahead).
    speed = {k: rng.choice((1, 3, 10)) for k in ("producer", "wg0", "wg1", "counter", "e")}
    interleave(actors, events, rng, 100000, speed)
    for b in bufs:
        if b.readers or b.inflight or b.writing:
            raise Fail(f"{b.name} busy at exit")
    for bar in [nb1] + [x for w in range(2) for x in ready[w] + free[w]]:
        if bar.arrived:
            raise Fail(f"{bar.name}: warpgroups {bar.arrived} left arrived at exit")
    for bar in kv_full + kv_empty + full + empty + dq_full:
        if bar.tx:
            raise Fail(f"{bar.name}: {bar.tx} transaction units left at exit")


def random_tiles(rng, max_tiles=8):
    return [(rng.random() > 0.15, rng.randint(0, 6), (rng.random() < 0.3, rng.random() < 0.3))
            for _ in range(rng.randint(1, max_tiles))]


@pytest.mark.parametrize("count", [False, True], ids=["no_count", "count"])
@pytest.mark.parametrize("lagged", [False, True], ids=["lockstep", "lagged"])
@pytest.mark.parametrize("part", range(2))
def test_bwd_sync_model_has_no_deadlock_or_hazard(lagged, count, part):
    rng = random.Random(100 * lagged + 10 * count + part)
    for _ in range(150):
        run(random_tiles(rng), lagged, rng.randrange(1 << 30), count)


@pytest.mark.parametrize("count", [False, True], ids=["no_count", "count"])
@pytest.mark.parametrize("lagged", [False, True], ids=["lockstep", "lagged"])
def test_bwd_sync_model_deferred_store_release(lagged, count):
    """p.dkv_defer (D=128): the dK/dV store's wait and the buffer's release deferred into the
    next tile."""
    rng = random.Random(7 + count + 2 * lagged)
    for _ in range(300):
        run(random_tiles(rng), lagged, rng.randrange(1 << 30), count, defer=True)


def test_bwd_sync_model_single_tiles():
    """One tile per CTA (the first tile's buffer only), every step count, both epilogues."""
    rng = random.Random(3)
    for lagged, n, regs, count in itertools.product((False, True), range(7), (False, True),
                                                    (False, True)):
        for _ in range(5):
            run([(True, n, (regs, not regs))], lagged, rng.randrange(1 << 30), count)


@pytest.mark.parametrize("bug,lagged", [
    ("no_tile_barrier", False),      # a tile's dS^T / K rows rewritten while the other reads
    ("no_tile_barrier", True),
    ("no_kv_empty_wait", False),     # the next K/V loaded into a buffer still in use
    ("no_kv_empty_wait", True),
    ("early_store_release", False),  # the buffer released before the TMA store read it
    ("early_store_release", True),
    ("one_kv_buffer", False),        # one K/V buffer with the two buffers' parities
    ("one_kv_buffer", True),
    ("stage_restart", False),        # the producer's stages restart at each tile
    ("stage_restart", True),
    ("empty_count_128", False),      # a stage released by one warpgroup's threads
    ("empty_count_128", True),
    ("no_step_barrier", False),      # dQ_part read before the other half of dS^T is written
    ("lag_no_free_sync", True),      # dS^T rewritten before the other's dQ_part read it
    ("lag_early_ready", True),       # "ready" arrived before the half is written
    ("count_no_dq_wait", False),     # a tile counted before its dQ additions are issued
    ("counter_not_counted", True),   # bar_kv_empty's count without the counting thread
    ("defer_no_wait", False),        # deferred: the buffer released before the store read it
    ("defer_no_exit_wait", False),   # deferred: the last store not waited for at the exit
])
def test_bwd_sync_model_catches_known_mistakes(bug, lagged):
    rng = random.Random(5)
    count = bug.startswith("count")  # the counting thread's own mistakes
    defer = bug.startswith("defer")
    with pytest.raises(Fail):
        for _ in range(300):
            run(random_tiles(rng), lagged, rng.randrange(1 << 30), count, bug=bug, defer=defer)


@pytest.mark.parametrize("lagged", [False, True], ids=["lockstep", "lagged"])
def test_bwd_sync_model_catches_ds_race_across_tiles(lagged):
    """Without named barrier 1 after a tile's last step and with every epilogue from registers
    (no staging write into K to meet the other warpgroup's dQ_part), what remains is dS^T: after
    an odd number of steps, the next tile's step 0 writes buffer 0 while the other warpgroup's
    last dQ_part may still read it (or has yet to)."""
    rng = random.Random(9)
    with pytest.raises(Fail, match="dS0"):
        for _ in range(300):
            tiles = [(keys, n, (True, True)) for keys, n, _ in random_tiles(rng)]
            run(tiles, lagged, rng.randrange(1 << 30), bug="no_tile_barrier")
