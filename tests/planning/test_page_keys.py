"""Page keys (graphalloc.sharing.page_keys): the hash against its published vectors, the C
twin against the Python reference byte for byte, the chain written out from its definition,
salts and extra keys, one hashing per page, refusals, and the same keys in every process."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphalloc as ga
from graphalloc.sharing import page_keys as pk
from graphalloc.sharing.page_keys import RequestKeys, encode_extra, page_keys
from graphalloc.sharing.siphash import siphash128

needs_c = pytest.mark.skipif(not pk.COMPILED, reason="graphalloc.sharing._ckeys not built")

# SipHash-2-4, 128-bit output: the reference implementation's published vectors
# (vectors_sip128: key 00 01 .. 0f, message 00 01 .. (n - 1) for n = 0..63).
SIP128_VECTORS = (
    "a3817f04ba25a8e66df67214c7550293", "da87c1d86b99af44347659119b22fc45",
    "8177228da4a45dc7fca38bdef60affe4", "9c70b60c5267a94e5f33b6b02985ed51",
    "f88164c12d9c8faf7d0f6e7c7bcd5579", "1368875980776f8854527a07690e9627",
    "14eeca338b208613485ea0308fd7a15e", "a1f1ebbed8dbc153c0b84aa61ff08239",
    "3b62a9ba6258f5610f83e264f31497b4", "264499060ad9baabc47f8b02bb6d71ed",
    "00110dc378146956c95447d3f3d0fbba", "0151c568386b6677a2b4dc6f81e5dc18",
    "d626b266905ef35882634df68532c125", "9869e247e9c08b10d029934fc4b952f7",
    "31fcefac66d7de9c7ec7485fe4494902", "5493e99933b0a8117e08ec0f97cfc3d9",
    "6ee2a4ca67b054bbfd3315bf85230577", "473d06e8738db89854c066c47ae47740",
    "a426e5e423bf4885294da481feaef723", "78017731cf65fab074d5208952512eb1",
    "9e25fc833f2290733e9344a5e83839eb", "568e495abe525a218a2214cd3e071d12",
    "4a29b54552d16b9a469c10528eff0aae", "c9d184ddd5a9f5e0cf8ce29a9abf691c",
    "2db479ae78bd50d8882a8a178a6132ad", "8ece5f042d5e447b5051b9eacb8d8f6f",
    "9c0b53b4b3c307e87eaee08678141f66", "abf248af69a6eae4bfd3eb2f129eeb94",
    "0664da1668574b88b935f3027358aef4", "aa4b9dc4bf337de90cd4fd3c467c6ab7",
    "ea5c7f471faf6bde2b1ad7d4686d2287", "2939b0183223fafc1723de4f52c43d35",
    "7c3956ca5eeafc3e363e9d556546eb68", "77c6077146f01c32b6b69d5f4ea9ffcf",
    "37a6986cb8847edf0925f0f1309b54de", "a705f0e69da9a8f907241a2e923c8cc8",
    "3dc47d1f29c448461e9e76ed904f6711", "0d62bf01e6fc0e1a0d3c4751c5d3692b",
    "8c03468bca7c669ee4fd5e084bbee7b5", "528a5bb93baf2c9c4473cce5d0d22bd9",
    "df6a301e95c95dad97ae0cc8c6913bd8", "801189902c857f39e73591285e70b6db",
    "e617346ac9c231bb3650ae34ccca0c5b", "27d93437efb721aa401821dcec5adf89",
    "89237d9ded9c5e78d8b1c9b166cc7342", "4a6d8091bf5e7d651189fa94a250b14c",
    "0e33f96055e7ae893ffc0e3dcf492902", "e61c432b720b19d18ec8d84bdc63151b",
    "f7e5aef549f782cf379055a608269b16", "438d030fd0b7a54fa837f2ad201a6403",
    "a590d3ee4fbf04e3247e0d27f286423f", "5fe2c1a172fe93c4b15cd37caef9f538",
    "2c97325cbd06b36eb2133dd08b3a017c", "92c814227a6bca949ff0659f002ad39e",
    "dce850110bd8328cfbd50841d6911d87", "67f14984c7da791248e32bb5922583da",
    "1938f2cf72d54ee97e94166fa91d2a36", "74481e9646ed49fe0f6224301604698e",
    "57fca5de98a9d6d8006438d0583d8a1d", "9fecde1cefdc1cbed4763674d9575359",
    "e3040c00eb28f15366ca73cbd872e740", "7697009a6a831dfecca91c5993670f7a",
    "5853542321f567a005d547a4f04759bd", "5150d1772f50834a503e069a973fbd7c",
)
VECTOR_KEY = bytes(range(16))


def _hashers():
    out = [("python", siphash128)]
    if pk.COMPILED:
        out.append(("c", pk._ckeys.siphash128))
    return out


@pytest.mark.parametrize("name,fn", _hashers())
def test_siphash128_matches_the_published_vectors(name, fn):
    assert len(SIP128_VECTORS) == 64
    for n, expected in enumerate(SIP128_VECTORS):
        assert fn(VECTOR_KEY, bytes(range(n))).hex() == expected, (name, n)


def _spec_keys(tokens, ps, *, salt=None, extra=None, h="siphash"):
    """The chain as the module docstring defines it, one message at a time."""
    def H(data):
        if h == "siphash":
            return siphash128(b"graphalloc-pages", data)
        return hashlib.blake2b(data, digest_size=16, person=b"graphalloc-pages").digest()

    if isinstance(salt, str):
        salt = salt.encode()
    prev = H(b"graphalloc.salt" + salt) if salt else bytes(16)
    keys = []
    for j in range(len(tokens) // ps):
        msg = prev + b"".join(int(t).to_bytes(8, "little", signed=True)
                              for t in tokens[j * ps:(j + 1) * ps])
        if extra is not None and j < len(extra) and extra[j] is not None:
            msg += encode_extra(extra[j])
        prev = H(msg)
        keys.append(prev)
    return keys


@pytest.mark.parametrize("h", ["siphash", "blake2b"])
def test_keys_are_the_chain_of_the_definition(h):
    tokens = [5, -1, 2**63 - 1, -(2**63), 0, 7, 7, 7, 1, 2, 3]
    for salt in (None, b"tenant-a", "tenant-a"):
        for extra in (None, [None, ("img", 3)], [b"x", None, 12]):
            for ps in (1, 3, 4):
                got = page_keys(tokens, ps, salt=salt, extra_keys=extra, key_hash=h)
                assert got == _spec_keys(tokens, ps, salt=salt, extra=extra, h=h)
                twin = page_keys(np.array(tokens), ps, salt=salt, extra_keys=extra,
                                 key_hash=h, compiled=False)
                assert twin == got


@needs_c
@settings(max_examples=150, deadline=None)
@given(st.integers(1, 17), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=90),
       st.one_of(st.none(), st.binary(max_size=40), st.text(max_size=12)),
       st.lists(st.one_of(st.none(), st.binary(max_size=20), st.integers(-5, 10**30),
                          st.tuples(st.text(max_size=4), st.integers(0, 9))), max_size=8),
       st.binary(min_size=1, max_size=40), st.integers(0, 90))
def test_compiled_keys_equal_the_python_twin_byte_for_byte(ps, tokens, salt, extra, prev,
                                                           cut):
    extra = extra or None
    c_list = page_keys(tokens, ps, salt=salt, extra_keys=extra)
    assert c_list == page_keys(tuple(tokens), ps, salt=salt, extra_keys=extra)
    assert c_list == page_keys(np.array(tokens, dtype=np.int64), ps, salt=salt,
                               extra_keys=extra)
    assert c_list == page_keys(tokens, ps, salt=salt, extra_keys=extra, compiled=False)
    # from an engine's own hashes of any length (the chain goes on from them, unaligned)
    assert page_keys(tokens, ps, [prev]) == page_keys(tokens, ps, [prev], compiled=False)
    # incremental: the keys of a prefix, extended, are the keys of the whole
    kept = page_keys(tokens[:cut], ps, salt=salt, extra_keys=extra)
    assert page_keys(tokens, ps, kept, salt=salt, extra_keys=extra) is kept and kept == c_list


def test_each_page_is_hashed_once_and_the_chain_goes_on_from_the_keys_given():
    tokens = list(range(40))
    keys = page_keys(tokens[:17], 4)  # 4 pages
    assert len(keys) == 4
    forged = [b"\x01" * 16] * 4  # earlier pages are never hashed again: the chain goes on
    assert page_keys(tokens, 4, list(forged))[4:] == _chain_from(b"\x01" * 16, tokens[16:], 4)
    assert page_keys(tokens, 4, keys) is keys and keys == page_keys(tokens, 4)
    assert page_keys(tokens[:3], 4, keys) is keys and len(keys) == 10  # fewer tokens: as is


def _chain_from(prev, tokens, ps):
    out = []
    for j in range(len(tokens) // ps):
        prev = siphash128(b"graphalloc-pages", prev + np.array(
            tokens[j * ps:(j + 1) * ps], dtype="<i8").tobytes())
        out.append(prev)
    return out


def test_salts_and_extra_keys_separate_namespaces():
    tokens = list(range(64))
    plain = page_keys(tokens, 16)
    assert page_keys(tokens, 16, salt=b"") == page_keys(tokens, 16, salt=None) == plain
    a, b = page_keys(tokens, 16, salt="tenant-a"), page_keys(tokens, 16, salt="tenant-b")
    assert a == page_keys(tokens, 16, salt=b"tenant-a")  # str is its UTF-8 bytes
    assert not set(a) & set(b) and not set(a) & set(plain)  # no page key in common
    # an extra key of page 2 changes page 2's key and every later one, not earlier ones
    extra = page_keys(tokens, 16, extra_keys=[None, None, "image-7"])
    assert extra[:2] == plain[:2] and not set(extra[2:]) & set(plain)
    assert page_keys(tokens, 16, extra_keys=[None, None, "image-8"])[2:] != extra[2:]
    # tagged encodings: a structure and its flattening differ
    assert encode_extra(("a", 1)) != encode_extra("a1") != encode_extra(b"a1")
    assert encode_extra([1, 2]) == encode_extra((1, 2)) != encode_extra((1, (2,)))
    assert page_keys(tokens, 16, key_hash="blake2b") != plain


def test_bad_input_is_refused_with_the_keys_unchanged():
    keys = page_keys(list(range(8)), 4)
    before = list(keys)
    for call in (
            lambda: page_keys([1, 2, 3, 4.5] * 3, 4, keys),
            lambda: page_keys(list(range(8)) + [2**64] * 4, 4, keys),
            lambda: page_keys(np.arange(12.0), 4, keys),
            lambda: page_keys(list(range(12)), 4, keys, extra_keys=[None, None, object()]),
            lambda: page_keys(list(range(12)), 4, keys, extra_keys="abc"),
            lambda: page_keys(list(range(12)), 0, keys),
            lambda: page_keys(list(range(12)), 4, keys, key_hash="md5"),
            lambda: page_keys(list(range(12)), 4, tuple(keys)),
            lambda: page_keys(list(range(12)), 4, [1, 2]),
            lambda: page_keys(list(range(12)), 4, salt=3),
            lambda: RequestKeys(4, salt=3.0)):
        with pytest.raises(ga.ContractError):
            call()
        assert keys == before
    # numpy integers and bools in a list are ints: converted, same keys
    assert page_keys([np.int64(v) for v in range(12)], 4) == page_keys(list(range(12)), 4)
    assert page_keys([True, False] * 4, 4) == page_keys([1, 0] * 4, 4)


def test_request_keys_keep_their_namespace_and_hash_only_new_pages():
    rk = RequestKeys(4, salt="t1")
    assert rk.update(list(range(10))) is rk.keys and len(rk.keys) == 2
    rk.update(list(range(17)))
    assert rk.keys == page_keys(list(range(17)), 4, salt="t1")
    assert rk.same_namespace(b"t1", None) and not rk.same_namespace("t2", None)
    assert RequestKeys(4).same_namespace(b"", None)


_CHILD = (
    "import sys; from graphalloc.sharing.page_keys import page_keys; "
    "sys.stdout.write(b''.join(page_keys(list(range(300)), 16, salt='s') + "
    "page_keys(list(range(64)), 4, key_hash='blake2b')).hex())")


def test_every_process_computes_the_same_keys():
    """The key is fixed: other interpreters (other hash seeds; one with the pure-Python
    twin forced) give these bytes (what replicas rely on: they digest the keys)."""
    here = b"".join(page_keys(list(range(300)), 16, salt="s")
                    + page_keys(list(range(64)), 4, key_hash="blake2b")).hex()
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        assert out == here


def test_the_allocator_takes_a_page_key_hash_or_a_bool():
    cfg = ga.AllocatorConfig(page_size=4, num_full_pages=32, num_swa_pages=32, max_reqs=4,
                             max_context_len=64, model_window=64, max_handles=4)
    assert ga.HybridAllocator(cfg, prefix_cache=True).prefix_cache.key_hash == "siphash"
    assert ga.HybridAllocator(cfg, prefix_cache="blake2b").prefix_cache.key_hash == "blake2b"
    assert ga.HybridAllocator(cfg, prefix_cache=False).prefix_cache is None
    for bad in ("md5", 1, None, "BLAKE2B"):
        with pytest.raises(ga.ConfigError, match="prefix_cache"):
            ga.HybridAllocator(cfg, prefix_cache=bad)
