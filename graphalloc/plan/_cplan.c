/* The compiled planner: the hot scheduler step planned in C, over the ledger's own arrays.
 *
 * The contract, its rules and why it is C are in graphalloc/fast_plan.py (the wrapper).
 * This file mirrors, operation by operation, the numpy planner (graphalloc/planner.py,
 * graphalloc/release_rows.py, graphalloc/references.py:drop_actions); every comment that
 * names a numpy function says which part it mirrors. The numpy planner is the reference:
 * tests/test_compiled_planner.py compares the two byte for byte.
 *
 * One call, Planner.step(...), plans one step in three phases:
 *   A  validate every input rule that needs no page mirror (rows live and once, commit
 *      counts within the oldest speculative step, trim lengths within [f + W, L], frontier
 *      moves aligned / forward / inside the committed pages, lengths, speculative steps in
 *      flight, frozen shapes of the allocation side, ring spans); nothing is written, the
 *      lengths a commit / trim leaves are staged (st_seq, st_comm, st_spec) for the rules
 *      after it. Any doubt: return None.
 *   B  the frees (release, commit, trim, evict, advance), written in place into the ledger and page-mirror
 *      arrays and as release rows into the pinned descriptor buffer. What a free gives back
 *      depends on reference counts the same frees change (a page two released rows share),
 *      so the checks that need it (capacity, max_release_rows, max_step_pages) run here;
 *      every write of this phase goes through an undo log, and a refusal rolls it back and
 *      zeroes the rows written before returning None.
 *   C  the allocations (decode with or without lookahead, extend): cannot fail (phase A and
 *      B checked everything).
 * None means "not planned, nothing changed": the caller runs the numpy planner, which plans
 * the step or raises its precise typed error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- the device ABI (kernels/abi.py; checked against it at import by fast_plan.py) ---- */
#define ROW_WIDTH 8
enum { REL_REQ, REL_START_POS, REL_N_PAGES, REL_FLAGS, REL_SWA_PUSH, REL_FULL_PUSH, REL_LANE,
       REL_EPOCH };
enum { AL_REQ, AL_START_POS, AL_N_TOKENS, AL_FULL_POP, AL_SWA_POP, AL_OUT, AL_FLAGS,
       AL_N_PAGES };
#define REL_SWA 1
#define REL_FULL 2
#define REL_CLEAR 4
#define REL_RING_RETURN 8
#define AL_RING 1
/* graphalloc/references.py */
#define ACT_NONE 0
#define ACT_FULL 1
#define ACT_SWA 2
#define ACT_BOTH 3

/* Why a step was not planned here (Planner.last_refusal; the numpy planner then runs). */
enum {
    R_NONE = 0, R_INPUT = 1, R_ROWS = 2, R_POSITIONS = 3, R_LENGTH = 4, R_SPECULATIVE = 5,
    R_RING = 6, R_SHAPE = 7, R_CAPACITY = 8, R_MIRROR = 9, R_UNBOUND = 10
};

/* per-row marks of one step */
#define F_REL 1
#define F_EV 2
#define F_ADV 4
#define F_DEC 8
#define F_EXT 16
#define F_COM 32    /* committed in this step */
#define F_TRIM 64   /* trimmed in this step */
#define F_CUT 128   /* a commit or trim dropped pages of its tail (release_rows._cut) */
#define F_STG (F_COM | F_TRIM)  /* lengths staged in st_seq / st_comm / st_spec */
#define N_ARGS 12
#define MAX_SPEC 4  /* speculative steps in flight the staging holds (Ledger.SPEC_DEPTH: 2) */

typedef struct { void *p; int64_t old; int size; } UndoEntry;

/* One integer argument: rows, counts or positions. */
typedef struct {
    const int64_t *v;
    Py_ssize_t n;
    int present;   /* not None */
    int scalar;    /* a Python int: broadcast to the rows where the numpy planner does */
    int has_view;
    Py_buffer view;
} IntArg;

typedef struct {
    PyObject_HEAD
    /* config (graphalloc/config.py) */
    int ps_shift;               /* log2(page_size) when it is a power of two, else -1 */
    int64_t ps, max_reqs, ring_pages, window, max_ctx, max_tok_row, row_cap, max_rel_rows,
        max_step_pages, max_alloc_rows, max_step_tokens, nf, ns, ppr, n_ref_rows;
    int n_bufs;
    /* ledger row arrays (graphalloc/ledger.py) */
    int ledger_bound;
    Py_buffer b_live, b_seq, b_front, b_prot, b_comm, b_spec;
    uint8_t *live;
    int64_t *seq, *front, *prot, *comm, *spec;
    int spec_depth;
    /* page mirror (graphalloc/references.py), pool mode */
    int refs_bound;
    Py_buffer b_page_of, b_swa_of, b_full_ring, b_swa_ring, b_full_ref, b_swa_ref;
    int32_t *page_of, *swa_of, *full_ring, *swa_ring, *full_ref, *swa_ref;
    /* descriptor buffers and result arrays, per ring buffer */
    Py_buffer *b_desc, *b_rrows, *b_rfirst, *b_rntok;
    int64_t **desc, **rrows, **rfirst, **rntok;
    uint8_t *buf_bound;
    /* scratch */
    uint8_t *flags;
    int64_t *ev_front;          /* the window rule's new frontier of ev_rows[i] */
    int64_t *nfront;            /* an advanced row's new frontier, per row */
    int64_t *args[N_ARGS];      /* copies of list / strided arguments */
    /* commit / trim: a row's length, committed length and speculative steps after this
     * step's commits and trims (phase A stages them; valid where flags & F_STG) */
    int64_t *st_seq, *st_comm, *st_spec;
    int64_t *com_len, *trim_len;  /* the length a commit / trim leaves, per call index */
    int64_t *saved_rel;         /* release rows overwritten in phase B (for a rollback) */
    int64_t *ev_rows;           /* the evicted rows whose frontier moves */
    int64_t *d_rows, *d_flo, *d_fhi, *d_slo, *d_shi;  /* one drop call's per-row ranges */
    uint32_t *stamp; uint32_t gen;  /* first-occurrence marks per FULL page */
    int64_t *ex_r, *ex_k, *ex_pg, *ex_sp, *ex_ord; uint8_t *ex_act; Py_ssize_t ex_cap;
    int64_t *sg_r, *sg_pos, *sg_n, *sg_flags; Py_ssize_t sg_cap;
    UndoEntry *undo; Py_ssize_t undo_n, undo_cap;
    int last_refusal;
    long long n_planned, n_refused;
} Planner;

/* One step's running state. */
typedef struct {
    int64_t *rel;               /* release rows of the descriptor buffer */
    int64_t *saved;             /* their previous contents, kept for a rollback */
    int64_t old_rel;            /* release rows the buffer held before this step */
    int64_t n_rel, n_rel_pages;
    int64_t full_head, full_free, swa_head, swa_free;
    int64_t freed_full, freed_swa, evicted;
    int64_t epoch;
    int refusal;
} Step;

static PyObject *S_head, *S_n_free;

static inline int64_t pmod(int64_t a, int64_t m) {
    int64_t r = a % m;
    return r < 0 ? r + m : r;
}

/* Page arithmetic on non-negative positions: shifts for a power-of-two page size (a 64-bit
 * division costs tens of cycles, and a step does several per row). */
#define PDIV(P, a) ((P)->ps_shift >= 0 ? (a) >> (P)->ps_shift : (a) / (P)->ps)
#define PCEIL(P, a) PDIV(P, (a) + (P)->ps - 1)
#define PFLOOR(P, a) ((P)->ps_shift >= 0 ? (a) & ~((P)->ps - 1) : (a) / (P)->ps * (P)->ps)
/* the residue in [0, ps) of any position (a negative one too) */
#define PMOD(P, a) ((P)->ps_shift >= 0 ? (a) & ((P)->ps - 1) : pmod(a, (P)->ps))

/* x mod m for the ring positions of a valid ledger (x < 2m) without a division. */
static inline int64_t wrap(int64_t x, int64_t m) {
    return x < m ? x : (x < 2 * m ? x - m : x % m);
}


/* ---- undo log (phase B) ----------------------------------------------------------------- */
static int undo_reserve(Planner *P, Py_ssize_t extra) {
    if (P->undo_n + extra <= P->undo_cap) return 0;
    Py_ssize_t cap = P->undo_cap ? P->undo_cap : 1024;
    while (cap < P->undo_n + extra) cap *= 2;
    UndoEntry *u = (UndoEntry *)realloc(P->undo, (size_t)cap * sizeof(UndoEntry));
    if (!u) { PyErr_NoMemory(); return -1; }
    P->undo = u; P->undo_cap = cap;
    return 0;
}

