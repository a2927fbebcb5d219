"""How many cores this machine gives right now: a pure-Python loop run twice in one
process, then once in each of two worker processes (wall seconds of each).

    python benchmarks/cpu_control.py      # "serial 2 jobs 1.55" / "2 procs 2 jobs 0.73": two free cores

Run it beside a scaling benchmark (BENCHMARKS.md "prepare --workers"): on a shared
machine, two processes can get no more CPU than one.
"""

import time
from concurrent.futures import ProcessPoolExecutor


def spin(n: int) -> int:
    s = 0
    for i in range(n):
        s += i
    return s


if __name__ == "__main__":
    N = 20_000_000
    t = time.perf_counter()
    spin(N)
    spin(N)
    print("serial 2 jobs", round(time.perf_counter() - t, 2))
    with ProcessPoolExecutor(2) as ex:
        list(ex.map(spin, [1000, 1000]))  # start the workers first
        t = time.perf_counter()
        list(ex.map(spin, [N, N]))
        print("2 procs 2 jobs", round(time.perf_counter() - t, 2))
