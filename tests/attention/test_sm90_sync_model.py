"""A model of the persistent sm90 attention forward's synchronisation, run under random
interleavings (CPU only; the kernel itself needs a Hopper GPU).

One CTA's actors follow csrc/attention/attention_fwd_kernel_sm90.cuh step by step: the tile
scheduler thread, the load thread (the load warp, as one actor), the consumer warpgroups (two,
or three for the 192-query tiles; each as one actor: its warps' releases arrive as a count of
4), and an asynchronous engine that completes TMA loads and TMA-store reads at random moments.
Over random work-tile sequences (skipped tiles, tiles without keys, 1..7 key tiles, slabs stored
by TMA or from registers), every schedule, stage count and staging buffer, and both tile
orders (the scheduler hands each tile, and a final sentinel, to the load thread and the
consumers through two shared-memory slots; static: it runs ahead as far as the slots let it;
dynamic: it takes each tile after the first only when the load thread asks for it) it checks: no
deadlock; every wgmma reads a buffer holding the tile it expects, fully loaded; no TMA load into
a buffer that is being read; no staging write into rows a store is still reading; every
ping-pong named-barrier generation completed by one waiting and one arriving warpgroup (the turns
go round the warpgroups in a cycle, 0, 1, .., NW - 1, 0, ..); every tile read from a slot is
the one written for it, with two consumer warpgroups and with the 192-query tiles' three; and for
the K/V multicast pair (two CTAs over the same tiles, each loading half of every K/V tile into
both, each consumer warp releasing a stage on both CTAs' empty barriers) that no CTA reads a half
its partner has not loaded or refills a half either CTA still reads. A change
to the kernel's barriers, counts or release points must be made here too; the mutation tests
show that the model catches the classic mistakes.
"""
import itertools
import random

import pytest
from mbar_model import Fail, MBar, interleave


class NBar:
    def __init__(self, name, total):
        self.name, self.total, self.arrived, self.gen, self.waiters = name, total, 0, 0, 0

    def add(self, n, waiting):
        self.arrived += n
        if waiting:
            self.waiters += 1
        if self.arrived == self.total:
            if self.total == 256 and self.waiters != 1:
                raise Fail(f"{self.name}: completed with {self.waiters} syncing warpgroups")
            self.arrived, self.waiters = 0, 0
            self.gen += 1
            return True
        return False


class Buf:
    def __init__(self, name):
        self.name, self.tag, self.loaded, self.inflight, self.readers = name, None, True, False, 0

    def load_issue(self, tag):
        if self.readers:
            raise Fail(f"TMA load into {self.name} with {self.readers} active readers")
        if self.inflight:
            raise Fail(f"TMA load into {self.name} while one is in flight")
        self.tag, self.loaded, self.inflight = tag, False, True

    def read_start(self, tag):
        if tag is not None and (self.tag != tag or not self.loaded):
            raise Fail(f"read of {self.name}: holds {self.tag} loaded={self.loaded}, want {tag}")
        if self.inflight:
            raise Fail(f"read of {self.name} while loading")
        self.readers += 1

    def read_end(self):
        self.readers -= 1


class Pair:
    """The K/V stages of the CTAs of a launch: one CTA, or the two of a multicast cluster, each
    CTA's K and V stage buffers held as one half per CTA of the pair (the rows that CTA loads
    into both), its empty barriers counting the consumer warps of both CTAs."""

    def __init__(self, S, warps, ctas, bug):
        self.ctas = ctas
        releases = warps * (ctas if bug != "mc_own_release_only" else 1)
        mk = lambda name, n, **kw: [[MBar(f"c{c}{name}{s}", n, **kw) for s in range(S)]  # noqa: E731
                                    for c in range(ctas)]
        self.kfull, self.vfull = mk("kfull", 1, negative_tx=ctas > 1), mk("vfull", 1,
                                                                         negative_tx=ctas > 1)
        self.kempty, self.vempty = mk("kempty", releases), mk("vempty", releases)
        self.sK = [[[Buf(f"c{c}sK{s}h{h}") for h in range(ctas)] for s in range(S)]
                   for c in range(ctas)]
        self.sV = [[[Buf(f"c{c}sV{s}h{h}") for h in range(ctas)] for s in range(S)]
                   for c in range(ctas)]