/* The capacity was reserved in phase A for the worst case; the check guards the bound. */
static inline void set64(Planner *P, int64_t *p, int64_t v) {
    if (*p == v) return;
    if (P->undo_n < P->undo_cap) {
        UndoEntry *e = &P->undo[P->undo_n++]; e->p = p; e->old = *p; e->size = 8;
    }
    *p = v;
}
static inline void set32(Planner *P, int32_t *p, int32_t v) {
    if (*p == v) return;
    if (P->undo_n < P->undo_cap) {
        UndoEntry *e = &P->undo[P->undo_n++]; e->p = p; e->old = *p; e->size = 4;
    }
    *p = v;
}
static inline void set8(Planner *P, uint8_t *p, uint8_t v) {
    if (*p == v) return;
    if (P->undo_n < P->undo_cap) {
        UndoEntry *e = &P->undo[P->undo_n++]; e->p = p; e->old = *p; e->size = 1;
    }
    *p = v;
}

static void undo_all(Planner *P) {
    for (Py_ssize_t i = P->undo_n - 1; i >= 0; i--) {
        UndoEntry *e = &P->undo[i];
        if (e->size == 8) *(int64_t *)e->p = e->old;
        else if (e->size == 4) *(int32_t *)e->p = (int32_t)e->old;
        else *(uint8_t *)e->p = (uint8_t)e->old;
    }
    P->undo_n = 0;
}

/* ---- buffers ------------------------------------------------------------------------------ */
static int is_fmt(const char *f, const char *codes) {
    if (!f) return 0;
    if (*f == '@' || *f == '=' || *f == '<') f++;
    return f[0] && !f[1] && strchr(codes, f[0]) != NULL;
}

/* A writable C-contiguous buffer of `n` items of `itemsize` bytes whose format is one of
 * `codes`; n < 0: any length. */
static int get_array(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *codes,
                     Py_ssize_t n, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    if (view->itemsize != itemsize || !is_fmt(view->format, codes) ||
        (n >= 0 && view->len != n * itemsize)) {
        PyErr_Format(PyExc_ValueError, "compiled planner: %s has format %s, itemsize %zd, "
                     "%zd bytes; expected %zd items of %zd bytes", what,
                     view->format ? view->format : "?", view->itemsize, view->len, n, itemsize);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

static void release_view(Py_buffer *v) {
    if (v->obj) { PyBuffer_Release(v); v->obj = NULL; }
}

static PyTypeObject *ndarray_type = NULL;

/* An integer argument: None, a Python int, a list / tuple of Python ints, or a 1-D int64
 * numpy array. `empty_any`: a size-0 array of any shape or dtype is "absent" (the numpy
 * planner's is_empty()). Returns 0, or 1 for anything else (the numpy planner decides). */
static int parse_arg(PyObject *o, IntArg *a, int64_t *scratch, Py_ssize_t cap, int empty_any) {
    a->v = NULL; a->n = 0; a->present = 0; a->scalar = 0; a->has_view = 0;
    if (o == Py_None) return 0;
    a->present = 1;
    if (PyLong_CheckExact(o)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 1; }
        scratch[0] = (int64_t)x; a->v = scratch; a->n = 1; a->scalar = 1;
        return 0;
    }
    if (PyList_CheckExact(o) || PyTuple_CheckExact(o)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
        PyObject **items = PySequence_Fast_ITEMS(o);
        if (n == 0) { if (empty_any) a->present = 0; return 0; }
        if (n > cap) return 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!PyLong_CheckExact(items[i])) return 1;
            int overflow = 0;
            long long x = PyLong_AsLongLongAndOverflow(items[i], &overflow);
            if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 1; }
            scratch[i] = (int64_t)x;
        }
        a->v = scratch; a->n = n;
        return 0;
    }
    if (ndarray_type && Py_TYPE(o) == ndarray_type) {
        if (PyObject_GetBuffer(o, &a->view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
            PyErr_Clear(); return 1;
        }
        a->has_view = 1;
        Py_ssize_t n = a->view.itemsize ? a->view.len / a->view.itemsize : 0;
        if (n == 0 && empty_any) { a->present = 0; return 0; }
        if (a->view.ndim != 1) return 1;
        if (n == 0) return 0;
        if (a->view.itemsize != 8 || !is_fmt(a->view.format, "lq")) return 1;
        if (n > cap) return 1;
        Py_ssize_t stride = a->view.strides ? a->view.strides[0] : 8;
        if (stride == 8) {
            a->v = (const int64_t *)a->view.buf;
        } else {
            const char *base = (const char *)a->view.buf;
            for (Py_ssize_t i = 0; i < n; i++) scratch[i] = *(const int64_t *)(base + i * stride);
            a->v = scratch;
        }
        a->n = n;
        return 0;
    }
    return 1;
}

static void drop_arg(IntArg *a) {
    if (a->has_view) { PyBuffer_Release(&a->view); a->has_view = 0; }
}

/* ---- release rows (release_rows.py: ReleasePlanning._add_release) ----------------------- */
/* One segment of `n_pages` pages from `start_pos`, split every max_pages_per_row pages;
 * lanes and push positions assigned in row order. Returns 0, or -1 with S->refusal set when
 * a frozen release shape would be exceeded. */
static int add_release(Planner *P, Step *S, int64_t r, int64_t start_pos, int64_t n_pages,
                       int64_t flags) {
    if (n_pages <= 0) return 0;
    int64_t cap = P->row_cap;
    for (int64_t done = 0; done < n_pages; done += cap) {
        int64_t n = n_pages - done < cap ? n_pages - done : cap;
        if (S->n_rel >= P->max_rel_rows || S->n_rel_pages + n > P->max_step_pages) {
            S->refusal = R_SHAPE;
            return -1;
        }
        int64_t *row = S->rel + S->n_rel * ROW_WIDTH;
        if (S->n_rel < S->old_rel)  /* a row of the previous step: kept for a rollback */
            memcpy(S->saved + S->n_rel * ROW_WIDTH, row, ROW_WIDTH * sizeof(int64_t));
        row[REL_REQ] = r;
        row[REL_START_POS] = start_pos + done * P->ps;
        row[REL_N_PAGES] = n;
        row[REL_FLAGS] = flags;
        if (flags & (REL_SWA | REL_RING_RETURN)) {
            row[REL_SWA_PUSH] = wrap(S->swa_head + S->swa_free, P->ns);
            S->swa_free += n; S->freed_swa += n;
        } else {
            row[REL_SWA_PUSH] = 0;
        }
        if (flags & REL_FULL) {
            row[REL_FULL_PUSH] = wrap(S->full_head + S->full_free, P->nf);
            S->full_free += n; S->freed_full += n;
        } else {
            row[REL_FULL_PUSH] = 0;
        }
        row[REL_LANE] = S->n_rel_pages;
        row[REL_EPOCH] = S->epoch;
        S->n_rel_pages += n;
        S->n_rel++;
    }
    return 0;
}

static int grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    /* callers grow several arrays to one capacity: the caller keeps *cap */
    (void)cap;
    void *q = realloc(*p, (size_t)(need ? need : 1) * item);
    if (!q) { PyErr_NoMemory(); return -1; }
    *p = q;
    return 0;
}

static int ensure_exam(Planner *P, Py_ssize_t need) {
    if (need <= P->ex_cap) return 0;
    Py_ssize_t cap = P->ex_cap ? P->ex_cap : 1024;
    while (cap < need) cap *= 2;
    Py_ssize_t dummy = 0;
    if (grow((void **)&P->ex_r, &dummy, cap, 8) || grow((void **)&P->ex_k, &dummy, cap, 8) ||
        grow((void **)&P->ex_pg, &dummy, cap, 8) || grow((void **)&P->ex_sp, &dummy, cap, 8) ||
        grow((void **)&P->ex_ord, &dummy, cap, 8) || grow((void **)&P->ex_act, &dummy, cap, 1) ||
        grow((void **)&P->sg_r, &dummy, cap, 8) || grow((void **)&P->sg_pos, &dummy, cap, 8) ||
        grow((void **)&P->sg_n, &dummy, cap, 8) || grow((void **)&P->sg_flags, &dummy, cap, 8))
        return -1;
    P->ex_cap = cap;
    P->sg_cap = cap;
    return 0;
}

/* ---- dropping references (references.py: drop_actions, then ReleasePlanning._emit) ------ */
/* Row d_rows[i] drops its FULL references of page indices [d_flo[i], d_fhi[i]) and its SWA
 * references of [d_slo[i], d_shi[i]); the pages whose last reference goes are pushed in the
 * rule's order: phase 1 every FULL-only page, phase 2 every page freeing its SWA page; in a
 * phase, rows in call order, pages in index order; a page several rows free is freed once,
 * in the first such row's run, with the action of the counts after the whole call.
 * Returns 0 (and the SWA pages freed in *swa_freed) or -1 (refused or MemoryError). */
