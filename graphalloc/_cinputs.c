/* The one conversion path's compiled half: what callers pass in, as int64 arrays, in C.
 *
 * graphalloc.inputs and graphalloc.plan.step are the specification (they accept, convert and
 * refuse with typed errors); this module is their fast path for the inputs an engine passes
 * every step, so that the Python between a caller and the planner is a fixed number of
 * calls whatever B is:
 *
 *   int64_list(seq)          a list, tuple or range of Python ints / numpy integers as a new
 *                            int64 array; None when an element is anything else (a bool, a
 *                            float, None, a nested sequence, an int past int64)
 *   normalize(step, n_reqs)  a Step (or the dict of a step's keywords) as its StepArrays, as
 *                            plan/step.py's normalize gives it (commit= is left to Python:
 *                            its deprecated form warns); None when any field is not a
 *                            plain form (None, a Python int or numpy integer, a list, tuple or
 *                            range of them, a 1-D int64 ndarray; pairs as a tuple or list),
 *                            or breaks a rule the normaliser checks (a row outside
 *                            [0, n_reqs), a negative count, a length mismatch, ...)
 *
 * None is never an answer about the input's validity: the caller then runs the Python path,
 * which accepts it (a CPU tensor, say) or raises the typed error with its message. So both
 * paths accept the same inputs and give the same arrays, and every error is the Python
 * path's. A 1-D int64 ndarray is passed on as it is (never copied, never written), as the
 * Python path does. No numpy headers: arrays are made with numpy.empty and filled through the
 * buffer protocol. Cost: O(elements) in C, no Python frame.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *ndarray_type, *np_integer, *np_empty, *int64_dtype;
static PyObject *step_type, *arrays_type, *EMPTY, *filled;  /* filled: value -> base array */

enum { N_KINDS = 16, N_OUT = 25 };
static const char *KINDS[N_KINDS] = {
    "take", "release", "accept", "commit", "trim", "evict", "evict_all", "advance", "drop",
    "drop_swa", "admit", "admit_on", "decode", "lookahead", "extend", "load_back"};
enum { K_TAKE, K_RELEASE, K_ACCEPT, K_COMMIT, K_TRIM, K_EVICT, K_EVICT_ALL, K_ADVANCE, K_DROP,
       K_DROP_SWA, K_ADMIT, K_ADMIT_ON, K_DECODE, K_LOOKAHEAD, K_EXTEND, K_LOAD_BACK };
static const char *FIELDS[N_OUT] = {
    "take_handle", "take_row", "take_tokens", "release", "commit_row", "commit_n", "trim_row",
    "trim_len", "evict", "evict_all", "advance_row", "advance_pos", "drop", "drop_swa", "admit",
    "admit_on_row", "admit_on_handle", "admit_on_tokens", "decode", "decode_n", "decode_spec",
    "extend_row", "extend_n", "load_row", "load_pos"};
static PyObject *kind_str[N_KINDS];

/* Conversion modes: rows (in [0, n_reqs)), handles (any int64), per-row counts (>= 0, one
 * int broadcast to n), per-row positions (any int64, one int broadcast to n). */
enum { M_ROWS, M_HANDLES, M_COUNTS, M_POSITIONS };

