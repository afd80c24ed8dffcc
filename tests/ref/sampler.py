"""Reference of astrai's sampler (docs/sampler.md), independent of the C code.

AstrAI's RDSampler draws its permutation with torch.randperm, which cannot be
reproduced outside torch; astrai specifies its own permutation instead
(Fisher-Yates driven by splitmix64). The lead's PyTorch training references
use rank_order() to feed the reference model the same batches as astrai.
"""

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15


class SplitMix64:
    def __init__(self, seed: int):
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + GOLDEN_GAMMA) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, bound: int) -> int:
        """Uniform in [0, bound): reject draws below 2**64 mod bound."""
        threshold = (1 << 64) % bound
        while True:
            x = self.next()
            if x >= threshold:
                return x % bound


def permutation(n: int, seed: int, shuffle: bool = True) -> list:
    """The full order of one epoch; seed is random_seed + epoch."""
    perm = list(range(n))
    if not shuffle:
        return perm
    rng = SplitMix64(seed)
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def rank_order(n: int, world: int, rank: int, seed: int, epoch: int, shuffle: bool = True) -> list:
    """The sample indices rank takes in epoch, in order (before resuming)."""
    perm = permutation(n, seed + epoch, shuffle)
    per_replica = (n + world - 1) // world
    padded = [perm[p % n] for p in range(per_replica * world)]
    return padded[rank::world]