static int drop_emit(Planner *P, Step *S, Py_ssize_t m, int64_t *swa_freed) {
    Py_ssize_t t = 0;
    *swa_freed = 0;
    /* pass 1: examine and decrement */
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t r = P->d_rows[i];
        int64_t n_full = P->d_fhi[i] - P->d_flo[i];
        int64_t lo = n_full > 0 ? P->d_flo[i] : P->d_slo[i];
        int64_t hi = n_full > 0 ? P->d_fhi[i] : P->d_shi[i];
        if (hi <= lo) continue;
        if (lo < 0 || hi > P->ppr) { S->refusal = R_MIRROR; return -1; }
        const int32_t *prow = P->page_of + r * P->ppr;
        for (int64_t k = lo; k < hi; k++) {
            int64_t page = prow[k];
            if (page < 0 || page > P->nf) { S->refusal = R_MIRROR; return -1; }
            if (n_full > 0) set32(P, &P->full_ref[page], P->full_ref[page] - 1);
            int64_t sp = P->swa_of[page];
            if (sp < 0 || sp > P->ns) { S->refusal = R_MIRROR; return -1; }
            if (k >= P->d_slo[i] && k < P->d_shi[i]) set32(P, &P->swa_ref[sp], P->swa_ref[sp] - 1);
            P->ex_r[t] = r; P->ex_k[t] = k; P->ex_pg[t] = page; P->ex_sp[t] = sp;
            t++;
        }
    }
    if (t == 0) return 0;
    /* pass 2: actions from the counts after the whole call; first occurrence of each page */
    P->gen++;
    if (P->gen == 0) { memset(P->stamp, 0, (size_t)(P->nf + 1) * sizeof(uint32_t)); P->gen = 1; }
    Py_ssize_t n_keep = 0, n_phase1 = 0;
    for (Py_ssize_t j = 0; j < t; j++) {
        int64_t page = P->ex_pg[j], sp = P->ex_sp[j];
        int full_zero = P->full_ref[page] == 0;
        int swa_zero = sp > 0 && P->swa_ref[sp] == 0;
        int act = full_zero ? (sp > 0 ? ACT_BOTH : ACT_FULL) : (swa_zero ? ACT_SWA : ACT_NONE);
        if (act == ACT_NONE || P->stamp[page] == P->gen) continue;
        P->stamp[page] = P->gen;
        P->ex_act[j] = (uint8_t)act;
        P->ex_ord[n_keep++] = j;
        n_phase1 += act == ACT_FULL;
    }
    if (n_keep == 0) return 0;
    /* the push order: a stable partition, FULL-only first (ex_ord reordered via sg_pos) */
    {
        int64_t *tmp = P->sg_pos;  /* free until the segments below */
        Py_ssize_t a = 0, b = n_phase1;
        for (Py_ssize_t q = 0; q < n_keep; q++) {
            Py_ssize_t j = P->ex_ord[q];
            if (P->ex_act[j] == ACT_FULL) tmp[a++] = j; else tmp[b++] = j;
        }
        memcpy(P->ex_ord, tmp, (size_t)n_keep * sizeof(int64_t));
    }
    /* pass 3 (_emit): segments of consecutive pages of one row with one action */
    int64_t full_tail = wrap(S->full_head + S->full_free, P->nf);
    int64_t swa_tail = wrap(S->swa_head + S->swa_free, P->ns);
    Py_ssize_t n_seg = 0;
    for (Py_ssize_t q = 0; q < n_keep; q++) {
        Py_ssize_t j = P->ex_ord[q];
        if (q == 0 || P->ex_r[j] != P->sg_r[n_seg - 1] ||
            P->ex_act[j] != P->ex_act[P->ex_ord[q - 1]] ||
            P->ex_k[j] != P->ex_k[P->ex_ord[q - 1]] + 1) {
            int act = P->ex_act[j];
            P->sg_r[n_seg] = P->ex_r[j];
            P->sg_pos[n_seg] = P->ex_k[j] * P->ps;
            P->sg_n[n_seg] = 0;
            P->sg_flags[n_seg] = act == ACT_FULL ? REL_FULL
                : act == ACT_BOTH ? (REL_SWA | REL_FULL | REL_CLEAR) : (REL_SWA | REL_CLEAR);
            n_seg++;
        }
        P->sg_n[n_seg - 1]++;
    }
    for (Py_ssize_t g = 0; g < n_seg; g++)
        if (add_release(P, S, P->sg_r[g], P->sg_pos[g], P->sg_n[g], P->sg_flags[g]) < 0)
            return -1;
    /* the pushed page ids into the host mirror of the rings, then the mappings cleared */
    int64_t fi = 0, si = 0;
    for (Py_ssize_t q = 0; q < n_keep; q++) {
        Py_ssize_t j = P->ex_ord[q];
        int act = P->ex_act[j];
        int64_t page = P->ex_pg[j];
        if (act != ACT_SWA) set32(P, &P->full_ring[wrap(full_tail + fi++, P->nf)], (int32_t)page);
        if (act != ACT_FULL)
            set32(P, &P->swa_ring[wrap(swa_tail + si++, P->ns)], P->swa_of[page]);
    }
    for (Py_ssize_t q = 0; q < n_keep; q++) {
        Py_ssize_t j = P->ex_ord[q];
        if (P->ex_act[j] != ACT_FULL) set32(P, &P->swa_of[P->ex_pg[j]], 0);
    }
    *swa_freed = si;
    return 0;
}

/* ---- the Planner type ----------------------------------------------------------------------- */
static void unbind_ledger(Planner *P) {
    release_view(&P->b_live); release_view(&P->b_seq); release_view(&P->b_front);
    release_view(&P->b_prot); release_view(&P->b_comm); release_view(&P->b_spec);
    P->live = NULL; P->seq = P->front = P->prot = P->comm = P->spec = NULL;
    P->ledger_bound = 0;
}

static void unbind_refs(Planner *P) {
    release_view(&P->b_page_of); release_view(&P->b_swa_of); release_view(&P->b_full_ring);
    release_view(&P->b_swa_ring); release_view(&P->b_full_ref); release_view(&P->b_swa_ref);
    P->page_of = P->swa_of = P->full_ring = P->swa_ring = P->full_ref = P->swa_ref = NULL;
    P->refs_bound = 0;
}

static void unbind_buffer(Planner *P, int i) {
    release_view(&P->b_desc[i]); release_view(&P->b_rrows[i]);
    release_view(&P->b_rfirst[i]); release_view(&P->b_rntok[i]);
    P->buf_bound[i] = 0;
}

static void Planner_dealloc(Planner *P) {
    unbind_ledger(P);
    unbind_refs(P);
    for (int i = 0; i < P->n_bufs; i++) if (P->buf_bound) unbind_buffer(P, i);
    free(P->b_desc); free(P->b_rrows); free(P->b_rfirst); free(P->b_rntok);
    free(P->desc); free(P->rrows); free(P->rfirst); free(P->rntok); free(P->buf_bound);
    free(P->flags); free(P->nfront); free(P->ev_front); free(P->saved_rel); free(P->ev_rows);
    for (int i = 0; i < N_ARGS; i++) free(P->args[i]);
    free(P->st_seq); free(P->st_comm); free(P->st_spec); free(P->com_len); free(P->trim_len);
    free(P->d_rows); free(P->d_flo); free(P->d_fhi); free(P->d_slo); free(P->d_shi);
    free(P->stamp);
    free(P->ex_r); free(P->ex_k); free(P->ex_pg); free(P->ex_sp); free(P->ex_ord);
    free(P->ex_act);
    free(P->sg_r); free(P->sg_pos); free(P->sg_n); free(P->sg_flags);
    free(P->undo);
    Py_TYPE(P)->tp_free((PyObject *)P);
}

