/* Page keys in C: the compiled twin of graphalloc/sharing/page_keys.py's reference.
 *
 * One page's key is SipHash-2-4 with its 128-bit output (Aumasson and Bernstein, 2012;
 * the "SipHash128" variant of the reference implementation), under a fixed 16-byte key,
 * over the page's message:
 *
 *     prev key (its bytes) || the page's token ids, each an int64 in little-endian order
 *                          || the page's extra bytes (none when it has no extra keys)
 *
 * prev is the previous page's key (the chain); for page 0 the request's root (16 zero bytes,
 * or the salt's key). Both twins are compared byte for byte by
 * tests/planning/test_page_keys.py, and this one against the published SipHash-2-4-128 test
 * vectors. No numpy headers: lists and tuples of ints are read item by item, arrays through
 * the buffer protocol (int64, C-contiguous).
 *
 * Cost: about 2 + 2 ceil(n_bytes / 8) + 8 SipRounds a page (n_bytes = 16 + 8 page_size for a
 * page without extras), plus one PyBytes per key; nothing is appended to `out` unless every
 * page was hashed (a bad token raises first).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))

typedef struct {
    uint64_t v0, v1, v2, v3;
    uint64_t tail;   /* bytes absorbed since the last whole word, little-endian */
    unsigned ntail;  /* how many (0..7) */
    uint64_t len;    /* bytes absorbed */
} Sip;

#define SIPROUND(s)                                                                         \
    do {                                                                                    \
        (s)->v0 += (s)->v1; (s)->v1 = ROTL((s)->v1, 13); (s)->v1 ^= (s)->v0;                \
        (s)->v0 = ROTL((s)->v0, 32);                                                        \
        (s)->v2 += (s)->v3; (s)->v3 = ROTL((s)->v3, 16); (s)->v3 ^= (s)->v2;                \
        (s)->v0 += (s)->v3; (s)->v3 = ROTL((s)->v3, 21); (s)->v3 ^= (s)->v0;                \
        (s)->v2 += (s)->v1; (s)->v1 = ROTL((s)->v1, 17); (s)->v1 ^= (s)->v2;                \
        (s)->v2 = ROTL((s)->v2, 32);                                                        \
    } while (0)

