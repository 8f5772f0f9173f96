"""Page keys: the chained, salted key of every whole page of a token sequence.

Contract. Key j names page j's ``page_size`` token ids AND every page before it (the
chain), so equal keys mean equal whole prefixes, under the same salt and extra keys::

    root     = 16 zero bytes                       no salt (None or empty)
             = H(b"graphalloc.salt" || salt)       a salt (bytes, or str as UTF-8)
    key[j]   = H(key[j - 1] (root for j = 0) || page j's token ids as int64 little-endian
                 || encode(extra_keys[j]) when page j has extra keys)

A salt (vLLM's ``cache_salt``, SGLang's ``extra_key``: a tenant, a LoRA adapter) enters the
first page's key and through the chain every later one: two salts share no page. Extra
keys are per page (multimodal hashes of the pages an image covers, a LoRA id on every
page): ``extra_keys[j]`` is page j's (None: none); a value is bytes, str, int, or a
tuple / list of them, encoded with type tags and lengths (``("a", 1)`` and ``"a1"``
differ). An engine that sends no salt gets the root of zeros: every request without one
shares one namespace (docs/sharing.md says what to send for tenants).

H, ``key_hash``:

* ``"siphash"`` (default): SipHash-2-4 with a 128-bit output under the FIXED key
  :data:`SIPHASH_KEY`, so every process, rank and run computes the same keys (the replicas'
  digest covers them). In C (``graphalloc.sharing._ckeys``) when it is built, else its
  pure-Python twin (:mod:`graphalloc.sharing.siphash`, same bytes, warned once). Not
  cryptographic with a public key: tokens can be chosen to make two prefixes collide.
* ``"blake2b"``: BLAKE2b with a 16-byte digest (``hashlib``, personalised with the same
  16 bytes), for multi-tenant deployments whose users choose tokens: finding two prefixes
  with one key is then as hard as a BLAKE2b-128 collision (about 2^64 work).

Keys are computed once per request: pass the request's key list back as ``keys`` and only
the pages past it are hashed (:class:`RequestKeys` keeps one with its salt). An engine's
own block hashes (bytes) may stand in for keys: the chain goes on from the last one.

Cost (2-core x86-64, 16-token pages): siphash in C 80-175 ns a page plus about 0.5 us a
call; blake2b 0.8-1.9 us a page; the Python twin about 36 us a page.
``benchmarks/bench_page_keys.py`` measures them.
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np

from ..errors import ContractError
from .siphash import siphash128

__all__ = ["page_keys", "RequestKeys", "KEY_HASHES", "SIPHASH_KEY", "COMPILED",
           "PageKeysWarning", "check_key_hash", "encode_extra"]

KEY_HASHES = ("siphash", "blake2b")
SIPHASH_KEY = b"graphalloc-pages"  # 16 bytes, fixed: the same keys everywhere
_SALT_TAG = b"graphalloc.salt"
_ZERO_ROOT = bytes(16)


class PageKeysWarning(RuntimeWarning):
    """The compiled page keys could not be loaded; the pure-Python twin is used."""


try:
    from . import _ckeys
except ImportError as _exc:  # not built: the twin, same keys, much slower
    _ckeys = None
    warnings.warn(f"graphalloc: compiled page keys unavailable ({_exc}); hashing with the "
                  "pure-Python twin (same keys, hundreds of times slower): rebuild with "
                  "pip install -e .", PageKeysWarning, stacklevel=2)
COMPILED = _ckeys is not None


def check_key_hash(key_hash) -> str:
    if not isinstance(key_hash, str) or key_hash not in KEY_HASHES:
        raise ContractError(f"key_hash must be one of {KEY_HASHES}, got {key_hash!r}")
    return key_hash


def _hash(key_hash: str, data: bytes, compiled: bool = True) -> bytes:
    if key_hash == "siphash":
        fn = _ckeys.siphash128 if compiled and _ckeys is not None else siphash128
        return fn(SIPHASH_KEY, data)
    return hashlib.blake2b(data, digest_size=16, person=SIPHASH_KEY).digest()


_ROOTS: dict = {}  # (key_hash, salt bytes) -> root; tenants repeat, so a few entries


def _root(salt, key_hash: str, compiled: bool = True) -> bytes:
    if salt is None:
        return _ZERO_ROOT
    if isinstance(salt, str):
        salt = salt.encode()
    elif isinstance(salt, (bytes, bytearray, memoryview)):
        salt = bytes(salt)
    else:
        raise ContractError(f"salt must be bytes or str (or None), got "
                            f"{type(salt).__name__}")
    if not salt:
        return _ZERO_ROOT
    root = _ROOTS.get((key_hash, salt, compiled))
    if root is None:
        if len(_ROOTS) >= 4096:
            _ROOTS.clear()
        root = _ROOTS[(key_hash, salt, compiled)] = _hash(key_hash, _SALT_TAG + salt, compiled)
    return root


def encode_extra(value) -> bytes:
    """The bytes an extra key adds to its page's message: a type tag, a length, the
    payload; tuples and lists recursively. ``ContractError`` for other types. O(size)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return b"B" + len(data).to_bytes(8, "little") + data
    if isinstance(value, str):
        data = value.encode()
        return b"S" + len(data).to_bytes(8, "little") + data
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        v = int(value)
        if not -(1 << 127) <= v < (1 << 127):
            raise ContractError(f"an int extra key must fit in 128 bits, got {v}")
        return b"I" + v.to_bytes(16, "little", signed=True)
    if isinstance(value, (tuple, list)):
        return b"T" + len(value).to_bytes(8, "little") + b"".join(
            encode_extra(v) for v in value)
    raise ContractError(f"an extra key must be bytes, str, int or a tuple / list of them, "
                        f"got {type(value).__name__}")