static int Planner_init(Planner *P, PyObject *args, PyObject *kwds) {
    long long v[16];
    static const char *fmt = "LLLLLLLLLLLLLLLL";
    (void)kwds;
    if (!PyArg_ParseTuple(args, fmt, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7],
                          &v[8], &v[9], &v[10], &v[11], &v[12], &v[13], &v[14], &v[15]))
        return -1;
    P->ps = v[0]; P->max_reqs = v[1]; P->ring_pages = v[2]; P->window = v[3];
    P->max_ctx = v[4]; P->max_tok_row = v[5]; P->row_cap = v[6]; P->max_rel_rows = v[7];
    P->max_step_pages = v[8]; P->max_alloc_rows = v[9]; P->max_step_tokens = v[10];
    P->nf = v[11]; P->ns = v[12]; P->ppr = v[13]; P->n_ref_rows = v[14];
    P->n_bufs = (int)v[15];
    P->ps_shift = -1;
    if (P->ps > 0 && (P->ps & (P->ps - 1)) == 0)
        for (P->ps_shift = 0; ((int64_t)1 << P->ps_shift) < P->ps; P->ps_shift++) {}
    if (P->ps < 1 || P->max_reqs < 1 || P->nf < 1 || P->ns < 1 || P->row_cap < 1 ||
        P->n_bufs < 1 || P->ppr < 1) {
        PyErr_SetString(PyExc_ValueError, "compiled planner: bad config");
        return -1;
    }
    size_t n = (size_t)P->max_reqs, nb = (size_t)P->n_bufs;
    P->b_desc = calloc(nb, sizeof(Py_buffer)); P->b_rrows = calloc(nb, sizeof(Py_buffer));
    P->b_rfirst = calloc(nb, sizeof(Py_buffer)); P->b_rntok = calloc(nb, sizeof(Py_buffer));
    P->desc = calloc(nb, sizeof(int64_t *)); P->rrows = calloc(nb, sizeof(int64_t *));
    P->rfirst = calloc(nb, sizeof(int64_t *)); P->rntok = calloc(nb, sizeof(int64_t *));
    P->buf_bound = calloc(nb, 1);
    P->flags = calloc(n, 1);
    P->nfront = calloc(n, 8);
    P->ev_front = calloc(n, 8);
    P->saved_rel = calloc((size_t)P->max_rel_rows * ROW_WIDTH + 1, 8);
    P->ev_rows = calloc(n, 8);
    for (int i = 0; i < N_ARGS; i++) P->args[i] = calloc(n + 1, 8);
    P->st_seq = calloc(n, 8); P->st_comm = calloc(n, 8); P->st_spec = calloc(n * MAX_SPEC, 8);
    P->com_len = calloc(n, 8); P->trim_len = calloc(n, 8);
    P->d_rows = calloc(n, 8); P->d_flo = calloc(n, 8); P->d_fhi = calloc(n, 8);
    P->d_slo = calloc(n, 8); P->d_shi = calloc(n, 8);
    P->stamp = calloc((size_t)P->nf + 1, sizeof(uint32_t));
    int bad = !P->b_desc || !P->b_rrows || !P->b_rfirst || !P->b_rntok || !P->desc ||
              !P->rrows || !P->rfirst || !P->rntok || !P->buf_bound || !P->flags ||
              !P->nfront || !P->ev_front || !P->saved_rel || !P->ev_rows || !P->d_rows || !P->d_flo || !P->d_fhi ||
              !P->d_slo || !P->d_shi || !P->stamp;
    for (int i = 0; i < N_ARGS; i++) bad |= !P->args[i];
    bad |= !P->st_seq || !P->st_comm || !P->st_spec || !P->com_len || !P->trim_len;
    if (bad) { PyErr_NoMemory(); return -1; }
    return 0;
}

/* bind_ledger(live, seq_len, frontier, protected, committed | None, spec_steps | None) */
static PyObject *Planner_bind_ledger(Planner *P, PyObject *args) {
    PyObject *live, *seq, *front, *prot, *comm, *spec;
    if (!PyArg_ParseTuple(args, "OOOOOO", &live, &seq, &front, &prot, &comm, &spec))
        return NULL;
    unbind_ledger(P);
    Py_ssize_t n = P->max_reqs;
    if (get_array(live, &P->b_live, 1, "?", n, "live") ||
        get_array(seq, &P->b_seq, 8, "lq", n, "seq_len") ||
        get_array(front, &P->b_front, 8, "lq", n, "frontier") ||
        get_array(prot, &P->b_prot, 8, "lq", n, "protected")) {
        unbind_ledger(P); return NULL;
    }
    P->spec_depth = 0;
    if (comm != Py_None && get_array(comm, &P->b_comm, 8, "lq", n, "committed")) {
        unbind_ledger(P); return NULL;
    }
    if (spec != Py_None) {
        if (get_array(spec, &P->b_spec, 8, "lq", -1, "spec_steps")) { unbind_ledger(P); return NULL; }
        P->spec_depth = (int)(P->b_spec.len / 8 / n);
        if (P->spec_depth * n * 8 != P->b_spec.len || P->spec_depth < 1) {
            PyErr_SetString(PyExc_ValueError, "compiled planner: spec_steps is not [max_reqs, d]");
            unbind_ledger(P); return NULL;
        }
    }
    P->live = (uint8_t *)P->b_live.buf;
    P->seq = (int64_t *)P->b_seq.buf; P->front = (int64_t *)P->b_front.buf;
    P->prot = (int64_t *)P->b_prot.buf;
    P->comm = comm != Py_None ? (int64_t *)P->b_comm.buf : NULL;
    P->spec = spec != Py_None ? (int64_t *)P->b_spec.buf : NULL;
    P->ledger_bound = 1;
    Py_RETURN_NONE;
}

/* bind_refs(page_of, swa_of, full_ring, swa_ring, full_ref, swa_ref) or bind_refs(None) */
static PyObject *Planner_bind_refs(Planner *P, PyObject *args) {
    Py_ssize_t na = PyTuple_GET_SIZE(args);
    unbind_refs(P);
    if (na == 1 && PyTuple_GET_ITEM(args, 0) == Py_None) Py_RETURN_NONE;
    PyObject *a[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5])) return NULL;
    if (get_array(a[0], &P->b_page_of, 4, "i", P->n_ref_rows * P->ppr, "page_of") ||
        get_array(a[1], &P->b_swa_of, 4, "i", P->nf + 1, "swa_of") ||
        get_array(a[2], &P->b_full_ring, 4, "i", P->nf, "full_ring") ||
        get_array(a[3], &P->b_swa_ring, 4, "i", P->ns, "swa_ring") ||
        get_array(a[4], &P->b_full_ref, 4, "i", P->nf + 1, "full_ref") ||
        get_array(a[5], &P->b_swa_ref, 4, "i", P->ns + 1, "swa_ref")) {
        unbind_refs(P); return NULL;
    }
    P->page_of = P->b_page_of.buf; P->swa_of = P->b_swa_of.buf;
    P->full_ring = P->b_full_ring.buf; P->swa_ring = P->b_swa_ring.buf;
    P->full_ref = P->b_full_ref.buf; P->swa_ref = P->b_swa_ref.buf;
    P->refs_bound = 1;
    Py_RETURN_NONE;
}

/* bind_buffer(i, descriptor [rel + alloc, 8] int64, rows, first_lane, n_tokens [max_reqs]) */
static PyObject *Planner_bind_buffer(Planner *P, PyObject *args) {
    int i;
    PyObject *d, *r, *f, *t;
    if (!PyArg_ParseTuple(args, "iOOOO", &i, &d, &r, &f, &t)) return NULL;
    if (i < 0 || i >= P->n_bufs) { PyErr_SetString(PyExc_IndexError, "buffer index"); return NULL; }
    unbind_buffer(P, i);
    Py_ssize_t n_rows = P->max_rel_rows + P->max_alloc_rows;
    if (get_array(d, &P->b_desc[i], 8, "lq", n_rows * ROW_WIDTH, "descriptor buffer") ||
        get_array(r, &P->b_rrows[i], 8, "lq", P->max_reqs, "result rows") ||
        get_array(f, &P->b_rfirst[i], 8, "lq", P->max_reqs, "result lanes") ||
        get_array(t, &P->b_rntok[i], 8, "lq", P->max_reqs, "result tokens")) {
        unbind_buffer(P, i); return NULL;
    }
    P->desc[i] = P->b_desc[i].buf; P->rrows[i] = P->b_rrows[i].buf;
    P->rfirst[i] = P->b_rfirst[i].buf; P->rntok[i] = P->b_rntok[i].buf;
    P->buf_bound[i] = 1;
    Py_RETURN_NONE;
}

static int get_ring(PyObject *ring, int64_t *head, int64_t *n_free) {
    PyObject *h = PyObject_GetAttr(ring, S_head);
    if (!h) return -1;
    PyObject *f = PyObject_GetAttr(ring, S_n_free);
    if (!f) { Py_DECREF(h); return -1; }
    *head = PyLong_AsLongLong(h);
    *n_free = PyLong_AsLongLong(f);
    Py_DECREF(h); Py_DECREF(f);
    return PyErr_Occurred() ? -1 : 0;
}

static int set_ring(PyObject *ring, int64_t head, int64_t n_free) {
    PyObject *h = PyLong_FromLongLong(head), *f = PyLong_FromLongLong(n_free);
    int rc = (!h || !f) ? -1 : (PyObject_SetAttr(ring, S_head, h) | PyObject_SetAttr(ring, S_n_free, f));
    Py_XDECREF(h); Py_XDECREF(f);
    return rc;
}

/* A row's length, committed length and speculative step j after this step's commits and
 * trims (phase A): the staged values where the row was committed or trimmed, else the
 * ledger's. In phase B and C the ledger holds them (written by the commit / trim frees). */
static inline int64_t cur_seq(const Planner *P, int64_t r) {
    return (P->flags[r] & F_STG) ? P->st_seq[r] : P->seq[r];
}
static inline int64_t cur_comm(const Planner *P, int64_t r) {
    return (P->flags[r] & F_STG) ? P->st_comm[r] : (P->comm ? P->comm[r] : P->seq[r]);
}
static inline int64_t cur_spec(const Planner *P, int64_t r, int j) {
    return (P->flags[r] & F_STG) ? P->st_spec[r * MAX_SPEC + j] : P->spec[r * P->spec_depth + j];
}