static inline uint64_t load64_le(const unsigned char *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store64_le(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void sip_init(Sip *s, uint64_t k0, uint64_t k1) {
    s->v0 = k0 ^ 0x736f6d6570736575ULL;
    s->v1 = k1 ^ 0x646f72616e646f6dULL ^ 0xeeULL; /* 0xee: the 128-bit output variant */
    s->v2 = k0 ^ 0x6c7967656e657261ULL;
    s->v3 = k1 ^ 0x7465646279746573ULL;
    s->tail = 0;
    s->ntail = 0;
    s->len = 0;
}

static inline void sip_compress(Sip *s, uint64_t m) { /* c = 2 rounds a word */
    s->v3 ^= m;
    SIPROUND(s);
    SIPROUND(s);
    s->v0 ^= m;
}

/* One 8-byte word (the little-endian value of its bytes). */
static inline void sip_word(Sip *s, uint64_t m) {
    if (s->ntail == 0) {
        sip_compress(s, m);
    } else { /* unaligned (a previous key whose length is not a multiple of 8) */
        unsigned shift = 8 * s->ntail;
        sip_compress(s, s->tail | (m << shift));
        s->tail = m >> (64 - shift);
    }
    s->len += 8;
}

static void sip_bytes(Sip *s, const unsigned char *p, size_t n) {
    while (n && s->ntail) {
        s->tail |= (uint64_t)*p++ << (8 * s->ntail);
        s->len++;
        n--;
        if (++s->ntail == 8) {
            sip_compress(s, s->tail);
            s->tail = 0;
            s->ntail = 0;
        }
    }
    for (; n >= 8; n -= 8, p += 8) {
        sip_compress(s, load64_le(p));
        s->len += 8;
    }
    while (n--) {
        s->tail |= (uint64_t)*p++ << (8 * s->ntail++);
        s->len++;
    }
}

static void sip_final128(Sip *s, unsigned char out[16]) {
    sip_compress(s, s->tail | ((s->len & 0xffULL) << 56));
    s->v2 ^= 0xeeULL;
    for (int i = 0; i < 4; i++) SIPROUND(s); /* d = 4 rounds */
    store64_le(out, s->v0 ^ s->v1 ^ s->v2 ^ s->v3);
    s->v1 ^= 0xddULL;
    for (int i = 0; i < 4; i++) SIPROUND(s);
    store64_le(out + 8, s->v0 ^ s->v1 ^ s->v2 ^ s->v3);
}

static int read_key(PyObject *key, uint64_t *k0, uint64_t *k1) {
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != 16) {
        PyErr_SetString(PyExc_ValueError, "the SipHash key must be 16 bytes");
        return -1;
    }
    const unsigned char *k = (const unsigned char *)PyBytes_AS_STRING(key);
    *k0 = load64_le(k);
    *k1 = load64_le(k + 8);
    return 0;
}

/* siphash128(key, data) -> 16 bytes: SipHash-2-4, 128-bit output. */
static PyObject *py_siphash128(PyObject *self, PyObject *args) {
    PyObject *key;
    Py_buffer data;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oy*", &key, &data)) return NULL;
    uint64_t k0, k1;
    if (read_key(key, &k0, &k1) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    Sip s;
    unsigned char out[16];
    sip_init(&s, k0, k1);
    sip_bytes(&s, (const unsigned char *)data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    sip_final128(&s, out);
    return PyBytes_FromStringAndSize((const char *)out, 16);
}

/* extend(out, tokens, start, n_pages, page_size, prev, key, extras) -> None
 *
 * Appends to the list `out` the keys of the n_pages pages of `tokens` that begin at token
 * `start` (page i: tokens [start + i page_size, start + (i + 1) page_size)), chained from
 * `prev` (bytes). `tokens`: a list or tuple of exact ints (each within int64; anything
 * else, a numpy integer included, is a TypeError: the caller converts), or a C-contiguous
 * int64 buffer. `extras`: None, or a list of n_pages entries, each None or bytes (page i's
 * extra bytes). TypeError / OverflowError / ValueError on bad input, with `out` unchanged. */
static PyObject *py_extend(PyObject *self, PyObject *args) {
    PyObject *out, *tokens, *prev, *key, *extras;
    Py_ssize_t start, n_pages, page_size;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!OnnnSSO", &PyList_Type, &out, &tokens, &start, &n_pages,
                          &page_size, &prev, &key, &extras))
        return NULL;
    uint64_t k0, k1;
    if (read_key(key, &k0, &k1) < 0) return NULL;
    if (start < 0 || n_pages < 0 || page_size < 1) {
        PyErr_SetString(PyExc_ValueError, "extend: start, n_pages >= 0 and page_size >= 1");
        return NULL;
    }
    if (extras != Py_None && (!PyList_Check(extras) || PyList_GET_SIZE(extras) != n_pages)) {
        PyErr_SetString(PyExc_ValueError, "extend: extras must be None or a list of one "
                        "entry (None or bytes) per page");
        return NULL;
    }
    if (extras != Py_None) {
        for (Py_ssize_t i = 0; i < n_pages; i++) {
            PyObject *e = PyList_GET_ITEM(extras, i);
            if (e != Py_None && !PyBytes_Check(e)) {
                PyErr_SetString(PyExc_TypeError, "extend: an extras entry is not bytes");
                return NULL;
            }
        }
    }
    Py_ssize_t end = start + n_pages * page_size;
    PyObject *seq = NULL;
    PyObject **items = NULL;
    const int64_t *words = NULL;
    Py_buffer view;
    view.obj = NULL;
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        seq = tokens; /* borrowed: not resized while we hold the GIL and call no Python */
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (end > n) {
            PyErr_Format(PyExc_ValueError, "extend: %zd tokens, pages need %zd", n, end);
            return NULL;
        }
        items = PySequence_Fast_ITEMS(seq);
    } else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return NULL;
        const char *f = view.format ? view.format : "B";
        if (*f == '@' || *f == '=' || *f == '<') f++;
        if (view.itemsize != 8 || !(f[0] == 'q' || f[0] == 'l') || f[1]) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "extend: tokens must be a list, a tuple or a "
                            "C-contiguous int64 buffer");
            return NULL;
        }
        if (end > view.len / 8) {
            Py_ssize_t n = view.len / 8;
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "extend: %zd tokens, pages need %zd", n, end);
            return NULL;
        }
        words = (const int64_t *)view.buf;
    }
    unsigned char *keys = PyMem_Malloc(n_pages > 0 ? (size_t)n_pages * 16 : 1);
    if (!keys) {
        if (view.obj) PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(prev);
    Py_ssize_t p_len = PyBytes_GET_SIZE(prev);
    for (Py_ssize_t i = 0; i < n_pages; i++) {
        Sip s;
        sip_init(&s, k0, k1);
        if (p_len == 16) { /* the common case: one of our keys, two aligned words */
            sip_compress(&s, load64_le(p));
            sip_compress(&s, load64_le(p + 8));
            s.len = 16;
        } else {
            sip_bytes(&s, p, (size_t)p_len);
        }
        Py_ssize_t t0 = start + i * page_size;
        if (items) {
            for (Py_ssize_t t = t0; t < t0 + page_size; t++) {
                PyObject *it = items[t];
                if (!PyLong_CheckExact(it)) { /* converting it could run Python code */
                    PyMem_Free(keys);
                    PyErr_Format(PyExc_TypeError, "token %zd is not an int", t);
                    return NULL;
                }
                long long v = PyLong_AsLongLong(it);
                if (v == -1 && PyErr_Occurred()) { /* past int64 */
                    PyMem_Free(keys);
                    return NULL;
                }
                sip_word(&s, (uint64_t)v);
            }
        } else {
            for (Py_ssize_t t = t0; t < t0 + page_size; t++) sip_word(&s, (uint64_t)words[t]);
        }
        if (extras != Py_None) {
            PyObject *e = PyList_GET_ITEM(extras, i);
            if (e != Py_None)
                sip_bytes(&s, (const unsigned char *)PyBytes_AS_STRING(e),
                          (size_t)PyBytes_GET_SIZE(e));
        }
        sip_final128(&s, keys + 16 * i);
        p = keys + 16 * i;
        p_len = 16;
    }
    if (view.obj) PyBuffer_Release(&view);
    /* every page hashed: now the list grows (a failure here leaves the keys made so far,
     * each a whole page's key: the chain stays a prefix) */
    for (Py_ssize_t i = 0; i < n_pages; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)keys + 16 * i, 16);
        if (!b || PyList_Append(out, b) < 0) {
            Py_XDECREF(b);
            PyMem_Free(keys);
            return NULL;
        }
        Py_DECREF(b);
    }
    PyMem_Free(keys);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"siphash128", py_siphash128, METH_VARARGS,
     "siphash128(key, data) -> bytes: SipHash-2-4 with a 128-bit output (16-byte key)."},
    {"extend", py_extend, METH_VARARGS,
     "extend(out, tokens, start, n_pages, page_size, prev, key, extras): append the chained "
     "keys of n_pages pages to the list out (see graphalloc.sharing.page_keys)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "graphalloc.sharing._ckeys",
    "Page keys in C (SipHash-2-4-128, chained); the twin of graphalloc.sharing.page_keys's "
    "reference.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ckeys(void) { return PyModule_Create(&module); }
