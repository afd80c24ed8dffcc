"""test_topk: engine/topk.h's topk_torch_cpu (through tests/test_topk) picks and orders the
same indices as torch.topk(vals, k) (largest, sorted) on the CPU, row by row, for tie-heavy
rows (a few distinct values, all equal, NaNs, infinities and signed zeros, sorted runs),
continuous rows and adversarial rows that run libstdc++'s introselect and introsort out of
depth, for E in a spread of expert counts and every k from 1 to E. Then it checks the
threshold between torch's two paths: with the other path forced, the C indices differ from
torch's on both sides of k * 64 <= E."""

import os
import subprocess
import sys

import numpy as np
import torch

torch.set_num_threads(2)
BUILD = os.environ["ASTRAI_BUILD"]
PROG = os.path.join(BUILD, "test_topk")
ES = [1, 2, 3, 4, 5, 8, 16, 17, 33, 64, 65, 128, 160, 256, 300]
ROWS_PER_KIND = 2


def few(rng, E, pool=(-1.0, 0.0, 0.5, 1.0, 2.0)):
    m = int(rng.integers(2, 5))
    return rng.choice(rng.choice(pool, m, replace=False), E)


def with_nan(rng, E):
    v = few(rng, E)
    v[rng.random(E) < 0.2] = np.nan
    return v


def specials(rng, E):
    return rng.choice([np.inf, -np.inf, 0.0, -0.0, np.nan, 1.0], E)