/* A row of a speculative tail (after this step's commits and trims). */
static inline int has_tail(Planner *P, int64_t r) {
    if (P->comm) return cur_comm(P, r) != cur_seq(P, r);  /* L == C + the speculative steps */
    if (P->spec) for (int j = 0; j < P->spec_depth; j++) if (cur_spec(P, r, j)) return 1;
    return 0;
}

/* min(L at the step's start, C after its commits and trims): the window rule's length. */
static inline int64_t committed_len(const Planner *P, int64_t r) {
    int64_t c = cur_comm(P, r);
    return c < P->seq[r] ? c : P->seq[r];
}

/* Stage row r's ledger values (its first commit or trim of the step). */
static inline void stage(Planner *P, int64_t r) {
    P->st_seq[r] = P->seq[r];
    P->st_comm[r] = P->comm[r];
    for (int j = 0; j < P->spec_depth; j++)
        P->st_spec[r * MAX_SPEC + j] = P->spec[r * P->spec_depth + j];
}

/* The window rule (release_rows.window_frontier): floor_page(max(f, min(L, C) - W)), L the
 * length when the step began, C after the step's commits and trims (a row is evicted
 * before anything allocates for it). */
static inline int64_t window_front(const Planner *P, int64_t r) {
    int64_t thr = committed_len(P, r) - P->window;
    thr = thr < 0 ? 0 : PFLOOR(P, thr);
    return P->front[r] > thr ? P->front[r] : thr;
}

/* Rows of one operation: in range, live, not released in this step, each once. */
static int check_rows(Planner *P, const IntArg *a, uint8_t bit) {
    for (Py_ssize_t i = 0; i < a->n; i++) {
        int64_t r = a->v[i];
        if (r < 0 || r >= P->max_reqs || !P->live[r] || (P->flags[r] & (F_REL | bit)))
            return -1;
        P->flags[r] |= bit;
    }
    return 0;
}

/* A per-row argument (counts, positions) for n rows: a Python int is broadcast to n rows
 * (inputs._per_row); a sequence must have n values. */
static int per_row(const IntArg *a, Py_ssize_t n, int64_t *scratch) {
    if (!a->present) return -1;
    if (a->scalar) {
        if (n == 1) return 0;
        int64_t x = a->v[0];
        for (Py_ssize_t i = 0; i < n; i++) scratch[i] = x;
        ((IntArg *)a)->v = scratch;
        ((IntArg *)a)->n = n;
        return 0;
    }
    return a->n == n ? 0 : -1;
}

#define REFUSE(code) do { S.refusal = (code); goto refused; } while (0)

/* step(index, epoch, full_ring, swa_ring, release, evict, evict_all, advance_rows,
 *      advance_pos, decode, extend_rows, extend_n, advance_given, extend_given,
 *      old_release_rows, old_alloc_rows, commit_rows, commit_n, trim_rows, trim_len,
 *      commit_given, trim_given, lookahead)
 * -> None (not planned, nothing changed) or (n_release_rows, n_alloc_rows, n_tokens,
 *    freed_full, freed_swa, allocated_full, allocated_swa, evicted, fusable, n_result,
 *    has_result) */