/* ---- arrays ------------------------------------------------------------------------------ */
static PyObject *new_int64(Py_ssize_t n, int64_t **data) {
    PyObject *arr = PyObject_CallFunction(np_empty, "nO", n, int64_dtype);
    if (!arr) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(arr, &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    *data = (int64_t *)v.buf;  /* the array owns the memory; the view is not kept */
    PyBuffer_Release(&v);
    return arr;
}

static int is_int64_fmt(const char *f) {
    if (!f) return 0;
    if (*f == '@' || *f == '=') f++;
#if PY_LITTLE_ENDIAN
    else if (*f == '<') f++;
#else
    else if (*f == '>') f++;
#endif
    return (f[0] == 'l' || f[0] == 'q') && !f[1];
}

/* One int: 1 (into *out), 0 (not a plain int: a bool, a float, an int past int64, ...),
 * -1 (an error). Plain: a Python int that is not a bool, or a numpy integer. */
static int scalar_int(PyObject *o, int64_t *out) {
    if (PyBool_Check(o)) return 0;
    int overflow = 0;
    if (PyLong_Check(o)) {
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (overflow) return 0;
        *out = v;
        return 1;
    }
    int is = PyObject_IsInstance(o, np_integer);
    if (is <= 0) return is;
    PyObject *idx = PyNumber_Index(o);
    if (!idx) return -1;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow) return 0;
    *out = v;
    return 1;
}

/* A list, tuple or range of plain ints as a new int64 array; FALLBACK (a new reference to
 * None) when an element is not plain. */
static PyObject *sequence_int64(PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int64_t *d;
    PyObject *arr = new_int64(n, &d);
    if (!arr) { Py_DECREF(fast); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = scalar_int(items[i], &d[i]);
        if (ok <= 0) {
            Py_DECREF(fast);
            Py_DECREF(arr);
            if (ok < 0) return NULL;
            Py_RETURN_NONE;
        }
    }
    Py_DECREF(fast);
    return arr;
}

static int is_sequence(PyObject *o) {
    return PyList_Check(o) || PyTuple_Check(o) || PyRange_Check(o);
}

/* ``n`` copies of ``value``: a read-only slice of a cached base array (as step._filled). */
static PyObject *filled_view(int64_t value, Py_ssize_t n) {
    PyObject *key = PyLong_FromLongLong(value);
    if (!key) return NULL;
    PyObject *base = PyDict_GetItemWithError(filled, key);  /* borrowed */
    if (!base && PyErr_Occurred()) { Py_DECREF(key); return NULL; }
    if (!base || PyObject_Length(base) < n) {
        Py_ssize_t old = base ? PyObject_Length(base) : 0;
        Py_ssize_t size = n > 2 * old ? n : 2 * old;
        if (size < 1024) size = 1024;
        int64_t *d;
        PyObject *arr = new_int64(size, &d);
        if (!arr) { Py_DECREF(key); return NULL; }
        for (Py_ssize_t i = 0; i < size; i++) d[i] = value;
        PyObject *flags = PyObject_GetAttrString(arr, "flags");
        int rc = flags ? PyObject_SetAttrString(flags, "writeable", Py_False) : -1;
        Py_XDECREF(flags);
        if (rc < 0 || PyDict_SetItem(filled, key, arr) < 0) {
            Py_DECREF(arr); Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(arr);
        base = PyDict_GetItem(filled, key);
    }
    Py_DECREF(key);
    return PySequence_GetSlice(base, 0, n);
}

/* ``obj`` converted by ``mode`` (``n``: the rows of a per-row mode); a new reference, FALLBACK
 * (a new reference to None) for the Python path, or NULL with an error. */
static PyObject *convert(PyObject *obj, int mode, Py_ssize_t n, long long n_reqs) {
    PyObject *arr = NULL;
    int per_row = mode == M_COUNTS || mode == M_POSITIONS;
    int64_t v;
    if (Py_IS_TYPE(obj, (PyTypeObject *)ndarray_type)) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        Py_ssize_t len = view.ndim == 1 ? view.shape[0] : -1;
        int ok = view.ndim == 1 && view.itemsize == 8 && is_int64_fmt(view.format) &&
                 (!per_row || len == n);
        if (ok && mode != M_HANDLES && mode != M_POSITIONS) {
            Py_ssize_t stride = view.strides ? view.strides[0] : 8;
            for (Py_ssize_t i = 0; i < len && ok; i++) {
                int64_t x = *(const int64_t *)((const char *)view.buf + i * stride);
                ok = mode == M_ROWS ? (x >= 0 && x < n_reqs) : x >= 0;
            }
        }
        PyBuffer_Release(&view);
        if (!ok) Py_RETURN_NONE;
        Py_INCREF(obj);
        return obj;
    }
    if (is_sequence(obj)) {
        if (PyObject_Length(obj) == 0 && !per_row) {
            Py_INCREF(EMPTY);
            return EMPTY;
        }
        arr = sequence_int64(obj);
        if (!arr || arr == Py_None) return arr;
        if (per_row && PyObject_Length(arr) != n) {
            Py_DECREF(arr);
            Py_RETURN_NONE;
        }
    } else {
        int ok = scalar_int(obj, &v);
        if (ok < 0) return NULL;
        if (!ok) Py_RETURN_NONE;
        if (per_row) {  /* one int for every row */
            Py_ssize_t m = n;
            int64_t *d;
            arr = new_int64(m, &d);
            if (!arr) return NULL;
            for (Py_ssize_t i = 0; i < m; i++) d[i] = v;
        } else {
            int64_t *d;
            arr = new_int64(1, &d);
            if (!arr) return NULL;
            d[0] = v;
        }
    }
    if (mode == M_ROWS || mode == M_COUNTS) {  /* the ranges the normaliser checks */
        Py_buffer view;
        if (PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS) < 0) { Py_DECREF(arr); return NULL; }
        const int64_t *d = view.buf;
        Py_ssize_t len = view.len / 8;
        int ok = 1;
        for (Py_ssize_t i = 0; i < len && ok; i++)
            ok = mode == M_ROWS ? (d[i] >= 0 && d[i] < n_reqs) : d[i] >= 0;
        PyBuffer_Release(&view);
        if (!ok) { Py_DECREF(arr); Py_RETURN_NONE; }
    }
    return arr;
}

