"""A model of the sm90 backward's deterministic dQ order (kDet of
csrc/attention/attention_bwd_kernel_sm90.cuh), run on the CPU: which key blocks add into a query
block's dQ, the turn each one waits for, and the tickets that keep the waits free of deadlock
however few CTAs are resident and in whatever order the hardware starts them.

The kernel's rules, repeated here: Seq::keys_of / queries_of (attention_common.cuh) and KeySteps
(attention_bwd_kernel_sm80.cuh) give the query blocks a key block visits; a query block's
contributors are the key blocks [klo / BN, (khi - 1) / BN] of keys_of, and key block nb's turn is
nb - klo / BN (ascending) or (khi - 1) / BN - nb (descending); a CTA takes a ticket on entry and
works on the (key block, KV head, sequence) it names, key blocks in adding order; per step (query
head, query block) its consumers stage the step's dQ block in one of two shared-memory buffers
(step i in buffer i % 2, once that buffer's writer has added step i - 2) and go on, and the dQ
writer warp of that buffer (even or odd steps, in step order) waits for the block's turn, adds
and passes the turn on. The rotated order (dq_rotated: no mask, as many steps as key blocks or
more) starts key block nb at flat step (n_it - nb) % n_it and gives the turns in the order of
the step at which each key block reaches the query block (dq_rot_turn); it needs every key block
of a (KV head, sequence) resident at once, which the launcher ensures by using it only for grids
of at most half the GPU's SMs in key blocks. A change to those rules must be made here too.
"""
import random
from collections import defaultdict

import pytest

BN = 128  # TilesBwdSm90::kBlockN


def keys_of(m0, m_end, lq, lk, left, right):
    off = lk - lq
    lo = max(0, m0 + off - left) if left >= 0 else 0
    hi = min(lk, m_end - 1 + off + right + 1) if right >= 0 else lk
    return lo, hi


def queries_of(n0, n_end, lq, lk, left, right):
    off = lk - lq
    lo = max(0, n0 - off - right) if right >= 0 else 0
    hi = min(lq, n_end - 1 - off + left + 1) if left >= 0 else lq
    return lo, hi