static PyObject *Planner_step(Planner *P, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 23) {
        PyErr_SetString(PyExc_TypeError, "Planner.step takes 23 arguments");
        return NULL;
    }
    Step S;
    memset(&S, 0, sizeof S);
    IntArg A_rel, A_ev, A_advr, A_advp, A_dec, A_extr, A_extn, A_comr, A_comn, A_trr, A_trn,
        A_look;
    IntArg *all[N_ARGS] = {&A_rel, &A_ev, &A_advr, &A_advp, &A_dec, &A_extr, &A_extn,
                           &A_comr, &A_comn, &A_trr, &A_trn, &A_look};
    for (int i = 0; i < N_ARGS; i++) { all[i]->has_view = 0; all[i]->n = 0; all[i]->present = 0; }
    Py_ssize_t index = PyLong_AsSsize_t(a[0]);
    S.epoch = PyLong_AsLongLong(a[1]);
    PyObject *full_ring_obj = a[2], *swa_ring_obj = a[3];
    int evict_all = a[6] == Py_True;
    int adv_given = PyObject_IsTrue(a[12]) == 1, ext_given = PyObject_IsTrue(a[13]) == 1;
    int64_t old_rel = PyLong_AsLongLong(a[14]), old_al = PyLong_AsLongLong(a[15]);
    int com_given = PyObject_IsTrue(a[20]) == 1, trim_given = PyObject_IsTrue(a[21]) == 1;
    if (PyErr_Occurred()) return NULL;
    int ring = P->ring_pages > 0;
    Py_ssize_t n_written = 0;  /* release rows written (zeroed again on a refusal) */
    int64_t n_free_before_full, n_free_before_swa;
    Py_ssize_t n_dec = 0, n_ext = 0;
    int64_t need_dec = 0, need_ext = 0, n_tok_total = 0, n_alloc_rows = 0;
    Py_ssize_t n_exam = 0;
    int64_t *desc;

    P->undo_n = 0;
    if (index < 0 || index >= P->n_bufs || !P->buf_bound[index] || !P->ledger_bound ||
        (!ring && !P->refs_bound))
        { S.refusal = R_UNBOUND; goto refused_early; }
    if (a[6] != Py_True && a[6] != Py_False) { S.refusal = R_INPUT; goto refused_early; }
    if (evict_all && a[5] != Py_None && !PyLong_CheckExact(a[5]) && !PyList_CheckExact(a[5]) &&
        !PyTuple_CheckExact(a[5]) && !(ndarray_type && Py_TYPE(a[5]) == ndarray_type))
        { S.refusal = R_INPUT; goto refused_early; }  /* a bool evict is refused there */
    desc = P->desc[index];
    S.rel = desc;
    S.saved = P->saved_rel;
    S.old_rel = old_rel < 0 ? 0 : (old_rel > P->max_rel_rows ? P->max_rel_rows : old_rel);
    if (get_ring(full_ring_obj, &S.full_head, &S.full_free) ||
        get_ring(swa_ring_obj, &S.swa_head, &S.swa_free))
        return NULL;
    n_free_before_full = S.full_free;
    n_free_before_swa = S.swa_free;

    /* ---- parse (unsupported forms: the numpy planner) ---- */
    if (parse_arg(a[4], &A_rel, P->args[0], P->max_reqs, 1) ||
        (!evict_all && parse_arg(a[5], &A_ev, P->args[1], P->max_reqs, 1)) ||
        (adv_given && (parse_arg(a[7], &A_advr, P->args[2], P->max_reqs, 0) ||
                       parse_arg(a[8], &A_advp, P->args[3], P->max_reqs, 0))) ||
        parse_arg(a[9], &A_dec, P->args[4], P->max_reqs, 1) ||
        (ext_given && (parse_arg(a[10], &A_extr, P->args[5], P->max_reqs, 0) ||
                       parse_arg(a[11], &A_extn, P->args[6], P->max_reqs, 0))) ||
        (com_given && (parse_arg(a[16], &A_comr, P->args[7], P->max_reqs, 0) ||
                       parse_arg(a[17], &A_comn, P->args[8], P->max_reqs, 0))) ||
        (trim_given && (parse_arg(a[18], &A_trr, P->args[9], P->max_reqs, 0) ||
                        parse_arg(a[19], &A_trn, P->args[10], P->max_reqs, 0))) ||
        parse_arg(a[22], &A_look, P->args[11], P->max_reqs, 0))
        { S.refusal = R_INPUT; goto refused_early; }
    if ((adv_given && !A_advr.present) || (ext_given && !A_extr.present) ||
        (com_given && !A_comr.present) || (trim_given && !A_trr.present))
        { S.refusal = R_INPUT; goto refused_early; }
    /* speculative decoding needs the ledger's committed lengths and speculative steps */
    if ((com_given || trim_given || A_look.present) &&
        (!P->comm || !P->spec || P->spec_depth > MAX_SPEC))
        { S.refusal = R_SPECULATIVE; goto refused_early; }

    /* ==== phase A: every rule that needs no page mirror; nothing is written ==== */
    memset(P->flags, 0, (size_t)P->max_reqs);
    /* release: live rows, each once */
    if (check_rows(P, &A_rel, F_REL)) { S.refusal = R_ROWS; goto refused_early; }
    for (Py_ssize_t i = 0; i < A_rel.n; i++) {
        int64_t r = A_rel.v[i];
        int64_t end_page = PCEIL(P, P->seq[r]);
        if (end_page > P->ppr) { S.refusal = R_MIRROR; goto refused_early; }
        n_exam += end_page;
    }
    /* commit (release_rows.commit): the oldest speculative step of size s resolved with
     * 0 <= n <= s accepted; C' = C + n, L' = C' + the later steps; pages past L' cut */
    if (com_given) {
        if (check_rows(P, &A_comr, F_COM)) { S.refusal = R_ROWS; goto refused_early; }
        if (per_row(&A_comn, A_comr.n, P->args[8])) { S.refusal = R_INPUT; goto refused_early; }
        for (Py_ssize_t i = 0; i < A_comr.n; i++) {
            int64_t r = A_comr.v[i], n = A_comn.v[i];
            stage(P, r);
            int64_t *sp = P->st_spec + r * MAX_SPEC;
            if (n < 0) { S.refusal = R_INPUT; goto refused_early; }
            if (sp[0] == 0) { S.refusal = R_SPECULATIVE; goto refused_early; }
            if (n > sp[0]) { S.refusal = R_POSITIONS; goto refused_early; }
            int64_t c = P->st_comm[r] + n, later = 0;
            for (int j = 1; j < P->spec_depth; j++) { later += sp[j]; sp[j - 1] = sp[j]; }
            sp[P->spec_depth - 1] = 0;
            int64_t new_len = c + later, old_page = PCEIL(P, P->st_seq[r]);
            if (new_len > P->st_seq[r] || old_page > P->ppr)
                { S.refusal = R_MIRROR; goto refused_early; }  /* not a valid ledger */
            n_exam += old_page - PCEIL(P, new_len);
            P->com_len[i] = new_len;
            P->st_seq[r] = new_len;
            P->st_comm[r] = c;
        }
    }
    /* trim (release_rows.trim): L' = new_len <= L, and >= f + W once the frontier f moved;
     * C' = min(C, L'), the speculative steps cut at L' (oldest kept first) */
    if (trim_given) {
        if (check_rows(P, &A_trr, F_TRIM)) { S.refusal = R_ROWS; goto refused_early; }
        if (per_row(&A_trn, A_trr.n, P->args[10])) { S.refusal = R_INPUT; goto refused_early; }
        for (Py_ssize_t i = 0; i < A_trr.n; i++) {
            int64_t r = A_trr.v[i], nl = A_trn.v[i], f = P->front[r];
            if (!(P->flags[r] & F_COM)) stage(P, r);
            int64_t len = P->st_seq[r], old_page = PCEIL(P, len);
            if (nl < 0) { S.refusal = R_INPUT; goto refused_early; }
            if (nl > len) { S.refusal = R_POSITIONS; goto refused_early; }
            if (f > 0 && nl < f + P->window) { S.refusal = R_POSITIONS; goto refused_early; }
            if (old_page > P->ppr) { S.refusal = R_MIRROR; goto refused_early; }
            n_exam += old_page - PCEIL(P, nl);
            P->trim_len[i] = nl;
            int64_t c = P->st_comm[r], keep = nl - c, before = 0;
            int64_t *sp = P->st_spec + r * MAX_SPEC;
            for (int j = 0; j < P->spec_depth; j++) {  /* clip(keep - before, 0, step) */
                int64_t s_j = sp[j], v = keep - before;
                sp[j] = v < 0 ? 0 : (v > s_j ? s_j : v);
                before += s_j;
            }
            P->st_comm[r] = c < nl ? c : nl;
            P->st_seq[r] = nl;
        }
    }
    /* evict: the window rule on the committed length. Only rows whose frontier moves are
     * kept (ev_rows, ev_front): a row with nothing to free writes nothing (drop_actions of an
     * empty range examines no page). */
    const int64_t *ev = P->ev_rows;
    Py_ssize_t n_ev = 0;
    if (evict_all) {
        for (int64_t r = 0; r < P->max_reqs; r++) {
            if (!P->live[r] || (P->flags[r] & F_REL)) continue;
            P->flags[r] |= F_EV;
            int64_t nfr = window_front(P, r);
            if (nfr > P->front[r]) {
                P->ev_rows[n_ev] = r; P->ev_front[n_ev++] = nfr;
                n_exam += PDIV(P, nfr - P->front[r]);
            }
        }
    } else if (A_ev.present) {
        if (check_rows(P, &A_ev, F_EV)) { S.refusal = R_ROWS; goto refused_early; }
        for (Py_ssize_t i = 0; i < A_ev.n; i++) {
            int64_t r = A_ev.v[i], nfr = window_front(P, r);
            if (nfr > P->front[r]) {
                P->ev_rows[n_ev] = r; P->ev_front[n_ev++] = nfr;
                n_exam += PDIV(P, nfr - P->front[r]);
            }
        }
    }
    /* advance: aligned, forward only, inside the whole committed pages at the step's start */
    if (adv_given) {
        if (check_rows(P, &A_advr, F_ADV)) { S.refusal = R_ROWS; goto refused_early; }
        if (per_row(&A_advp, A_advr.n, P->args[3])) { S.refusal = R_INPUT; goto refused_early; }
        for (Py_ssize_t i = 0; i < A_advr.n; i++) {
            int64_t r = A_advr.v[i], pos = A_advp.v[i];
            int64_t old = (P->flags[r] & F_EV) ? window_front(P, r) : P->front[r];
            if (PMOD(P, pos) != 0 || pos < old || pos > PFLOOR(P, committed_len(P, r)))
                { S.refusal = R_POSITIONS; goto refused_early; }
            P->nfront[r] = pos;
            n_exam += PDIV(P, pos - old);
        }
    }
    /* decode: one committed token per row; with lookahead k, 1 + k tokens per row as one
     * speculative step (planner.StepBuilder.extend(..., speculative=True)) */
    int look = A_look.present;
    if (A_dec.present) {
        if (check_rows(P, &A_dec, F_DEC)) { S.refusal = R_ROWS; goto refused_early; }
        n_dec = A_dec.n;
        if (look && per_row(&A_look, n_dec, P->args[11])) { S.refusal = R_INPUT; goto refused_early; }
        for (Py_ssize_t i = 0; i < n_dec; i++) {
            int64_t r = A_dec.v[i], start = cur_seq(P, r), n = 1;
            if (look) {
                int64_t k = A_look.v[i];
                if (k < 0 || k >= P->max_tok_row) { S.refusal = R_LENGTH; goto refused_early; }
                n = 1 + k;
                /* SPEC_DEPTH steps in flight already: commit the oldest first */
                if (cur_spec(P, r, P->spec_depth - 1)) { S.refusal = R_SPECULATIVE; goto refused_early; }
            } else if (has_tail(P, r)) {
                S.refusal = R_SPECULATIVE; goto refused_early;
            }
            if (start + n > P->max_ctx || n > P->max_tok_row) { S.refusal = R_LENGTH; goto refused_early; }
            need_dec += n == 1 ? PMOD(P, start) == 0  /* a new page where the position starts one */
                               : PCEIL(P, start + n) - PCEIL(P, start);
            n_tok_total += n;
        }
        n_alloc_rows += n_dec;
    } else if (look) {
        S.refusal = R_INPUT; goto refused_early;  /* lookahead= without decode rows */
    }
    /* extend: rows not decoding in this step, counts >= 0, lengths and per-row tokens */
    if (ext_given) {
        for (Py_ssize_t i = 0; i < A_extr.n; i++) {
            int64_t r = A_extr.v[i];
            if (r >= 0 && r < P->max_reqs && (P->flags[r] & F_DEC))
                { S.refusal = R_ROWS; goto refused_early; }
        }
        if (check_rows(P, &A_extr, F_EXT)) { S.refusal = R_ROWS; goto refused_early; }
        if (per_row(&A_extn, A_extr.n, P->args[6])) { S.refusal = R_INPUT; goto refused_early; }
        n_ext = A_extr.n;
        for (Py_ssize_t i = 0; i < n_ext; i++) {
            int64_t r = A_extr.v[i], n = A_extn.v[i], start = cur_seq(P, r);
            if (n < 0) { S.refusal = R_INPUT; goto refused_early; }
            if (has_tail(P, r)) { S.refusal = R_SPECULATIVE; goto refused_early; }
            if (n > P->max_tok_row || start + n > P->max_ctx) { S.refusal = R_LENGTH; goto refused_early; }
            need_ext += PCEIL(P, start + n) - PCEIL(P, start);
            n_tok_total += n;
            n_alloc_rows += n > 0;
        }
    }
    if (n_alloc_rows > P->max_alloc_rows || n_tok_total > P->max_step_tokens)
        { S.refusal = R_SHAPE; goto refused_early; }
    /* ring mode: a row's pages from its frontier (after this step's frees) fit its ring */
    if (ring) {
        for (int pass = 0; pass < 2; pass++) {
            const IntArg *rows = pass ? &A_extr : &A_dec;
            if (pass ? !ext_given : !A_dec.present) continue;
            for (Py_ssize_t i = 0; i < rows->n; i++) {
                int64_t r = rows->v[i];
                int64_t n = pass ? A_extn.v[i] : (look ? 1 + A_look.v[i] : 1);
                int64_t f = (P->flags[r] & F_ADV) ? P->nfront[r]
                    : (P->flags[r] & F_EV) ? window_front(P, r) : P->front[r];
                if (PCEIL(P, cur_seq(P, r) + n) - PDIV(P, f) > P->ring_pages)
                    { S.refusal = R_RING; goto refused_early; }
            }
        }
    }
    /* worst-case scratch for phase B, so nothing there can fail for memory */
    if (undo_reserve(P, (6 + P->spec_depth) * A_rel.n + n_ev + A_advr.n + 5 * n_exam +
                     (2 + P->spec_depth) * (A_comr.n + A_trr.n) + 16) ||
        (!ring && ensure_exam(P, n_exam + 1))) {
        for (int i = 0; i < N_ARGS; i++) drop_arg(all[i]);
        return NULL;
    }

    /* ==== phase B: frees, in place, undo-logged ==== */
    if (A_rel.n) {
        if (ring) {  /* release_rows.release, ring mode: three segments per row, in turn */
            for (int part = 0; part < 3; part++)
                for (Py_ssize_t i = 0; i < A_rel.n; i++) {
                    int64_t r = A_rel.v[i], f = P->front[r], p = P->prot[r];
                    int rc;
                    if (part == 0) rc = add_release(P, &S, r, p, PDIV(P, f - p), REL_FULL);
                    else if (part == 1)
                        rc = add_release(P, &S, r, f, PCEIL(P, P->seq[r]) - PDIV(P, f),
                                         REL_FULL | REL_CLEAR);
                    else rc = add_release(P, &S, r, 0, P->ring_pages, REL_RING_RETURN);
                    n_written = S.n_rel;
                    if (rc) goto refused;
                }
        } else {  /* drop FULL [0, L) and SWA [f, L) */
            for (Py_ssize_t i = 0; i < A_rel.n; i++) {
                int64_t r = A_rel.v[i], end_page = PCEIL(P, P->seq[r]);
                P->d_rows[i] = r; P->d_flo[i] = 0; P->d_fhi[i] = end_page;
                P->d_slo[i] = PDIV(P, P->front[r]); P->d_shi[i] = end_page;
            }
            int64_t dummy;
            int rc = drop_emit(P, &S, A_rel.n, &dummy);
            n_written = S.n_rel;
            if (rc) goto refused;
        }
        for (Py_ssize_t i = 0; i < A_rel.n; i++) {
            int64_t r = A_rel.v[i];
            set8(P, &P->live[r], 0);
            set64(P, &P->seq[r], 0);
            set64(P, &P->front[r], 0);
            set64(P, &P->prot[r], 0);
            if (P->comm) set64(P, &P->comm[r], 0);
            if (P->spec) for (int j = 0; j < P->spec_depth; j++)
                set64(P, &P->spec[r * P->spec_depth + j], 0);
        }
    }
    /* commit, then trim (release_rows._cut): each a call of its own; pool mode drops the
     * rows' FULL and SWA references of the pages wholly past the new length (a partial
     * page stays), ring mode frees those FULL pages and clears their mapping */
    for (int pass = 0; pass < 2; pass++) {
        const IntArg *rows = pass ? &A_trr : &A_comr;
        const int64_t *new_len = pass ? P->trim_len : P->com_len;
        if (!(pass ? trim_given : com_given) || rows->n == 0) continue;
        for (Py_ssize_t i = 0; i < rows->n; i++) {
            int64_t r = rows->v[i];
            int64_t lo = PCEIL(P, new_len[i]), hi = PCEIL(P, P->seq[r]);
            if (hi > lo) P->flags[r] |= F_CUT;
            if (ring) {
                int rc = add_release(P, &S, r, lo * P->ps, hi - lo, REL_FULL | REL_CLEAR);
                n_written = S.n_rel;
                if (rc) goto refused;
            } else {
                P->d_rows[i] = r; P->d_flo[i] = lo; P->d_fhi[i] = hi;
                P->d_slo[i] = lo; P->d_shi[i] = hi;
            }
        }
        if (!ring) {
            int64_t dummy;
            int rc = drop_emit(P, &S, rows->n, &dummy);
            n_written = S.n_rel;
            if (rc) goto refused;
        }
        for (Py_ssize_t i = 0; i < rows->n; i++) {
            int64_t r = rows->v[i];
            set64(P, &P->seq[r], new_len[i]);
            set64(P, &P->comm[r], P->st_comm[r]);
            for (int j = 0; j < P->spec_depth; j++)
                set64(P, &P->spec[r * P->spec_depth + j], P->st_spec[r * MAX_SPEC + j]);
        }
    }
    /* evict, then advance: frontier moves (release_rows.advance_frontier) */
    for (int pass = 0; pass < 2; pass++) {
        const int64_t *rows = pass ? A_advr.v : ev;
        Py_ssize_t m = pass ? (adv_given ? A_advr.n : 0) : n_ev;
        if (m == 0) continue;
        int64_t freed = 0;
        if (ring) {  /* the ring pages stay: only clear the mapping */
            for (Py_ssize_t i = 0; i < m; i++) {
                int64_t r = rows[i];
                int64_t old = P->front[r], new_pos = pass ? A_advp.v[i] : P->ev_front[i];
                int rc = add_release(P, &S, r, old, PDIV(P, new_pos - old), REL_CLEAR);
                n_written = S.n_rel;
                if (rc) goto refused;
                freed += PDIV(P, new_pos - old);
            }
        } else {  /* drop the SWA references of [old, new) */
            for (Py_ssize_t i = 0; i < m; i++) {
                int64_t r = rows[i];
                int64_t new_pos = pass ? A_advp.v[i] : P->ev_front[i];
                P->d_rows[i] = r; P->d_flo[i] = 0; P->d_fhi[i] = 0;
                P->d_slo[i] = PDIV(P, P->front[r]); P->d_shi[i] = PDIV(P, new_pos);
            }
            int rc = drop_emit(P, &S, m, &freed);
            n_written = S.n_rel;
            if (rc) goto refused;
        }
        for (Py_ssize_t i = 0; i < m; i++)
            set64(P, &P->front[rows[i]], pass ? A_advp.v[i] : P->ev_front[i]);
        S.evicted += freed;
    }
    /* capacity after the frees (a prefix cache's reclaim is the numpy planner's) */
    {
        int64_t need = need_dec + need_ext;
        if (need > S.full_free || (!ring && need > S.swa_free)) REFUSE(R_CAPACITY);
    }

    /* ==== phase C: allocations (planner.StepBuilder.extend); cannot fail ==== */
    {
        int64_t *al = desc + P->max_rel_rows * ROW_WIDTH;
        int64_t *res_r = P->rrows[index], *res_f = P->rfirst[index], *res_n = P->rntok[index];
        int64_t fpos = S.full_head, spos = S.swa_head, lane = 0, n_al = 0;
        Py_ssize_t n_res = 0;
        int cut_alloc = 0;  /* a row that cut its tail and allocates again in this step */
        for (int pass = 0; pass < 2; pass++) {
            const IntArg *rows = pass ? &A_extr : &A_dec;
            if (pass ? !ext_given : !A_dec.present) continue;
            for (Py_ssize_t i = 0; i < rows->n; i++) {
                int64_t r = rows->v[i], start = P->seq[r];
                int64_t n = pass ? A_extn.v[i] : (look ? 1 + A_look.v[i] : 1);
                int64_t end = start + n;
                cut_alloc |= (P->flags[r] & F_CUT) != 0;
                res_r[n_res] = r; res_f[n_res] = lane; res_n[n_res] = n; n_res++;
                if (n > 0) {
                    int64_t first_page = PCEIL(P, start);
                    int64_t n_pages = PCEIL(P, end) - first_page;
                    int64_t *row = al + n_al * ROW_WIDTH;
                    row[AL_REQ] = r; row[AL_START_POS] = start; row[AL_N_TOKENS] = n;
                    row[AL_FULL_POP] = fpos;  /* kept in [0, capacity) */
                    row[AL_SWA_POP] = ring ? 0 : spos;
                    row[AL_OUT] = lane;
                    row[AL_FLAGS] = ring ? AL_RING : 0;
                    row[AL_N_PAGES] = n_pages;
                    n_al++;
                    if (!ring) {  /* _hold_new_pages: the mirror of the pops, one ref each */
                        int32_t *prow = P->page_of + r * P->ppr + first_page;
                        for (int64_t j = 0; j < n_pages; j++) {
                            int32_t fp = P->full_ring[wrap(fpos + j, P->nf)];
                            int32_t sp = P->swa_ring[wrap(spos + j, P->ns)];
                            prow[j] = fp;
                            P->swa_of[fp] = sp;
                            P->full_ref[fp] = 1;
                            P->swa_ref[sp] = 1;
                        }
                        spos = wrap(spos + n_pages, P->ns);
                    }
                    fpos = wrap(fpos + n_pages, P->nf);
                    lane += n;
                }
                P->seq[r] = end;
                if (!pass && look) {  /* the step joins the row's speculative steps */
                    int64_t *sp = P->spec + r * P->spec_depth;
                    int slot = 0;
                    for (int j = 0; j < P->spec_depth; j++) slot += sp[j] != 0;
                    sp[slot] = n;
                } else if (P->comm) {
                    P->comm[r] = end;
                }
            }
        }
        int64_t need = need_dec + need_ext;
        S.full_head = wrap(S.full_head + need, P->nf);
        S.full_free -= need;
        if (!ring) {
            S.swa_head = wrap(S.swa_head + need, P->ns);
            S.swa_free -= need;
        }
        /* rows past this step's, up to what the buffer held before: padding again */
        if (old_rel > S.n_rel) memset(desc + S.n_rel * ROW_WIDTH, 0,
                                      (size_t)(old_rel - S.n_rel) * ROW_WIDTH * 8);
        if (old_al > P->max_alloc_rows) old_al = P->max_alloc_rows;
        if (old_al > n_al) memset(al + n_al * ROW_WIDTH, 0,
                                  (size_t)(old_al - n_al) * ROW_WIDTH * 8);
        for (int i = 0; i < N_ARGS; i++) drop_arg(all[i]);
        P->undo_n = 0;
        if (set_ring(full_ring_obj, S.full_head, S.full_free) ||
            set_ring(swa_ring_obj, S.swa_head, S.swa_free))
            return NULL;
        int64_t alloc_swa = ring ? 0 : need;
        int fusable = need <= n_free_before_full && alloc_swa <= n_free_before_swa &&
                      !cut_alloc;
        P->last_refusal = R_NONE;
        P->n_planned++;
        return Py_BuildValue("(nnLLLLLLOnO)", (Py_ssize_t)S.n_rel, (Py_ssize_t)n_al,
                             (long long)lane, (long long)S.freed_full, (long long)S.freed_swa,
                             (long long)need, (long long)alloc_swa, (long long)S.evicted,
                             fusable ? Py_True : Py_False, n_res,
                             (A_dec.present || ext_given) ? Py_True : Py_False);
    }

