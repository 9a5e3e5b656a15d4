"""A model check of the barrier protocol of kernels/hopper.cu, no GPU needed:
a persistent CTA's producer and its consumer warpgroups (two; three at
head dim 64) over several tiles (each with its own number of key tiles,
none included).

Three coroutines make the kernel's waits and arrivals in the kernel's order:
the K and V rings (mbarriers full / empty per stage, the empty ones needing
every consumer warpgroup), each warpgroup's Q rows in each Q tile (q_full / q_empty, the last q_full
carrying "no more tiles"), and the turns of the warpgroups, in a ring (named
barriers: one warpgroup's bar.arrive meets the next one's bar.sync). A
scheduler interleaves them at random. Every run must end (no deadlock); a
wait by parity must never find its barrier two phases on (parity could not
tell them apart); a turn must never be passed twice before it is taken (the
named barrier would complete with one warpgroup's threads alone); a stage must
never be freed for a ring position whose fill has not landed.

    python benchmarks/dev/hopper_barriers.py            # the protocol as built (both epilogues)
    python benchmarks/dev/hopper_barriers.py --no-q-empty  # a broken one: must fail
"""
import random
import sys



class Broken(Exception):
    pass


def run(stages: int, tiles: list, seed: int, q_empty_wait: bool = True, direct_out: bool = False,
        q_slots: int = 1, nwg: int = 2, wg_tiles=None) -> bool:
    """wg_tiles[t][w]: the key tiles warpgroup w computes of tile t (the first ones; its
    rows see none of the rest, whose stages it frees and whose turns it takes); None:
    all of them."""
    empty_arrivals = nwg  # k_empty / v_empty: every consumer warpgroup
    # with two Q tiles (and the epilogue staged through Q), the thread that issues
    # a tile's out copies makes its q_empty arrival in the warpgroup's next tile:
    # q_empty then completes on two arrivals, the warpgroup's other threads' and its
    held_arrivals = 2 if q_slots == 2 and not direct_out else 1
    phase: dict = {}  # barrier -> phases completed
    pending: dict = {}  # barrier -> arrivals towards its current phase
    turn = [0] * nwg  # passes waiting to be taken, per warpgroup

    def done(bar, use):
        """try_wait.parity for the use-th phase of bar (parity use & 1)."""
        ok = (phase.get(bar, 0) & 1) != (use & 1)
        if ok and phase.get(bar, 0) != use + 1:
            raise Broken(f"{bar}: waited for phase {use}, found {phase.get(bar, 0)} completed")
        return ok

    def arrive(bar, count=1):
        pending[bar] = pending.get(bar, 0) + 1
        if pending[bar] == count:
            pending[bar] = 0
            phase[bar] = phase.get(bar, 0) + 1

    def pass_turn(to):
        turn[to] += 1
        if turn[to] > 1:
            raise Broken(f"turn of warpgroup {to} passed twice before it was taken")

    def producer():
        ring = published = 0

        def fill(kind, r):
            s = r % stages
            while r >= stages and not done((kind + "_empty", s), r // stages - 1):
                yield
            arrive((kind + "_full", s))

        for n in tiles:
            if n > 0:
                yield from fill("k", ring)
            for h in range(nwg):
                qs, use = published % q_slots, published // q_slots  # the Q tile, its use
                while q_empty_wait and use > 0 and not done(("q_empty", h, qs), use - 1):
                    yield
                arrive(("q_full", h, qs))
            for i in range(n):
                if i > 0:
                    yield from fill("k", ring + i)
                yield from fill("v", ring + i)
            ring += n
            published += 1
        for h in range(nwg):  # no more tiles
            qs, use = published % q_slots, published // q_slots
            while q_empty_wait and use > 0 and not done(("q_empty", h, qs), use - 1):
                yield
            arrive(("q_full", h, qs))

    def consumer(wg):
        ring = 0

        def wait(kind, r):
            while not done((kind + "_full", r % stages), r // stages):
                yield

        def take():
            while turn[wg] == 0:
                yield
            turn[wg] -= 1

        def free(kind, r):
            """the empty arrival for ring position r: only once r's fill has landed (an
            arrival before that would count toward the stage's last use and free it
            under the other warpgroups)"""
            if phase.get((kind + "_full", r % stages), 0) != r // stages + 1:
                raise Broken(f"warpgroup {wg} freed {kind} of ring position {r} before it landed")
            arrive((kind + "_empty", r % stages), empty_arrivals)

        held = None  # the Q tile whose held arrival is still to come

        def release():
            nonlocal held
            if held is not None:
                arrive(("q_empty", wg, held), held_arrivals)
                held = None

        if wg == nwg - 1:
            pass_turn(0)
        for t in range(len(tiles) + 1):
            qs = t % q_slots
            while not done(("q_full", wg, qs), t // q_slots):
                yield
            if t == len(tiles):
                release()
                break
            n = tiles[t]
            m = n if wg_tiles is None else wg_tiles[t][wg]  # the key tiles it computes
            for j in range(m + 1 if m else 0):
                if j < m:
                    yield from wait("k", ring + j)
                if j > 0:
                    yield from wait("v", ring + j - 1)
                yield from take()
                pass_turn((wg + 1) % nwg)
                if j == 0:
                    release()  # after the tile's first Q K^T is issued
                if j < m:
                    free("k", ring + j)
                if direct_out and j == m - 1:
                    arrive(("q_empty", wg, qs))  # the last Q K^T is done: Q is free
                if j > 0:
                    free("v", ring + j - 1)
            if m == 0 and n > 0:  # the turn of the last P V, which every warpgroup takes
                yield from take()
                pass_turn((wg + 1) % nwg)
            for j in range(m, n):  # the tiles none of its rows sees: freed once landed, turns taken
                yield from wait("k", ring + j)
                yield from take()
                pass_turn((wg + 1) % nwg)
                free("k", ring + j)
                yield from wait("v", ring + j)
                free("v", ring + j)
            ring += n
            if direct_out:
                if m == 0:
                    arrive(("q_empty", wg, qs))  # Q never read
            else:
                release()  # a tile without keys issued no Q K^T
                arrive(("q_empty", wg, qs), held_arrivals)  # after the epilogue (staged through Q)
                if held_arrivals == 2:
                    held = qs  # the out copies' thread: in the next tile
        if wg == 0:
            yield from take()  # the last warpgroup's pass after its last turn

    rng = random.Random(seed)
    sides, idle = [producer(), *(consumer(w) for w in range(nwg))], 0
    while sides:
        side = rng.choice(sides)
        try:
            next(side)
            idle += 1
            if idle > 100_000:
                return False  # nobody moves: deadlock
        except StopIteration:
            sides.remove(side)
            idle = 0
    return True


def check(q_empty_wait: bool, direct_out: bool = False, q_slots: int = 1, nwg: int = 2) -> str | None:
    """None if every schedule of every case passes, else what broke (direct_out:
    the head-dim-64 epilogue, Q freed after the last Q K^T; q_slots: Q tiles,
    a warpgroup's t-th tile in Q tile t % q_slots). Half the cases give each
    warpgroup its own number of key tiles (at most the tile's, the last
    warpgroup's the most, as a causal tile's rows have them)."""
    rng = random.Random(0)
    for stages in (2, 3, 4):
        for case in range(60):
            tiles = [rng.choice((0, 1, 1, 2, 3, 5, 8)) for _ in range(rng.randint(1, 6))]
            wg_tiles = None
            if case % 2:
                wg_tiles = [sorted(rng.randint(0, n) for _ in range(nwg - 1)) + [n] for n in tiles]
            for seed in range(40):
                try:
                    if not run(stages, tiles, seed, q_empty_wait, direct_out, q_slots, nwg, wg_tiles):
                        return f"deadlock: STAGES {stages}, key tiles per tile {tiles}, schedule {seed}"
                except Broken as e:
                    return f"{e}: STAGES {stages}, key tiles per tile {tiles}, schedule {seed}"
    return None


if __name__ == "__main__":
    if "--no-q-empty" in sys.argv:
        problem = check(q_empty_wait=False)
        print(f"without the q_empty waits: {problem or 'no failure found'}")
        sys.exit(0 if problem else 1)
    # the kernel's layouts: two consumer warpgroups with either epilogue, one or two Q tiles;
    # three at head dim 64 (its direct epilogue, one Q tile); three staged, two Q tiles
    for direct_out, q_slots, nwg in ((False, 1, 2), (True, 1, 2), (False, 2, 2), (True, 1, 3), (False, 2, 3)):
        problem = check(q_empty_wait=True, direct_out=direct_out, q_slots=q_slots, nwg=nwg)
        if problem:
            sys.exit(f"hopper barrier protocol (direct_out {direct_out}, q_slots {q_slots}, {nwg} consumer warpgroups): "
                     f"{problem}")
    print("hopper barrier protocol, both epilogues, one and two Q tiles (with two, the out copies' arrival a tile "
          "later), two and three consumer warpgroups, each warpgroup all of a tile's key tiles or its own first ones: no deadlock, no phase ambiguity, no turn passed twice (STAGES 2-4, 60 tile lists of 1-6 tiles with 0-8 key tiles each, 40 schedules each)")