/* A kind that names rows or handles: None (or, for handles, an empty sequence) is EMPTY. */
static PyObject *convert_named(PyObject *obj, int mode, long long n_reqs) {
    if (obj == Py_None) { Py_INCREF(EMPTY); return EMPTY; }
    return convert(obj, mode, 0, n_reqs);
}

/* A pair (or triple) given as a tuple or list of exactly ``n`` items: a borrowed item array,
 * or NULL (not one: the Python path refuses it). */
static PyObject **items_of(PyObject *obj, Py_ssize_t n) {
    if ((PyTuple_Check(obj) || PyList_Check(obj)) && PySequence_Fast_GET_SIZE(obj) == n)
        return PySequence_Fast_ITEMS(obj);
    return NULL;
}

static Py_ssize_t len_of(PyObject *arr) { return PyObject_Length(arr); }

/* A new int64 array of ``arr``'s values plus one (``arr``'s reference is taken over). */
static PyObject *plus_one(PyObject *arr) {
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_STRIDES) < 0) { Py_DECREF(arr); return NULL; }
    Py_ssize_t len = view.ndim == 1 ? view.shape[0] : 0;
    Py_ssize_t stride = view.strides ? view.strides[0] : 8;
    int64_t *d;
    PyObject *out = new_int64(len, &d);
    if (out)
        for (Py_ssize_t i = 0; i < len; i++)
            d[i] = *(const int64_t *)((const char *)view.buf + i * stride) + 1;
    PyBuffer_Release(&view);
    Py_DECREF(arr);
    return out;
}

static int any_below(PyObject *arr, int64_t limit) {
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_STRIDES) < 0) { PyErr_Clear(); return 1; }
    Py_ssize_t len = view.ndim == 1 ? view.shape[0] : 0;
    Py_ssize_t stride = view.strides ? view.strides[0] : 8;
    int below = 0;
    for (Py_ssize_t i = 0; i < len && !below; i++)
        below = *(const int64_t *)((const char *)view.buf + i * stride) < limit;
    PyBuffer_Release(&view);
    return below;
}

