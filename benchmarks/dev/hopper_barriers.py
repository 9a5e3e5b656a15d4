"""A model check of the mbarrier protocol of kernels/hopper.cu (K and V in
pipelines of their own), no GPU needed.

The producer and the consumers are two coroutines that make the kernel's
waits and arrivals in the kernel's order; a scheduler interleaves them at
random, 200 schedules per (STAGES, tiles). It checks that every run ends (no
deadlock) and that a wait by parity never finds its barrier two phases on
(which parity could not tell apart). The consumers' arrivals are modelled as
one: a phase needs every consumer thread, so the slower warpgroup sets it.

    python benchmarks/dev/hopper_barriers.py
"""
import random


def run(stages: int, tiles: int, seed: int) -> bool:
    phase: dict = {}  # barrier -> phases completed

    def done(bar, use):
        """try_wait.parity for the use-th phase of bar (parity use & 1)."""
        ok = (phase.get(bar, 0) & 1) != (use & 1)
        assert not ok or phase.get(bar, 0) == use + 1, (bar, phase.get(bar, 0), use)
        return ok

    def arrive(bar):
        phase[bar] = phase.get(bar, 0) + 1

    def producer():
        for j in range(tiles):
            s = j % stages
            while j >= stages and not done(("k_empty", s), j // stages - 1):
                yield
            arrive(("k_full", s))
            while j >= stages and not done(("v_empty", s), j // stages - 1):
                yield
            arrive(("v_full", s))

    def consumers():
        if tiles:
            while not done(("k_full", 0), 0):
                yield
            arrive(("k_empty", 0))
        for j in range(1, tiles):
            while not done(("k_full", j % stages), j // stages):
                yield
            while not done(("v_full", (j - 1) % stages), (j - 1) // stages):
                yield
            arrive(("k_empty", j % stages))  # Q K_j^T done
            arrive(("v_empty", (j - 1) % stages))  # P_{j-1} V_{j-1} done
        if tiles:
            while not done(("v_full", (tiles - 1) % stages), (tiles - 1) // stages):
                yield
            arrive(("v_empty", (tiles - 1) % stages))

    rng = random.Random(seed)
    sides, idle = [producer(), consumers()], 0
    while sides:
        side = rng.choice(sides)
        try:
            next(side)
            idle += 1
            if idle > 100_000:
                return False  # neither side moves: deadlock
        except StopIteration:
            sides.remove(side)
            idle = 0
    return True


if __name__ == "__main__":
    for stages in (2, 3, 4):
        for tiles in range(12):
            assert all(run(stages, tiles, seed) for seed in range(200)), (stages, tiles)
    print("hopper barrier protocol: no deadlock, no phase ambiguity (STAGES 2-4, 0-11 tiles, 200 schedules each)")
