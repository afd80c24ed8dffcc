"""Reference of NEFTune's noise in astrai (engine/counter_rng.h, train/trainer.c),
independent of the C code: the counter-based normals and the seed of a micro-step.

AstrAI draws its noise with torch.randn_like, which cannot be reproduced outside torch;
astrai draws from a counter-based generator instead, so the references can add the very
same noise and compare losses exactly."""
import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(z):
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def counter_normal(seed, n):
    """float32 normals of the stream `seed` for elements 0..n-1 (Box-Muller on 24-bit uniforms)."""
    i = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = mix64(mix64(np.uint64(seed)) + GOLDEN * i)
    u1 = ((bits >> np.uint64(40)).astype(np.float32) + np.float32(1)) * np.float32(2.0 ** -24)
    u2 = ((bits >> np.uint64(16)) & np.uint64(0xFFFFFF)).astype(np.float32) * np.float32(2.0 ** -24)
    return (np.sqrt(np.float32(-2) * np.log(u1)) *
            np.cos(np.float32(6.2831853071795865) * u2)).astype(np.float32)


def micro_step_seed(random_seed, consumed_samples, rank=0):
    """The stream of the micro-step that starts after consumed_samples (all ranks)."""
    return int(mix64(mix64(np.uint64(random_seed)) ^
                     np.uint64((consumed_samples << 16) | rank)))


def neftune_noise(alpha, random_seed, consumed_samples, B, T, C, rank=0):
    """(B,T,C) noise astrai adds to the input embeddings of that micro-step."""
    z = counter_normal(micro_step_seed(random_seed, consumed_samples, rank), B * T * C)
    std = np.float32(alpha) / np.sqrt(np.float32(T))
    return (std * z).reshape(B, T, C)