def mostly_equal(rng, E):
    v = np.full(E, 0.25)
    v[rng.integers(0, E, max(1, E // 16))] = rng.choice([0.5, -0.5, np.nan])
    return v


KINDS = {
    "few": few,
    "binary": lambda rng, E: rng.choice([0.0, 1.0], E),
    "equal": lambda rng, E: np.full(E, float(rng.choice([0.0, -3.0, 7.5]))),
    "nan": with_nan,
    "all_nan": lambda rng, E: np.full(E, np.nan),
    "specials": specials,
    "mostly_equal": mostly_equal,
    "ascending": lambda rng, E: np.sort(few(rng, E)),
    "descending": lambda rng, E: np.sort(few(rng, E))[::-1].copy(),
    "continuous": lambda rng, E: rng.standard_normal(E),
}


class Sim:
    """libstdc++'s nth_element + sort as torch calls them, over element ids with a pluggable
    less-than: only here to drive McIlroy's adversary (below), which needs to see every
    comparison. The C port is what the test checks; this just has to compare the same pairs."""

    def __init__(self, a, lt):
        self.a, self.lt = a, lt

    def swap(self, i, j):
        self.a[i], self.a[j] = self.a[j], self.a[i]

    def push_heap(self, f, hole, top, v):
        a, parent = self.a, (hole - 1) // 2
        while hole > top and self.lt(a[f + parent], v):
            a[f + hole] = a[f + parent]
            hole, parent = parent, (parent - 1) // 2
        a[f + hole] = v

    def adjust_heap(self, f, hole, n, v):
        a, top, child = self.a, hole, hole
        while child < (n - 1) // 2:
            child = 2 * (child + 1)
            if self.lt(a[f + child], a[f + child - 1]):
                child -= 1
            a[f + hole] = a[f + child]
            hole = child
        if n % 2 == 0 and child == (n - 2) // 2:
            child = 2 * (child + 1)
            a[f + hole] = a[f + child - 1]
            hole = child - 1
        self.push_heap(f, hole, top, v)

    def pop_heap(self, f, last, res):
        v = self.a[res]
        self.a[res] = self.a[f]
        self.adjust_heap(f, 0, last - f, v)

    def heap_select(self, f, m, last):
        n = m - f
        if n >= 2:
            for parent in range((n - 2) // 2, -1, -1):
                self.adjust_heap(f, parent, n, self.a[f + parent])
        for i in range(m, last):
            if self.lt(self.a[i], self.a[f]):
                self.pop_heap(f, m, i)

    def sort_heap(self, f, last):
        while last - f > 1:
            last -= 1
            self.pop_heap(f, last, last)

    def insertion_sort(self, f, last, guarded=True):
        a = self.a
        for i in range(f + 1 if guarded else f, last):
            v = a[i]
            if guarded and self.lt(v, a[f]):
                a[f + 1:i + 1] = a[f:i]
                a[f] = v
                continue
            j = i
            while self.lt(v, a[j - 1]):
                a[j] = a[j - 1]
                j -= 1
            a[j] = v

    def partition_pivot(self, f, last):
        a, lt, mid = self.a, self.lt, f + (last - f) // 2
        x, y, z = f + 1, mid, last - 1
        if lt(a[x], a[y]):
            m = y if lt(a[y], a[z]) else (z if lt(a[x], a[z]) else x)
        else:
            m = x if lt(a[x], a[z]) else (z if lt(a[y], a[z]) else y)
        self.swap(f, m)
        lo, hi = f + 1, last
        while True:
            while lt(a[lo], a[f]):
                lo += 1
            hi -= 1
            while lt(a[f], a[hi]):
                hi -= 1
            if not lo < hi:
                return lo
            self.swap(lo, hi)
            lo += 1

    def introselect(self, f, nth, last):
        depth = 2 * ((last - f).bit_length() - 1)
        while last - f > 3:
            if depth == 0:
                self.heap_select(f, nth + 1, last)
                self.swap(f, nth)
                return
            depth -= 1
            cut = self.partition_pivot(f, last)
            f, last = (cut, last) if cut <= nth else (f, cut)
        self.insertion_sort(f, last)

    def introsort_loop(self, f, last, depth):
        while last - f > 16:
            if depth == 0:
                self.heap_select(f, last, last)
                self.sort_heap(f, last)
                return
            depth -= 1
            cut = self.partition_pivot(f, last)
            self.introsort_loop(cut, last, depth)
            last = cut

    def sort(self, f, last):
        if f == last:
            return
        self.introsort_loop(f, last, 2 * ((last - f).bit_length() - 1))
        if last - f > 16:
            self.insertion_sort(f, f + 16)
            self.insertion_sort(f + 16, last, guarded=False)
        else:
            self.insertion_sort(f, last)


def adversarial(E, k, rng, sort_stage, ties):
    """McIlroy's "A Killer Adversary for Quicksort": values are fixed lazily as the sort
    compares them (an unfixed "gas" value lies between those fixed low and those fixed high;
    two gas compared fix one), so that the pivot candidate comes out at the bottom of its
    range, which runs introselect out of depth into its heap fallback. With sort_stage, the
    aim is std::sort's fallback instead: only the k - 1 elements std::sort sees are left to
    the adversary (the rest get fixed values below them, a few so that they tie), and while
    nth_element runs it fixes values high, which isolates those k - 1 in a few partitions and
    leaves most of them gas for std::sort. With ties, a value being fixed joins the last
    value fixed on its side when no answer given so far forbids it: with distinct values the
    output cannot show where a fallback started, with ties it does. Keys ascend in sort
    order; torch sorts descending, so key j becomes the value 2**22 - j."""
    gas, top_key = 2**20, 2**21
    key = [gas] * E
    above, below = [-1] * E, [top_key] * E  # a gas value must stay in (above, below)
    state = {"low": 0, "high": top_key, "to_high": sort_stage, "candidate": 0}
    top = set(rng.choice(E, k - 1, replace=False).tolist()) if sort_stage else set(range(E))
    low = {x: float(rng.choice([-1.0, -2.0, -3.0])) for x in range(E) if x not in top}

    def freeze(x):
        if state["to_high"]:
            if not (ties and state["high"] < top_key and below[x] > state["high"]):
                state["high"] -= 1
            key[x] = state["high"]
        else:
            if not (ties and state["low"] > 0 and above[x] < state["low"] - 1):
                state["low"] += 1
            key[x] = state["low"] - 1

    def saw(g, s):
        """Gas g was just compared with the fixed s: the answer binds g's value."""
        if key[s] < gas:
            above[g] = max(above[g], key[s])
        else:
            below[g] = min(below[g], key[s])

    def lt(x, y):
        if (x in low) != (y in low):
            return y in low
        if x in low:
            return low[x] > low[y]
        if key[x] == gas and key[y] == gas:
            freeze(x if x == state["candidate"] else y)
        if key[x] == gas:
            state["candidate"] = x
            saw(x, y)
        elif key[y] == gas:
            state["candidate"] = y
            saw(y, x)
        return key[x] < key[y]

    sim = Sim(list(range(E)), lt)
    sim.introselect(0, k - 1, E)
    state["to_high"] = False
    sim.sort(0, k - 1)
    for x in sorted(top):
        if key[x] == gas:
            freeze(x)
    return np.array([low[x] if x in low else 2**22 - key[x] for x in range(E)], np.float64)


def adversarial_ks(E):
    """The nth_element-path k's the adversary runs for (all of them while E is small)."""
    ks = [k for k in range(1, E + 1) if k * 64 > E]
    if E <= 65:
        return ks
    picks = set(ks[:: max(1, len(ks) // 10)]) | {17, 18, 33, E // 2, E - 1, E}
    return sorted(k for k in picks if k in ks)


def cases():
    """(E, k, rows (n, E) float32, what the rows are) for every E and k."""
    rng = np.random.default_rng(1234)
    out = []
    for E in ES:
        adv = set(adversarial_ks(E)) if E >= 17 else set()
        for k in range(1, E + 1):
            rows = [KINDS[name](rng, E) for name in KINDS for _ in range(ROWS_PER_KIND)]
            kinds = [name for name in KINDS for _ in range(ROWS_PER_KIND)]
            if k in adv:
                for stage in ("select", "sort"):
                    for ties in (False, True):
                        rows.append(adversarial(E, k, rng, stage == "sort", ties))
                        kinds.append(f"adversarial_{stage}" + ("_ties" if ties else ""))
            out.append((E, k, np.array(rows, np.float32), kinds))
    return out


def run_c(all_cases, mode):
    blob = bytearray()
    for E, k, rows, _ in all_cases:
        blob += np.array([E, k, len(rows)], np.int32).tobytes() + rows.tobytes()
    res = subprocess.run([PROG, mode], input=bytes(blob), capture_output=True, check=True)
    flat, out, at = np.frombuffer(res.stdout, np.int32), [], 0
    for E, k, rows, _ in all_cases:
        out.append(flat[at:at + len(rows) * k].reshape(len(rows), k))
        at += len(rows) * k
    assert at == len(flat), "test_topk wrote more indices than asked for"
    return out


def main():
    all_cases = cases()
    want = [torch.topk(torch.from_numpy(rows), k, dim=1).indices.numpy()
            for _, k, rows, _ in all_cases]
    got = run_c(all_cases, "torch")
    nrows = 0
    for (E, k, rows, kinds), w, g in zip(all_cases, want, got):
        for r in range(len(rows)):
            if not np.array_equal(w[r], g[r]):
                print(f"MISMATCH E={E} k={k} row kind={kinds[r]}\n values={rows[r].tolist()}\n"
                      f" torch={w[r].tolist()}\n C    ={g[r].tolist()}")
                sys.exit(1)
        nrows += len(rows)
    n_adv = sum(name.startswith("adversarial") for *_, kinds in all_cases for name in kinds)
    print(f"test_topk: {nrows} rows in {len(all_cases)} (E, k) cases ({n_adv} adversarial) "
          f"match torch.topk")

    # The threshold: forcing the other path must change some answer on both sides of it,
    # else these rows could not tell where torch switches.
    forced = {mode: run_c(all_cases, mode) for mode in ("partial", "nth")}
    for E in ES:
        if E < 64:
            continue
        last_partial = E // 64
        for k, wrong in ((last_partial, "nth"), (last_partial + 1, "partial")):
            i = next(i for i, c in enumerate(all_cases) if c[0] == E and c[1] == k)
            differ = int((forced[wrong][i] != want[i]).any(axis=1).sum())
            if differ == 0:
                print(f"THRESHOLD: E={E} k={k}: the {wrong} path gives torch's answers too")
                sys.exit(1)
            print(f"threshold E={E} k={k} (k*64 {'<=' if k == last_partial else '>'} E): "
                  f"the {wrong} path differs from torch in {differ}/{len(want[i])} rows")


if __name__ == "__main__":
    main()