/* ---- normalize --------------------------------------------------------------------------- */
/* out[k] set for every field; returns 1 (done), 0 (the Python path decides), -1 (error). */
static int normalize_fields(PyObject *const *f, long long n_reqs, PyObject **out) {
#define CONV(slot, expr) do { PyObject *t_ = (expr); if (!t_) return -1; \
        if (t_ == Py_None) { Py_DECREF(t_); return 0; } out[slot] = t_; } while (0)
#define SET_EMPTY(slot) do { Py_INCREF(EMPTY); out[slot] = EMPTY; } while (0)
    PyObject **it;
    /* take (handles, rows, n_tokens) */
    if (f[K_TAKE] == Py_None) { SET_EMPTY(0); SET_EMPTY(1); SET_EMPTY(2); }
    else {
        if (!(it = items_of(f[K_TAKE], 3))) return 0;
        CONV(0, convert_named(it[0], M_HANDLES, n_reqs));
        CONV(1, convert_named(it[1], M_ROWS, n_reqs));
        if (len_of(out[0]) != len_of(out[1])) return 0;
        CONV(2, convert(it[2], M_COUNTS, len_of(out[1]), n_reqs));
    }
    CONV(3, convert_named(f[K_RELEASE], M_ROWS, n_reqs));
    /* the (rows, values) pairs: accept (commit_n = 1 + the accepted drafts), trim; commit=
     * is accept's deprecated form, left to the Python path (it warns, it counts differently) */
    if (f[K_COMMIT] != Py_None) return 0;
    static const int pair_kind[2] = {K_ACCEPT, K_TRIM};
    static const int pair_mode[2] = {M_COUNTS, M_POSITIONS};
    for (int p = 0; p < 2; p++) {
        int slot = 4 + 2 * p;
        if (f[pair_kind[p]] == Py_None) { SET_EMPTY(slot); SET_EMPTY(slot + 1); continue; }
        if (!(it = items_of(f[pair_kind[p]], 2))) return 0;
        CONV(slot, convert_named(it[0], M_ROWS, n_reqs));
        CONV(slot + 1, convert(it[1], pair_mode[p], len_of(out[slot]), n_reqs));
        if (pair_kind[p] == K_ACCEPT && !(out[slot + 1] = plus_one(out[slot + 1]))) return -1;
    }
    PyObject *ea = f[K_EVICT_ALL];
    if (ea != Py_True && ea != Py_False) return 0;
    if (PyBool_Check(f[K_EVICT])) return 0;
    CONV(8, convert_named(f[K_EVICT], M_ROWS, n_reqs));
    out[9] = PyLong_FromLong(ea == Py_True);
    if (!out[9]) return -1;
    if (f[K_ADVANCE] == Py_None) { SET_EMPTY(10); SET_EMPTY(11); }
    else {
        if (!(it = items_of(f[K_ADVANCE], 2))) return 0;
        CONV(10, convert_named(it[0], M_ROWS, n_reqs));
        CONV(11, convert(it[1], M_POSITIONS, len_of(out[10]), n_reqs));
    }
    CONV(12, convert_named(f[K_DROP], M_HANDLES, n_reqs));
    CONV(13, convert_named(f[K_DROP_SWA], M_HANDLES, n_reqs));
    CONV(14, convert_named(f[K_ADMIT], M_ROWS, n_reqs));
    /* admit_on (rows, handles, n_tokens: None = all, -1 each) */
    if (f[K_ADMIT_ON] == Py_None) { SET_EMPTY(15); SET_EMPTY(16); SET_EMPTY(17); }
    else {
        if (!(it = items_of(f[K_ADMIT_ON], 3))) return 0;
        CONV(15, convert_named(it[0], M_ROWS, n_reqs));
        CONV(16, convert_named(it[1], M_HANDLES, n_reqs));
        Py_ssize_t m = len_of(out[15]);
        if (len_of(out[16]) != m) return 0;
        if (it[2] == Py_None) {
            int64_t *d;
            PyObject *a = new_int64(m, &d);
            if (!a) return -1;
            for (Py_ssize_t i = 0; i < m; i++) d[i] = -1;
            out[17] = a;
        } else {
            CONV(17, convert(it[2], M_POSITIONS, m, n_reqs));
            if (any_below(out[17], -1)) return 0;
        }
    }
    /* decode (+ lookahead) */
    CONV(18, convert_named(f[K_DECODE], M_ROWS, n_reqs));
    Py_ssize_t nd = len_of(out[18]);
    PyObject *look = f[K_LOOKAHEAD];
    if (look == Py_None) {
        if (nd) {
            if (!(out[19] = filled_view(1, nd))) return -1;
            if (!(out[20] = filled_view(0, nd))) return -1;
        } else { SET_EMPTY(19); SET_EMPTY(20); }
    } else if (PyLong_CheckExact(look) && nd) {
        int overflow = 0;
        long long k = PyLong_AsLongLongAndOverflow(look, &overflow);
        if ((k == -1 && PyErr_Occurred())) return -1;
        if (overflow || k < -1 || k > 64) return 0;  /* (the Python path: per-row form) */
        if (!(out[19] = filled_view(1 + (k > 0 ? k : 0), nd))) return -1;
        if (!(out[20] = filled_view(k >= 0, nd))) return -1;
    } else return 0;  /* per-row lookahead, or one without decode rows: the Python path */
    if (f[K_EXTEND] == Py_None) { SET_EMPTY(21); SET_EMPTY(22); }
    else {
        if (!(it = items_of(f[K_EXTEND], 2))) return 0;
        CONV(21, convert_named(it[0], M_ROWS, n_reqs));
        CONV(22, convert(it[1], M_COUNTS, len_of(out[21]), n_reqs));
    }
    if (f[K_LOAD_BACK] == Py_None) { SET_EMPTY(23); SET_EMPTY(24); }
    else {
        if (!(it = items_of(f[K_LOAD_BACK], 2))) return 0;
        CONV(23, convert_named(it[0], M_ROWS, n_reqs));
        CONV(24, convert(it[1], M_POSITIONS, len_of(out[23]), n_reqs));
    }
    return 1;
