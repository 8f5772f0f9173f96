"""SipHash-2-4 with a 128-bit output, in pure Python: the reference twin of the C page keys.

SipHash (Aumasson and Bernstein, 2012) is a keyed hash built from 64-bit additions,
rotations and xors; SipHash-c-d compresses each 8-byte little-endian word of the message
with c rounds and finalises with d rounds. The 128-bit output variant (the reference
implementation's ``SipHash128``) xors 0xee into v1 at start and into v2 before the first
finalisation, outputs ``v0 ^ v1 ^ v2 ^ v3``, xors 0xdd into v1, runs d rounds more and
outputs the second half. This is the spec written out; ``graphalloc/sharing/_ckeys.c`` is
the same function in C, and ``tests/planning/test_page_keys.py`` checks both against the
published test vectors (key ``00 01 .. 0f``, messages ``00 01 .. (n - 1)``, n = 0..63).

Why SipHash for page keys: a 128-bit keyed PRF with published vectors, short enough to
write from its description, and fast on short messages (a 16-token page is 18 words).
Its security claim needs a secret key; page keys use a FIXED public key (every replica
must compute the same keys), so here it is a well-mixed non-cryptographic hash: accidental
collisions are about 2^-64 after 2^32 pages, but tokens can be chosen to collide. The
multi-tenant mode (``key_hash="blake2b"``) is for deployments where that matters.

Cost: about 36 us per 144-byte message (a 16-token page) in Python; the C twin about
0.1 us (``benchmarks/bench_page_keys.py``).
"""

from __future__ import annotations

__all__ = ["siphash128"]

_MASK = (1 << 64) - 1


def _rounds(v0: int, v1: int, v2: int, v3: int, n: int) -> tuple[int, int, int, int]:
    m = _MASK
    for _ in range(n):
        v0 = (v0 + v1) & m
        v1 = ((v1 << 13) | (v1 >> 51)) & m
        v1 ^= v0
        v0 = ((v0 << 32) | (v0 >> 32)) & m
        v2 = (v2 + v3) & m
        v3 = ((v3 << 16) | (v3 >> 48)) & m
        v3 ^= v2
        v0 = (v0 + v3) & m
        v3 = ((v3 << 21) | (v3 >> 43)) & m
        v3 ^= v0
        v2 = (v2 + v1) & m
        v1 = ((v1 << 17) | (v1 >> 47)) & m
        v1 ^= v2
        v2 = ((v2 << 32) | (v2 >> 32)) & m
    return v0, v1, v2, v3


def siphash128(key: bytes, data: bytes) -> bytes:
    """SipHash-2-4 of ``data`` under the 16-byte ``key``, 128-bit output (16 bytes,
    little-endian halves). O(len(data)) Python integer operations."""
    if len(key) != 16:
        raise ValueError("the SipHash key must be 16 bytes")
    k0 = int.from_bytes(key[:8], "little")
    k1 = int.from_bytes(key[8:], "little")
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D ^ 0xEE
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    n = len(data)
    whole = n - n % 8
    for i in range(0, whole, 8):
        w = int.from_bytes(data[i:i + 8], "little")
        v3 ^= w
        v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 2)
        v0 ^= w
    last = int.from_bytes(data[whole:], "little") | ((n & 0xFF) << 56)
    v3 ^= last
    v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 2)
    v0 ^= last
    v2 ^= 0xEE
    v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 4)
    out0 = v0 ^ v1 ^ v2 ^ v3
    v1 ^= 0xDD
    v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 4)
    out1 = v0 ^ v1 ^ v2 ^ v3
    return out0.to_bytes(8, "little") + out1.to_bytes(8, "little")