def key_steps(n0, lq, lk, left, right, bm):
    """KeySteps: the query blocks (t_lo, n_tiles) that key block n0 visits."""
    i_lo, i_hi = queries_of(n0, min(n0 + BN, lk), lq, lk, left, right)
    t_lo = i_lo // bm
    return t_lo, ((i_hi + bm - 1) // bm - t_lo if i_hi > i_lo else 0)


def turn_of(nb, m, lq, lk, left, right, bm, desc):
    klo, khi = keys_of(m, min(m + bm, lq), lq, lk, left, right)
    return (khi - 1) // BN - nb if desc else nb - klo // BN


def rot_turn(nb, nkb, n_it, t):
    """dq_rot_turn: key block nb's turn in flat step t of the rotated order."""
    lead = n_it - t
    return nb - lead if nb >= lead else nb + max(0, nkb - lead)


def rotated(lq, lk, left, right, bm, group):
    """dq_rotated, with the launcher's mask condition."""
    n_it = group * ((lq + bm - 1) // bm)
    return left < 0 and right < 0 and (lk + BN - 1) // BN <= n_it


def cta_of(ticket, gx, gy, desc):
    """cta_nb / cta_hk / cta_b of a ticket."""
    nb = ticket % gx
    return (gx - 1 - nb if desc else nb), (ticket // gx) % gy, ticket // (gx * gy)


def random_problem(rng):
    bm = rng.choice([64, 128])  # D=128 and D=64
    batch = rng.randint(1, 3)
    hkv = rng.randint(1, 2)
    hq = hkv * rng.choice([1, 2])
    lens_q = [rng.choice([0, 1, 63, 64, 65, 200, 300, 513]) for _ in range(batch)]
    lens_k = [rng.choice([1, 5, 127, 128, 129, 300, 700]) for _ in range(batch)]
    left = rng.choice([-1, -1, 0, 3, 64, 300])
    right = rng.choice([-1, -1, 0, 0, 5, 200])
    return dict(bm=bm, hq=hq, hkv=hkv, lens_q=lens_q, lens_k=lens_k, left=left, right=right)


def test_contributors_are_the_key_blocks_that_visit_and_turns_count_them():
    """The key blocks whose KeySteps visit a query block are exactly [klo / BN, (khi - 1) / BN],
    and their turns are 0 .. n - 1 in either order: no turn is skipped or held twice."""
    rng = random.Random(3)
    for _ in range(3000):
        bm = rng.choice([64, 128])
        lq, lk = rng.randint(0, 800), rng.randint(1, 800)
        left, right = rng.choice([-1, 0, 3, 64, 300]), rng.choice([-1, 0, 5, 200, 600])
        gx = (lk + rng.randint(0, 300) + BN - 1) // BN  # max_k over the batch >= lk
        visits = defaultdict(list)
        for nb in range(gx):
            if nb * BN >= lk:
                continue  # the CTA returns before its first barrier
            t_lo, n_tiles = key_steps(nb * BN, lq, lk, left, right, bm)
            for t in range(t_lo, t_lo + n_tiles):
                visits[t].append(nb)
        assert all(t * bm < lq for t in visits)
        for t in range((lq + bm - 1) // bm):
            m = t * bm
            klo, khi = keys_of(m, min(m + bm, lq), lq, lk, left, right)
            want = list(range(klo // BN, (khi - 1) // BN + 1)) if khi > klo else []
            assert visits.get(t, []) == want, (lq, lk, left, right, bm, t)
            for desc in (False, True):
                turns = sorted(turn_of(nb, m, lq, lk, left, right, bm, desc) for nb in want)
                assert turns == list(range(len(want)))


def test_rotated_turns_follow_the_steps():
    """In the rotated order every key block's step j is turn-free or waits for a step before j of
    another key block, and the turns of a block are 0 .. nkb - 1."""
    for nkb in range(1, 12):
        for n_it in range(nkb, 3 * nkb + 2):
            step = {(nb, (j - nb) % n_it): j for nb in range(nkb) for j in range(n_it)}
            for t in range(n_it):
                turns = [rot_turn(nb, nkb, n_it, t) for nb in range(nkb)]
                assert sorted(turns) == list(range(nkb))
                by_turn = sorted(range(nkb), key=lambda nb: turns[nb])
                for a, c in zip(by_turn, by_turn[1:], strict=False):
                    assert step[(a, t)] < step[(c, t)]
            for nb in range(nkb):  # every key block's first step holds its block's first turn
                assert rot_turn(nb, nkb, n_it, (n_it - nb) % n_it) == 0


def run(prob, resident, rng, desc, use_ticket=True, rot=False):
    """Runs the grid with at most `resident` CTAs at once, started in a random order; returns the
    adding order of every dQ piece. Raises on a deadlock. rot: the rotated order where it
    applies (the launcher's p.dq_rot)."""
    bm, hq, hkv = prob["bm"], prob["hq"], prob["hkv"]
    lens_q, lens_k, left, right = prob["lens_q"], prob["lens_k"], prob["left"], prob["right"]
    group = hq // hkv
    gx, gy, gz = (max(lens_k) + BN - 1) // BN, hkv, len(lens_q)
    start_order = list(range(gx * gy * gz))  # linear block ids, x fastest
    rng.shuffle(start_order)
    counters, adds = defaultdict(int), defaultdict(list)
    tickets = iter(range(gx * gy * gz))
    pending, running = iter(start_order), []
    while True:
        while len(running) < resident:
            block = next(pending, None)
            if block is None:
                break
            if use_ticket:
                nb, hk, b = cta_of(next(tickets), gx, gy, desc)
            else:  # the mistake the tickets avoid: the block index names the work
                nb, hk, b = block % gx, (block // gx) % gy, block // (gx * gy)
            lq, lk = lens_q[b], lens_k[b]
            steps = []
            rot_b = rot and rotated(lq, lk, left, right, bm, group)
            if nb * BN < lk:
                t_lo, n_tiles = key_steps(nb * BN, lq, lk, left, right, bm)
                steps = [(h, t * bm) for h in range(hk * group, hk * group + group)
                         for t in range(t_lo, t_lo + n_tiles)]
                if rot_b and nb > 0:  # first_step / step_on
                    steps = steps[len(steps) - nb:] + steps[:len(steps) - nb]
            # c: the next step the consumers stage; w[f]: the next step writer f adds.
            running.append(dict(nb=nb, hk=hk, b=b, steps=steps, c=0, w=[0, 1], rot=rot_b))
        if not running:
            break
        progress = False
        rng.shuffle(running)
        for cta in list(running):
            steps, n = cta["steps"], len(cta["steps"])
            if cta["c"] == n and min(cta["w"]) >= n:
                running.remove(cta)
                progress = True
                continue
            lq, lk = lens_q[cta["b"]], lens_k[cta["b"]]
            moves = ["stage", 0, 1]
            rng.shuffle(moves)
            for move in moves:
                c = cta["c"]
                if move == "stage":
                    # Step c's buffer is free once its writer's next step is c (c - 2 added).
                    if c < n and cta["w"][c % 2] >= c:
                        cta["c"] += 1
                        progress = True
                    continue
                i = cta["w"][move]
                if i < n and i < cta["c"]:  # staged, its turn next?
                    h, m = steps[i]
                    key = (cta["b"], h, m)
                    if cta["rot"]:
                        t = (h - cta["hk"] * group) * ((lq + bm - 1) // bm) + m // bm
                        turn = rot_turn(cta["nb"], (lk + BN - 1) // BN, n, t)
                    else:
                        turn = turn_of(cta["nb"], m, lq, lk, left, right, bm, desc)
                    if counters[key] == turn:
                        counters[key] += 1
                        adds[key].append(cta["nb"])
                        cta["w"][move] += 2
                        progress = True
        if not progress:
            raise RuntimeError(f"deadlock: {len(running)} resident CTAs wait")
    return adds


@pytest.mark.parametrize("desc", [False, True], ids=["ascending", "descending"])
def test_tickets_never_deadlock_and_fix_the_order(desc):
    """Any residency (one CTA at a time up to all of them) and any start order: no deadlock, and
    every dQ block is added by its contributors in the one fixed order (bit-identical runs)."""
    rng = random.Random(11 + desc)
    checked = 0
    for _ in range(400):
        prob = random_problem(rng)
        resident = rng.choice([1, 1, 2, 3, 1000])
        adds = run(prob, resident, rng, desc)
        checked += len(adds)
        for (b, h, m), order in adds.items():
            lq, lk = prob["lens_q"][b], prob["lens_k"][b]
            klo, khi = keys_of(m, min(m + prob["bm"], lq), lq, lk, prob["left"], prob["right"])
            want = list(range(klo // BN, (khi - 1) // BN + 1))
            assert order == (want[::-1] if desc else want), (prob, b, h, m)
    assert checked > 1000  # dQ blocks whose order was checked


def test_the_model_catches_work_named_by_the_block_index():
    """Without tickets (the block index names the key block), a CTA started before the blocks it
    waits for, with too few resident to hold them, deadlocks: the check is not vacuous."""
    rng = random.Random(5)
    prob = dict(bm=64, hq=2, hkv=1, lens_q=[513], lens_k=[700], left=-1, right=-1)
    with pytest.raises(RuntimeError, match="deadlock"):
        for _ in range(50):
            run(prob, 1, rng, desc=False, use_ticket=False)


def rot_order(prob, b, m, h):
    """The rotated order's adding order of block (b, h, m): key blocks by their turns."""
    lq, lk, bm = prob["lens_q"][b], prob["lens_k"][b], prob["bm"]
    group = prob["hq"] // prob["hkv"]
    nkb, n_tiles = (lk + BN - 1) // BN, (lq + bm - 1) // bm
    n_it = group * n_tiles
    t = (h % group) * n_tiles + m // bm
    return sorted(range(nkb), key=lambda nb: rot_turn(nb, nkb, n_it, t))


def test_rotated_order_never_deadlocks_with_its_key_blocks_resident():
    """The rotated order where it applies (unmasked sequences with at least as many steps as key
    blocks), the linear one elsewhere, with as many CTAs resident as the grid has key blocks or
    more, in any start order: no deadlock, and each block added in its one fixed order."""
    rng = random.Random(17)
    checked_rot = 0
    for _ in range(400):
        prob = random_problem(rng)
        if rng.random() < 0.7:
            prob["left"] = prob["right"] = -1
        gx = (max(prob["lens_k"]) + BN - 1) // BN
        resident = rng.choice([gx, gx + 1, 2 * gx, 1000])
        adds = run(prob, resident, rng, desc=False, rot=True)
        group = prob["hq"] // prob["hkv"]
        for (b, h, m), order in adds.items():
            lq, lk = prob["lens_q"][b], prob["lens_k"][b]
            if rotated(lq, lk, prob["left"], prob["right"], prob["bm"], group):
                assert order == rot_order(prob, b, m, h), (prob, b, h, m)
                checked_rot += 1
            else:
                klo, khi = keys_of(m, min(m + prob["bm"], lq), lq, lk, prob["left"],
                                   prob["right"])
                assert order == list(range(klo // BN, (khi - 1) // BN + 1)), (prob, b, h, m)
    assert checked_rot > 300


def test_rotated_order_needs_its_key_blocks_resident():
    """With fewer CTAs resident than a sequence has key blocks the rotated order can deadlock
    (a key block waits for one whose ticket is larger): why the launcher bounds the grid."""
    rng = random.Random(23)
    prob = dict(bm=64, hq=1, hkv=1, lens_q=[1024], lens_k=[1024], left=-1, right=-1)
    with pytest.raises(RuntimeError, match="deadlock"):
        for _ in range(20):
            run(prob, 2, rng, desc=False, rot=True)