#undef CONV
#undef SET_EMPTY
}

static PyObject *py_normalize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "normalize(step, n_reqs)");
    if (!arrays_type) return PyErr_Format(PyExc_RuntimeError, "normalize: bind() first");
    PyObject *step = args[0];
    long long n_reqs = PyLong_AsLongLong(args[1]);
    if (n_reqs == -1 && PyErr_Occurred()) return NULL;
    PyObject *f[N_KINDS];
    if (PyDict_CheckExact(step)) {  /* the keywords of alloc.step(**kinds) */
        Py_ssize_t found = 0;
        for (int k = 0; k < N_KINDS; k++) {
            PyObject *v = PyDict_GetItemWithError(step, kind_str[k]);
            if (!v && PyErr_Occurred()) return NULL;
            found += v != NULL;
            f[k] = v ? v : (k == K_EVICT_ALL ? Py_False : Py_None);
        }
        if (found != PyDict_GET_SIZE(step))  /* an unknown keyword: the Python path names it */
            Py_RETURN_NONE;
        for (int k = 0; k < N_KINDS; k++) Py_INCREF(f[k]);
    } else if (Py_IS_TYPE(step, (PyTypeObject *)step_type)) {
        for (int k = 0; k < N_KINDS; k++) {
            f[k] = PyObject_GetAttr(step, kind_str[k]);
            if (!f[k]) {
                for (int j = 0; j < k; j++) Py_DECREF(f[j]);
                return NULL;
            }
        }
    } else {
        Py_RETURN_NONE;
    }
    PyObject *out[N_OUT] = {NULL};
    int rc = normalize_fields(f, n_reqs, out);
    for (int k = 0; k < N_KINDS; k++) Py_DECREF(f[k]);
    PyObject *result = NULL;
    if (rc == 1) {
        PyObject *tuple = PyTuple_New(N_OUT);
        if (tuple) {
            for (int i = 0; i < N_OUT; i++) { PyTuple_SET_ITEM(tuple, i, out[i]); out[i] = NULL; }
            PyObject *targs = PyTuple_Pack(1, tuple);
            Py_DECREF(tuple);
            if (targs) {
                result = PyTuple_Type.tp_new((PyTypeObject *)arrays_type, targs, NULL);
                Py_DECREF(targs);
            }
        }
    } else if (rc == 0) {
        Py_INCREF(Py_None);
        result = Py_None;
    }
    for (int i = 0; i < N_OUT; i++) Py_XDECREF(out[i]);
    return result;
}