refused:
    undo_all(P);
    {  /* the release rows as they were: the previous step's restored, padding zeroed */
        Py_ssize_t n_old = n_written < S.old_rel ? n_written : (Py_ssize_t)S.old_rel;
        if (n_old) memcpy(desc, S.saved, (size_t)n_old * ROW_WIDTH * sizeof(int64_t));
        if (n_written > n_old)
            memset(desc + n_old * ROW_WIDTH, 0,
                   (size_t)(n_written - n_old) * ROW_WIDTH * sizeof(int64_t));
    }
refused_early:
    for (int i = 0; i < N_ARGS; i++) drop_arg(all[i]);
    P->undo_n = 0;
    P->last_refusal = S.refusal;
    P->n_refused++;
    Py_RETURN_NONE;
}

static PyObject *Planner_get_last_refusal(Planner *P, void *c) {
    (void)c; return PyLong_FromLong(P->last_refusal);
}
static PyObject *Planner_get_n_planned(Planner *P, void *c) {
    (void)c; return PyLong_FromLongLong(P->n_planned);
}
static PyObject *Planner_get_n_refused(Planner *P, void *c) {
    (void)c; return PyLong_FromLongLong(P->n_refused);
}

static PyMethodDef Planner_methods[] = {
    {"bind_ledger", (PyCFunction)Planner_bind_ledger, METH_VARARGS,
     "bind_ledger(live, seq_len, frontier, protected, committed|None, spec_steps|None)"},
    {"bind_refs", (PyCFunction)Planner_bind_refs, METH_VARARGS,
     "bind_refs(page_of, swa_of, full_ring, swa_ring, full_ref, swa_ref) or bind_refs(None)"},
    {"bind_buffer", (PyCFunction)Planner_bind_buffer, METH_VARARGS,
     "bind_buffer(i, descriptor, result_rows, result_first_lane, result_n_tokens)"},
    {"step", (PyCFunction)(void (*)(void))Planner_step, METH_FASTCALL,
     "Plan one step in place; None when not planned (nothing changed)."},
    {NULL, NULL, 0, NULL}
};