def _extras(extra_keys, first: int, n_pages: int):
    """Pages ``[first, n_pages)``'s encoded extra keys, a list (None: none at all)."""
    if extra_keys is None:
        return None
    if isinstance(extra_keys, (str, bytes)) or not hasattr(extra_keys, "__getitem__"):
        raise ContractError("extra_keys must be a sequence with one entry per page (None "
                            f"for a page without), got {type(extra_keys).__name__}")
    part = list(extra_keys[first:n_pages])
    if not any(e is not None for e in part):
        return None
    out = [None if e is None else encode_extra(e) for e in part]
    return out + [None] * (n_pages - first - len(out))


def _token_array(token_ids, first: int, end: int) -> np.ndarray:
    """Tokens ``[first, end)`` as int64 (a typed error for anything but integers)."""
    if isinstance(token_ids, (list, tuple)):
        token_ids = token_ids[first:end]
        first, end = 0, len(token_ids)
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ContractError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    arr = arr[first:end]
    if arr.dtype.kind not in "biu" and not (arr.dtype.kind == "f" and arr.size == 0):
        raise ContractError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
        raise ContractError("token ids must fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _extend_twin(keys: list, tokens: np.ndarray, page_size: int, prev: bytes, extras,
                 key_hash: str, compiled: bool) -> None:
    """The reference: each page's message as bytes, hashed (module docstring)."""
    data = tokens.astype("<i8").tobytes()
    step = 8 * page_size
    new = []
    if key_hash == "blake2b" and extras is None:  # the common crypto case, inlined
        blake2b, person = hashlib.blake2b, SIPHASH_KEY
        for start in range(0, len(data), step):
            prev = blake2b(prev + data[start:start + step], digest_size=16,
                           person=person).digest()
            new.append(prev)
        keys.extend(new)
        return
    for j in range(len(tokens) // page_size):
        msg = prev + data[j * step:(j + 1) * step]
        if extras is not None and extras[j] is not None:
            msg += extras[j]
        prev = _hash(key_hash, msg, compiled)
        new.append(prev)
    keys.extend(new)


def page_keys(token_ids, page_size: int, keys: list | None = None, *, salt=None,
              extra_keys=None, key_hash: str = "siphash", compiled: bool = True
              ) -> list[bytes]:
    """The chained keys of the whole pages of ``token_ids`` (a partial last page has none).

    ``keys``: the request's keys of its first ``len(keys)`` pages, computed before (or an
    engine's own block hashes): extended IN PLACE to every whole page and returned; only
    the new pages are hashed, and ``salt`` is used only when ``keys`` is empty (it is in
    the chain already). ``salt``: bytes or str (None / empty: no salt). ``extra_keys``:
    one entry per page, by page index (module docstring). ``key_hash``: ``"siphash"`` or
    ``"blake2b"``. ``compiled=False`` forces the pure-Python twin (tests). A bad argument
    raises ``ContractError`` with ``keys`` unchanged. Cost: see the module docstring."""
    if keys is None:
        keys = []
    elif type(keys) is not list:
        raise ContractError(f"keys must be a list (the request's keys, extended in place), "
                            f"got {type(keys).__name__}")
    if isinstance(page_size, (bool, np.bool_)) or not isinstance(
            page_size, (int, np.integer)) or page_size < 1:
        raise ContractError(f"page_size must be an int >= 1, got {page_size!r}")
    if key_hash != "siphash":
        check_key_hash(key_hash)
    ps = int(page_size)
    first, n_pages = len(keys), len(token_ids) // ps
    if first and not isinstance(keys[-1], bytes):
        raise ContractError(f"keys must hold bytes (page keys or an engine's block hashes), "
                            f"got {type(keys[-1]).__name__}")
    prev = keys[-1] if first else _root(salt, key_hash, compiled)
    if n_pages <= first:
        return keys
    extras = _extras(extra_keys, first, n_pages)
    if key_hash == "siphash" and compiled and _ckeys is not None:
        tokens, start = token_ids, first * ps
        if type(tokens) is not list and type(tokens) is not tuple and not (
                type(tokens) is np.ndarray and tokens.dtype == np.int64
                and tokens.ndim == 1 and tokens.flags.c_contiguous):
            tokens, start = _token_array(token_ids, start, n_pages * ps), 0
        try:
            _ckeys.extend(keys, tokens, start, n_pages - first, ps, prev, SIPHASH_KEY,
                          extras)
        except TypeError:  # a list item that is not an exact int: numpy decides
            _ckeys.extend(keys, _token_array(token_ids, start, n_pages * ps), 0,
                          n_pages - first, ps, prev, SIPHASH_KEY, extras)
        except OverflowError:
            raise ContractError("token ids must fit in int64") from None
        return keys
    _extend_twin(keys, _token_array(token_ids, first * ps, n_pages * ps), ps, prev, extras,
                 key_hash, compiled)
    return keys


class RequestKeys:
    """One request's page keys for its life: made with its salt, extra keys and hash,
    extended as its tokens grow (:meth:`update`), so each page is hashed once, as an
    engine keeps a request's block hashes. ``keys`` is the list (shared with the caller:
    pass it as ``keys=`` to :meth:`PrefixCache.match` / ``insert``). O(1) to make."""

    __slots__ = ("keys", "page_size", "salt", "extra_keys", "key_hash")

    def __init__(self, page_size: int, *, salt=None, extra_keys=None,
                 key_hash: str = "siphash", keys: list | None = None):
        _root(salt, check_key_hash(key_hash))  # a bad salt is refused here
        self.page_size, self.salt, self.extra_keys = page_size, salt, extra_keys
        self.key_hash = key_hash
        self.keys = [] if keys is None else keys

    def update(self, token_ids) -> list[bytes]:
        """The keys of every whole page of ``token_ids`` (the request's tokens so far, the
        same first tokens as before): only the new pages are hashed. Returns ``keys``."""
        return page_keys(token_ids, self.page_size, self.keys, salt=self.salt,
                         extra_keys=self.extra_keys, key_hash=self.key_hash)

    def same_namespace(self, salt, extra_keys) -> bool:
        """Whether a call's ``salt`` / ``extra_keys`` are the ones these keys were made
        with (a request keeps its namespace for life). O(1) for the usual values."""
        return _same(self.salt, salt) and (self.extra_keys is extra_keys
                                           or self.extra_keys == extra_keys)


def _same(a, b) -> bool:
    if not a and not b:
        return True
    if isinstance(a, str):
        a = a.encode()
    if isinstance(b, str):
        b = b.encode()
    return a == b