static PyObject *py_int64_list(PyObject *self, PyObject *seq) {
    if (!ndarray_type) return PyErr_Format(PyExc_RuntimeError, "int64_list: bind() first");
    if (!is_sequence(seq)) Py_RETURN_NONE;
    return sequence_int64(seq);
}

/* bind(ndarray, integer, empty, int64, Step, StepArrays, EMPTY): the types and callables the
 * conversions use; Step and StepArrays may be None (normalize then refuses to run). */
static PyObject *py_bind(PyObject *self, PyObject *args) {
    PyObject *nd, *integer, *empty, *dtype, *st, *sa, *e;
    if (!PyArg_ParseTuple(args, "OOOOOOO", &nd, &integer, &empty, &dtype, &st, &sa, &e))
        return NULL;
    Py_XSETREF(ndarray_type, Py_NewRef(nd));
    Py_XSETREF(np_integer, Py_NewRef(integer));
    Py_XSETREF(np_empty, Py_NewRef(empty));
    Py_XSETREF(int64_dtype, Py_NewRef(dtype));
    if (st != Py_None) {
        Py_XSETREF(step_type, Py_NewRef(st));
        Py_XSETREF(arrays_type, Py_NewRef(sa));
        Py_XSETREF(EMPTY, Py_NewRef(e));
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", py_bind, METH_VARARGS, "bind(ndarray, integer, empty, int64, Step, StepArrays, "
     "EMPTY)"},
    {"normalize", (PyCFunction)(void (*)(void))py_normalize, METH_FASTCALL,
     "normalize(step_or_keywords, n_reqs) -> StepArrays, or None: the Python path decides"},
    {"int64_list", py_int64_list, METH_O,
     "int64_list(seq) -> int64 array, or None when an element is not a plain int"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cinputs",
    "The conversion path's compiled half (see graphalloc/_cinputs.c).", -1, methods};

PyMODINIT_FUNC PyInit__cinputs(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    filled = PyDict_New();
    PyObject *kinds = PyTuple_New(N_KINDS), *fields = PyTuple_New(N_OUT);
    if (!filled || !kinds || !fields) goto fail;
    for (int k = 0; k < N_KINDS; k++) {
        kind_str[k] = PyUnicode_InternFromString(KINDS[k]);
        if (!kind_str[k]) goto fail;
        PyTuple_SET_ITEM(kinds, k, Py_NewRef(kind_str[k]));
    }
    for (int i = 0; i < N_OUT; i++) {
        PyObject *s = PyUnicode_FromString(FIELDS[i]);
        if (!s) goto fail;
        PyTuple_SET_ITEM(fields, i, s);
    }
    if (PyModule_AddObject(m, "KINDS", kinds) < 0) goto fail;
    kinds = NULL;
    if (PyModule_AddObject(m, "FIELDS", fields) < 0) goto fail;
    return m;
fail:
    Py_XDECREF(kinds);
    Py_XDECREF(fields);
    Py_DECREF(m);
    return NULL;
}