static PyGetSetDef Planner_getset[] = {
    {"last_refusal", (getter)Planner_get_last_refusal, NULL, "why the last step was not planned",
     NULL},
    {"n_planned", (getter)Planner_get_n_planned, NULL, "steps planned here", NULL},
    {"n_refused", (getter)Planner_get_n_refused, NULL, "steps handed to the numpy planner", NULL},
    {NULL, NULL, NULL, NULL, NULL}
};

static PyTypeObject PlannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "graphalloc._cplan.Planner",
    .tp_basicsize = sizeof(Planner),
    .tp_dealloc = (destructor)Planner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled step planner over one allocator's ledger (see fast_plan.py).",
    .tp_methods = Planner_methods,
    .tp_getset = Planner_getset,
    .tp_init = (initproc)Planner_init,
    .tp_new = PyType_GenericNew,
};

static PyObject *set_ndarray(PyObject *self, PyObject *t) {
    (void)self;
    if (!PyType_Check(t)) { PyErr_SetString(PyExc_TypeError, "a type"); return NULL; }
    Py_XDECREF(ndarray_type);
    Py_INCREF(t);
    ndarray_type = (PyTypeObject *)t;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_ndarray_type", set_ndarray, METH_O, "the numpy.ndarray type (arguments accepted as is)"},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef cplan_module = {
    PyModuleDef_HEAD_INIT, "graphalloc._cplan",
    "The compiled step planner (graphalloc.fast_plan wraps it).", -1, module_methods,
    NULL, NULL, NULL, NULL
};

PyMODINIT_FUNC PyInit__cplan(void) {
    if (PyType_Ready(&PlannerType) < 0) return NULL;
    S_head = PyUnicode_InternFromString("head");
    S_n_free = PyUnicode_InternFromString("n_free");
    if (!S_head || !S_n_free) return NULL;
    PyObject *m = PyModule_Create(&cplan_module);
    if (!m) return NULL;
    Py_INCREF(&PlannerType);
    if (PyModule_AddObject(m, "Planner", (PyObject *)&PlannerType) < 0) {
        Py_DECREF(&PlannerType); Py_DECREF(m); return NULL;
    }
    static const struct { const char *name; int value; } abi_table[] = {
        {"ROW_WIDTH", ROW_WIDTH}, {"REL_REQ", REL_REQ}, {"REL_START_POS", REL_START_POS},
        {"REL_N_PAGES", REL_N_PAGES}, {"REL_FLAGS", REL_FLAGS}, {"REL_SWA_PUSH", REL_SWA_PUSH},
        {"REL_FULL_PUSH", REL_FULL_PUSH}, {"REL_LANE", REL_LANE}, {"REL_EPOCH", REL_EPOCH},
        {"REL_SWA", REL_SWA}, {"REL_FULL", REL_FULL}, {"REL_CLEAR", REL_CLEAR},
        {"REL_RING_RETURN", REL_RING_RETURN}, {"AL_REQ", AL_REQ},
        {"AL_START_POS", AL_START_POS}, {"AL_N_TOKENS", AL_N_TOKENS},
        {"AL_FULL_POP", AL_FULL_POP}, {"AL_SWA_POP", AL_SWA_POP}, {"AL_OUT", AL_OUT},
        {"AL_FLAGS", AL_FLAGS}, {"AL_N_PAGES", AL_N_PAGES}, {"AL_RING", AL_RING},
        {"ACT_NONE", ACT_NONE}, {"ACT_FULL", ACT_FULL}, {"ACT_SWA", ACT_SWA},
        {"ACT_BOTH", ACT_BOTH},
    };
    PyObject *abi = PyDict_New();
    if (!abi) { Py_DECREF(m); return NULL; }
    for (size_t i = 0; i < sizeof abi_table / sizeof abi_table[0]; i++) {
        PyObject *v = PyLong_FromLong(abi_table[i].value);
        if (!v || PyDict_SetItemString(abi, abi_table[i].name, v) < 0) {
            Py_XDECREF(v); Py_DECREF(abi); Py_DECREF(m); return NULL;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObject(m, "ABI", abi) < 0) { Py_DECREF(abi); Py_DECREF(m); return NULL; }
    PyModule_AddIntConstant(m, "R_NONE", R_NONE);
    PyModule_AddIntConstant(m, "R_INPUT", R_INPUT);
    PyModule_AddIntConstant(m, "R_ROWS", R_ROWS);
    PyModule_AddIntConstant(m, "R_POSITIONS", R_POSITIONS);
    PyModule_AddIntConstant(m, "R_LENGTH", R_LENGTH);
    PyModule_AddIntConstant(m, "R_SPECULATIVE", R_SPECULATIVE);
    PyModule_AddIntConstant(m, "R_RING", R_RING);
    PyModule_AddIntConstant(m, "R_SHAPE", R_SHAPE);
    PyModule_AddIntConstant(m, "R_CAPACITY", R_CAPACITY);
    PyModule_AddIntConstant(m, "R_MIRROR", R_MIRROR);
    PyModule_AddIntConstant(m, "R_UNBOUND", R_UNBOUND);
    return m;
}