def run(tiles, S, schedule, o_in_q, epilogue, seed, bug=None, nw=2, dynamic=False, ctas=1):
    """ctas=2: a multicast pair -- both CTAs run the same tile sequence (the static order hands
    them adjacent q-blocks of one head: the same key tiles), each loading half of every K/V tile
    into both, each consumer warp releasing a stage on both CTAs' empty barriers."""
    rng = random.Random(seed)
    warps = 4 * nw  # lane 0 of every consumer warp arrives on the empty barriers
    pair = Pair(S, warps, ctas, bug)
    events = []  # pending async completions: callables
    actors = {}
    bufs = [b for c in range(ctas) for st in pair.sK[c] + pair.sV[c] for b in st]
    nbars = []
    for c in range(ctas):
        cta(c, pair, tiles, S, schedule, o_in_q, epilogue, bug, nw, dynamic, events, actors,
            bufs, nbars)
    interleave(actors, events, rng, 200000)
    for b in bufs:
        if b.readers or b.inflight:
            raise Fail(f"{b.name} busy at exit")
    for bar in nbars:  # the turns balance: no generation left half-arrived
        if bar.arrived:
            raise Fail(f"{bar.name}: {bar.arrived} arrivals left at exit")


def cta(c, pair, tiles, S, schedule, o_in_q, epilogue, bug, nw, dynamic, events, actors, bufs,
        nbars):
    """CTA c's actors (scheduler, load thread, consumer warpgroups) into `actors`."""
    warps = 4 * nw
    qfull, qempty = MBar(f"c{c}qfull", 1), MBar(f"c{c}qempty", warps)
    kfull, kempty, vfull, vempty = pair.kfull[c], pair.kempty[c], pair.vfull[c], pair.vempty[c]
    nb = {1 + w: NBar(f"c{c}nb{1 + w}", 256) for w in range(nw)}  # ping-pong ids 1 .. nw
    sQ = [Buf(f"c{c}sQ{w}") for w in range(nw)]  # each warpgroup's 64 rows
    sK, sV = pair.sK[c], pair.sV[c]  # per stage: the halves
    sO = [Buf(f"c{c}sO{w}") for w in range(nw)]
    bufs += sQ + sO
    nbars += list(nb.values())
    # the tile hand-over: slots j % 2, full (count 1: the scheduler) and empty (every thread
    # that reads the slot: 128 per consumer warpgroup + the load warp's 32 lanes;
    # "loader_not_counted": the consumers only); the load thread's request
    tfull = [MBar(f"tfull{j}", 1) for j in range(2)]
    tempty = [MBar(f"tempty{j}", 128 * nw + 32 * (bug != "loader_not_counted"))
              for j in range(2)]
    treq = MBar("treq", 1)
    slot = [None, None]
    sentinel = len(tiles)  # a tile index >= t_end

    def scheduler():  # the CTA's j-th tile into slot j % 2, the sentinel last
        for j in itertools.count():
            if j > 0 and dynamic:
                yield lambda j=j: treq.done((j - 1) & 1)
            t = j if j < len(tiles) else sentinel
            if bug != "slot_no_empty_wait":
                yield lambda j=j: tempty[j % 2].done(((j >> 1) & 1) ^ 1)
            slot[j % 2] = t
            yield lambda: True
            tfull[j % 2].arrive(1)
            if t == sentinel:
                return

    def fetch(j, arrivals):  # a reader: the CTA's j-th tile from slot j % 2 (its return value)
        yield lambda: tfull[j % 2].done((j >> 1) & 1)
        want = j if j < len(tiles) else sentinel
        t = slot[j % 2]
        if t != want:
            raise Fail(f"slot {j % 2} holds tile {t}, tile {want} expected")
        yield lambda: True
        tempty[j % 2].arrive(arrivals)
        return t

    def tma_load(buf_list, tag, bar):
        for b in buf_list:
            b.load_issue(tag)

        def complete():
            for b in buf_list:
                b.loaded, b.inflight = True, False
            bar.complete_tx(1)
        events.append(complete)

    def load_kv(bufs_of, full_of, s, tag):
        """This CTA's half of a K or V tile into every CTA of the pair (multicast), completing
        one unit on each CTA's full barrier; the own barrier expects all halves."""
        full_of[c][s].expect_tx(pair.ctas)
        for d in range(pair.ctas):
            tma_load([bufs_of[d][s][c]], tag, full_of[d][s])

    def producer():
        kv = q_use = 0
        for j in itertools.count():
            t = yield from fetch(j, 32)
            if t == sentinel:
                break
            skip, n, _ = tiles[t]
            if skip or (n == 0 and bug != "load_empty_tiles"):
                if dynamic:
                    treq.arrive(1)  # the next tile, please
                continue
            for i in range(max(n, 1)):
                it = kv + i
                s, ph = it % S, (it // S) & 1
                yield lambda s=s, ph=ph: kempty[s].done(ph ^ 1)
                load_kv(pair.sK, pair.kfull, s, (t, i))
                if i == 0:
                    yield lambda q=q_use: qempty.done((q & 1) ^ 1)
                    qfull.expect_tx(1)
                    tma_load(sQ, t, qfull)
                yield lambda s=s, ph=ph: vempty[s].done(ph ^ 1)
                load_kv(pair.sV, pair.vfull, s, (t, i))
            kv += n
            q_use += 1
            if dynamic:
                treq.arrive(1)

    def consumer(cw):
        kv = q_use = 0
        groups = []  # outstanding wgmma groups: lists of buffers being read
        store_reading = []  # this WG's TMA stores still reading their staging rows: [flag]
        pp = schedule == 2
        for j in itertools.count():
            t = yield from fetch(j, 128)
            if t == sentinel:
                break
            skip, n, slabs = tiles[t]
            if skip:
                continue
            tma_slab = epilogue != 0 and slabs[cw] and n > 0
            q_late = tma_slab and o_in_q

            def issue_qk(i, kv=kv, t=t):
                it = kv + i
                s = it % S
                yield lambda: kfull[s].done((it // S) & 1)
                sQ[cw].read_start(t)
                for h in sK[s]:
                    h.read_start((t, i))
                groups.append([sQ[cw], *sK[s]])

            def issue_pv(i, kv=kv, t=t):
                it = kv + i
                s = it % S
                yield lambda: vfull[s].done((it // S) & 1)
                for h in sV[s]:
                    h.read_start((t, i))
                groups.append([*sV[s]])

            def wgmma_wait(k):
                while len(groups) > k:
                    for b in groups.pop(0):
                        b.read_end()

            def release(bar):
                bar.arrive(4)

            def release_kv(empty_of, s):  # lane 0 on the own CTA's barrier, lane 1 on the other's
                for d in range(pair.ctas):
                    if d == c or bug != "mc_own_release_only":
                        empty_of[d][s].arrive(4)

            def release_q(q_late=q_late):
                if not q_late or bug == "early_q_release":
                    release(qempty)

            def take_turn():
                if pp:
                    bar = nb[1 + cw]
                    g0 = bar.gen
                    if not bar.add(128, True):
                        yield lambda: bar.gen != g0

            def hand_over(last):
                if pp and not (last and cw == nw - 1 and bug != "unbalanced_turns"):
                    # to the next warpgroup of the cycle; "two_wg_cycle": the two-warpgroup
                    # kernel's 2 - cw, wrong for three
                    nxt = 2 - cw if bug == "two_wg_cycle" else 1 + (cw + 1) % nw
                    nb[nxt].add(128, False)

            kempty_ = lambda i, kv=kv: (pair.kempty, (kv + i) % S)  # noqa: E731
            vempty_ = lambda i, kv=kv: (pair.vempty, (kv + i) % S)  # noqa: E731
            if n > 0:
                yield lambda q=q_use: qfull.done(q & 1)
            if schedule == 0:
                for i in range(n):
                    yield from issue_qk(i)
                    wgmma_wait(0)
                    release_kv(*kempty_(i))
                    if i + 1 == n:
                        release_q()
                    yield lambda: True  # softmax: a scheduling point
                    yield from issue_pv(i)
                    wgmma_wait(0)
                    release_kv(*vempty_(i))
            elif n > 0:
                if pp and cw == nw - 1:
                    nb[1].add(128, False)  # warpgroup 0's first turn
                yield from take_turn()
                yield from issue_qk(0)
                hand_over(False)
                wgmma_wait(0)
                release_kv(*kempty_(0))
                yield lambda: True
                for i in range(n - 1):
                    yield from take_turn()
                    yield from issue_qk(i + 1)
                    yield from issue_pv(i)
                    hand_over(False)
                    wgmma_wait(1)
                    release_kv(*kempty_(i + 1))
                    yield lambda: True
                    wgmma_wait(0)
                    release_kv(*vempty_(i))
                release_q()
                yield from take_turn()
                yield from issue_pv(n - 1)
                hand_over(True)
                wgmma_wait(0)
                release_kv(*vempty_(n - 1))
            if groups:
                raise Fail("wgmma groups left at the epilogue")
            # epilogue
            if tma_slab:
                buf = sQ[cw] if o_in_q else sO[cw]
                if not o_in_q and bug != "no_store_wait":
                    yield lambda: not any(f[0] for f in store_reading)
                # staging writes: a writer must not meet a load in flight or active readers
                if buf.inflight or buf.readers:
                    raise Fail(f"staging write into {buf.name}: inflight={buf.inflight} "
                               f"readers={buf.readers}")
                yield lambda: True
                if buf.inflight or buf.readers:
                    raise Fail(f"staging write into {buf.name} (end)")
                buf.read_start(None)  # the store reads the rows until its read completes
                flag = [True]
                store_reading.append(flag)

                def store_done(buf=buf, flag=flag):
                    buf.read_end()
                    flag[0] = False
                events.append(store_done)
                if q_late:
                    yield lambda flag=flag: not flag[0]
                    qempty.arrive(4)
            kv += n
            q_use += n > 0
        yield lambda: not any(f[0] for f in store_reading)

    actors.update({f"c{c}.scheduler": scheduler(), f"c{c}.producer": producer(),
                   **{f"c{c}.wg{w}": consumer(w) for w in range(nw)}})


def random_tiles(rng, nw=2, max_tiles=9):
    out = []
    for _ in range(rng.randint(1, max_tiles)):
        skip = rng.random() < 0.15
        n = rng.choice([0, 0, 1, 1, 2, 3, 4, 5, 7])
        out.append((skip, n, tuple(rng.random() < 0.7 for _ in range(nw))))
    return out


CONFIGS = [(S, sched, o_in_q, epi) for S in (2, 3) for sched in (0, 1, 2)
           for o_in_q in (False, True) for epi in (0, 1)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("S,schedule,o_in_q,epilogue", CONFIGS)
def test_sync_model_has_no_deadlock_or_hazard(S, schedule, o_in_q, epilogue, dynamic):
    rng = random.Random(1000 * S + 100 * schedule + 10 * o_in_q + epilogue)
    for _ in range(150):
        run(random_tiles(rng), S, schedule, o_in_q, epilogue, rng.randrange(1 << 30),
            dynamic=dynamic)


# Three consumer warpgroups (the 192-query tiles of D=64: 3 stages, O buffer or Q rows): one
# work tile per CTA (the non-persistent launch) and sequences of tiles.
CONFIGS_3WG = [(sched, o_in_q, epi, max_tiles) for sched in (0, 1, 2) for o_in_q in (False, True)
               for epi in (0, 1) for max_tiles in (1, 9)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("schedule,o_in_q,epilogue,max_tiles", CONFIGS_3WG)
def test_sync_model_three_warpgroups(schedule, o_in_q, epilogue, max_tiles, dynamic):
    rng = random.Random(7000 + 100 * schedule + 10 * o_in_q + epilogue + max_tiles)
    for _ in range(150 if max_tiles > 1 else 60):
        run(random_tiles(rng, nw=3, max_tiles=max_tiles), 3, schedule, o_in_q, epilogue,
            rng.randrange(1 << 30), nw=3, dynamic=dynamic)


@pytest.mark.parametrize("bug,config", [
    ("early_q_release", (2, 1, True, 1)),    # Q rows handed back before the store read them
    ("unbalanced_turns", (2, 2, False, 1)),  # warpgroup 1 hands over its last turn too
    ("load_empty_tiles", (2, 1, False, 1)),  # the producer loads for a tile without keys
    ("no_store_wait", (2, 1, False, 1)),     # O buffer rewritten while a store reads it
    ("slot_no_empty_wait", (2, 1, False, 1)),  # a tile slot rewritten before it was read
    ("loader_not_counted", (2, 1, False, 1)),  # the slot's empty count without the load thread
])
def test_sync_model_catches_known_mistakes(bug, config):
    rng = random.Random(5)
    with pytest.raises(Fail):
        for _ in range(300):
            run(random_tiles(rng), *config, rng.randrange(1 << 30), bug=bug,
                dynamic=False)


@pytest.mark.parametrize("bug", ["two_wg_cycle", "unbalanced_turns", "early_q_release"])
def test_sync_model_catches_three_warpgroup_mistakes(bug):
    """With three consumer warpgroups: the two-warpgroup hand-over (2 - cw) and a last turn
    handed over, on one work tile per CTA; Q rows handed back before the store read them, over
    sequences of tiles (with one tile nothing reloads Q)."""
    rng = random.Random(11)
    schedule, o_in_q = (1, True) if bug == "early_q_release" else (2, False)
    max_tiles = 9 if bug == "early_q_release" else 1
    with pytest.raises(Fail):
        for _ in range(300):
            run(random_tiles(rng, nw=3, max_tiles=max_tiles), 3, schedule, o_in_q, 1,
                rng.randrange(1 << 30), bug=bug, nw=3)


# K/V multicast: the two CTAs of a cluster over the same tile sequence (static order), each
# loading half of every K/V tile into both, with two and three consumer warpgroups.
CONFIGS_PAIR = [(S, sched, o_in_q, epi, nw) for S, nw in ((2, 2), (3, 2), (3, 3))
                for sched in (0, 1, 2) for o_in_q in (False, True) for epi in (0, 1)]


@pytest.mark.parametrize("S,schedule,o_in_q,epilogue,nw", CONFIGS_PAIR)
def test_sync_model_multicast_pair(S, schedule, o_in_q, epilogue, nw):
    rng = random.Random(9000 + 1000 * S + 100 * schedule + 10 * o_in_q + epilogue + nw)
    for _ in range(60):
        run(random_tiles(rng, nw=nw), S, schedule, o_in_q, epilogue, rng.randrange(1 << 30),
            nw=nw, ctas=2)


def test_sync_model_catches_multicast_mistake():
    """A pair whose consumers release a K/V stage on their own CTA's empty barrier only (counted
    for one CTA): a producer refills the other CTA's half of a stage that CTA still reads."""
    rng = random.Random(13)
    with pytest.raises(Fail):
        for _ in range(300):
            run(random_tiles(rng), 2, 1, False, 1, rng.randrange(1 << 30),
                bug="mc_own_release_only", ctas=2)
