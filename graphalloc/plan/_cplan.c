/* The compiled twin of the numpy reference planner: the Python type (graphalloc.plan.
 * compiled wraps it), its bindings and one step's entry (reference.plan_step).
 *
 * Binding happens once: the ledger's arrays (state/ledger.py: never rebound), the page
 * mirror (pool mode), the recurrent-state arrays (with state slots), and per descriptor
 * buffer (the ring's, then one scratch buffer for dry runs) the descriptor, three result
 * arrays and the tables' host copies. It uses the
 * buffer protocol only (no numpy headers). See _cplan.h for the files and conventions.
 */
#include "_cplan.h"

#include <stdlib.h>
#include <time.h>

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- binding ------------------------------------------------------------------------------ */
static int is_fmt(const char *f, const char *codes) {
    if (!f) return 0;
    if (*f == '@' || *f == '=' || *f == '<') f++;
    return f[0] && !f[1] && strchr(codes, f[0]) != NULL;
}

/* A writable C-contiguous buffer of n items (n < 0: any) of `itemsize` bytes, format in
 * `codes`, kept in `view` (released by the caller). */
static int get_array(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *codes,
                     Py_ssize_t n, const char *what) {
    view->obj = NULL;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    if (view->itemsize != itemsize || !is_fmt(view->format, codes) ||
        (n >= 0 && view->len != n * itemsize)) {
        PyErr_Format(PyExc_ValueError, "compiled planner: %s has format %s, itemsize %zd, %zd "
                     "bytes; expected %zd items of %zd bytes", what, view->format ? view->format
                     : "?", view->itemsize, view->len, n, itemsize);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

/* get_array kept for the planner's lifetime; returns the data pointer or NULL. */
static void *bind(Planner *P, PyObject *obj, Py_ssize_t itemsize, const char *codes,
                  Py_ssize_t n, const char *what) {
    if (P->n_views == P->cap_views) {
        int cap = P->cap_views ? 2 * P->cap_views : 32;
        Py_buffer *v = PyMem_Realloc(P->views, (size_t)cap * sizeof(Py_buffer));
        if (!v) { PyErr_NoMemory(); return NULL; }
        P->views = v; P->cap_views = cap;
    }
    Py_buffer *view = &P->views[P->n_views];
    if (get_array(obj, view, itemsize, codes, n, what) < 0) return NULL;
    P->n_views++;
    return view->buf;
}

/* bind_ledger(live, admitted_once, seq_len, frontier, committed, spec_steps, h_live, h_len,
 * h_swa_start, rings) */
static PyObject *Planner_bind_ledger(Planner *P, PyObject *args) {
    PyObject *o[10];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                          &o[7], &o[8], &o[9]))
        return NULL;
    Py_ssize_t n = P->max_reqs, nh = P->n_handles;
    if (!(P->live = bind(P, o[0], 1, "?", n, "live")) ||
        !(P->admitted_once = bind(P, o[1], 1, "?", n, "admitted_once")) ||
        !(P->seq = bind(P, o[2], 8, "lq", n, "seq_len")) ||
        !(P->front = bind(P, o[3], 8, "lq", n, "frontier")) ||
        !(P->comm = bind(P, o[4], 8, "lq", n, "committed")) ||
        !(P->spec = bind(P, o[5], 8, "lq", n * SPEC_DEPTH, "spec_steps")) ||
        !(P->h_live = bind(P, o[6], 1, "?", nh, "h_live")) ||
        !(P->h_len = bind(P, o[7], 8, "lq", nh, "h_len")) ||
        !(P->h_swa = bind(P, o[8], 8, "lq", nh, "h_swa_start")) ||
        !(P->rings = bind(P, o[9], 8, "lq", 6, "rings")))
        return NULL;
    Py_RETURN_NONE;
}

/* bind_states(state_slot, spec_state, state_ring): the ledger's recurrent-state arrays
 * (int64 [max_reqs + n_handles], [max_reqs, SPEC_DEPTH, K], [n_slots]). */
static PyObject *Planner_bind_states(Planner *P, PyObject *args) {
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;
    if (!P->has_states)
        return PyErr_Format(PyExc_RuntimeError, "compiled planner: built without state slots");
    Py_ssize_t n = P->max_reqs;
    if (!(P->state_slot = bind(P, o[0], 8, "lq", n + P->n_handles, "state_slot")) ||
        !(P->spec_state = bind(P, o[1], 8, "lq", n * SPEC_DEPTH * P->K, "spec_state")) ||
        !(P->state_ring = bind(P, o[2], 8, "lq", P->n_slots, "state_ring")))
        return NULL;
    Py_RETURN_NONE;
}

/* bind_refs(page_of, swa_of, full_ring, swa_ring, full_ref, swa_ref) */
static PyObject *Planner_bind_refs(Planner *P, PyObject *args) {
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5])) return NULL;
    Py_ssize_t rows = P->max_reqs + P->n_handles;
    if (!(P->page_of = bind(P, o[0], 4, "i", rows * P->ppr, "page_of")) ||
        !(P->swa_of = bind(P, o[1], 4, "i", P->nf + 1, "swa_of")) ||
        !(P->full_ring = bind(P, o[2], 4, "i", P->nf, "full_ring")) ||
        !(P->swa_ring = bind(P, o[3], 4, "i", P->ns, "swa_ring")) ||
        !(P->full_ref = bind(P, o[4], 4, "i", P->nf + 1, "full_ref")) ||
        !(P->swa_ref = bind(P, o[5], 4, "i", P->ns + 1, "swa_ref")))
        return NULL;
    Py_RETURN_NONE;
}

/* bind_results(i, result_rows, result_first_lane, result_n_tokens): buffer i's result
 * arrays ([max_reqs] int64 each), replacing the ones bound before. */
static PyObject *Planner_bind_results(Planner *P, PyObject *args) {
    int i;
    PyObject *res[3];
    if (!PyArg_ParseTuple(args, "iOOO", &i, &res[0], &res[1], &res[2])) return NULL;
    if (i < 0 || i >= P->n_bufs) return PyErr_Format(PyExc_IndexError, "buffer %d", i);
    Buf *b = &P->bufs[i];
    Py_buffer v[3];
    for (int k = 0; k < 3; k++) {
        if (get_array(res[k], &v[k], 8, "lq", P->max_reqs, "result") < 0) {
            for (int j = 0; j < k; j++) PyBuffer_Release(&v[j]);
            return NULL;
        }
    }
    for (int k = 0; k < 3; k++) {
        if (b->res_view[k].obj) PyBuffer_Release(&b->res_view[k]);
        b->res_view[k] = v[k];
        b->res[k] = v[k].buf;
    }
    Py_RETURN_NONE;
}

/* bind_buffer(i, descriptor, result_rows, result_first_lane, result_n_tokens, host) with
 * host a tuple of N_HOST arrays or None (full indptr, full last page len, swa indptr, swa
 * last page len, seq lens; all int32 or all int64). */
static PyObject *Planner_bind_buffer(Planner *P, PyObject *args) {
    int i;
    PyObject *desc, *res[3], *host;
    if (!PyArg_ParseTuple(args, "iOOOOO", &i, &desc, &res[0], &res[1], &res[2], &host))
        return NULL;
    if (i < 0 || i >= P->n_bufs) return PyErr_Format(PyExc_IndexError, "buffer %d", i);
    Buf *b = &P->bufs[i];
    if (b->desc) return PyErr_Format(PyExc_RuntimeError, "buffer %d bound twice", i);
    if (!(b->desc = bind(P, desc, 8, "lq", (Py_ssize_t)P->desc_rows * ROW_WIDTH, "descriptor")))
        return NULL;
    PyObject *r = PyObject_CallMethod((PyObject *)P, "bind_results", "iOOO", i, res[0], res[1],
                                      res[2]);
    if (!r) { b->desc = NULL; return NULL; }
    Py_DECREF(r);
    if (host != Py_None) {
        if (!PyTuple_Check(host) || PyTuple_GET_SIZE(host) != N_HOST)
            return PyErr_Format(PyExc_TypeError, "host copies: a tuple of %d", N_HOST);
        for (int k = 0; k < N_HOST; k++) {
            PyObject *h = PyTuple_GET_ITEM(host, k);
            if (h == Py_None) { b->host[k] = NULL; continue; }
            Py_buffer v;
            if (PyObject_GetBuffer(h, &v, PyBUF_FORMAT) < 0) return NULL;
            int size = (int)v.itemsize;
            PyBuffer_Release(&v);
            Py_ssize_t n = P->B + (k == 0 || k == 2);
            if (!(b->host[k] = bind(P, h, size, size == 4 ? "i" : "lq", n, "host copy")))
                return NULL;
            b->host_size = size;
        }
    }
    Py_RETURN_NONE;
}

/* ---- one step's inputs --------------------------------------------------------------------- */
/* StepArrays field `i` into S (int64 1-D; strided ones copied); views released by the caller. */
static int get_field(Planner *P, Plan *S, int i, PyObject *obj, Py_buffer *view, int *held) {
    *held = 0;
    if (i == A_EVICT_ALL) {
        int t = PyObject_IsTrue(obj);
        if (t < 0) return -1;
        S->evict_all = t;
        return 0;
    }
    if (obj == P->empty) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) return -1;
    *held = 1;
    Py_ssize_t n = view->itemsize ? view->len / view->itemsize : 0;
    if (n == 0) return 0;
    if (view->ndim != 1 || view->itemsize != 8 || !is_fmt(view->format, "lq")) {
        PyErr_Format(PyExc_TypeError, "compiled planner: StepArrays field %d is not 1-D int64", i);
        return -1;
    }
    Py_ssize_t stride = view->strides ? view->strides[0] : 8;
    if (stride == 8) {
        S->a[i] = (const int64_t *)view->buf;
    } else {
        if (P->copy_cap[i] < n) {
            int64_t *c = PyMem_Realloc(P->copies[i], (size_t)n * 8);
            if (!c) { PyErr_NoMemory(); return -1; }
            P->copies[i] = c; P->copy_cap[i] = n;
        }
        for (Py_ssize_t k = 0; k < n; k++)
            P->copies[i][k] = *(const int64_t *)((const char *)view->buf + k * stride);
        S->a[i] = P->copies[i];
    }
    S->n[i] = n;
    return 0;
}

/* Shapes the normaliser guarantees (pairs of equal length, rows in range), checked again:
 * a hand-made StepArrays must not reach memory it does not own. */
static int check_fields(Planner *P, Plan *S) {
    static const int pairs[][2] = {{A_TAKE_H, A_TAKE_R}, {A_TAKE_H, A_TAKE_N},
        {A_COMMIT_R, A_COMMIT_N}, {A_TRIM_R, A_TRIM_L}, {A_ADV_R, A_ADV_P}, {A_ON_R, A_ON_H},
        {A_ON_R, A_ON_N}, {A_DEC, A_DEC_N}, {A_DEC, A_DEC_SPEC}, {A_EXT_R, A_EXT_N},
        {A_LOAD_R, A_LOAD_P}};
    static const int rows[] = {A_TAKE_R, A_RELEASE, A_COMMIT_R, A_TRIM_R, A_EVICT, A_ADV_R,
                               A_ADMIT, A_ON_R, A_DEC, A_EXT_R, A_LOAD_R};
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++)
        if (S->n[pairs[k][0]] != S->n[pairs[k][1]]) {
            PyErr_Format(PyExc_ValueError, "compiled planner: StepArrays fields %d and %d differ "
                         "in length", pairs[k][0], pairs[k][1]);
            return -1;
        }
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++)
        for (Py_ssize_t i = 0; i < S->n[rows[k]]; i++)
            if (S->a[rows[k]][i] < 0 || S->a[rows[k]][i] >= P->max_reqs) {
                PyErr_Format(PyExc_ValueError, "compiled planner: row %lld out of range",
                             (long long)S->a[rows[k]][i]);
                return -1;
            }
    return 0;
}

/* The free group's masks and the prefix cache's offer (views released by the caller). */
static int get_context(Planner *P, Plan *S, PyObject *const *o, Py_buffer *views, int *held) {
    if (o[0] != Py_None) {
        if (get_array(o[0], &views[0], 1, "?", P->max_reqs, "excluded rows") < 0) return -1;
        held[0] = 1; S->excl_rows = views[0].buf;
    }
    if (o[1] != Py_None) {
        if (get_array(o[1], &views[1], 1, "?", P->n_handles, "excluded handles") < 0) return -1;
        held[1] = 1; S->excl_h = views[1].buf;
    }
    if (o[2] == Py_None) return 0;
    if (!PyTuple_Check(o[2]) || PyTuple_GET_SIZE(o[2]) != 2) {
        PyErr_SetString(PyExc_TypeError, "reclaim: (tombstone handles, evict handles)");
        return -1;
    }
    S->reclaim = 1;
    for (int k = 0; k < 2; k++) {
        Py_buffer *v = &views[2 + k];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(o[2], k), v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return -1;
        held[2 + k] = 1;
        Py_ssize_t n = v->len / 8;
        if (n && (v->itemsize != 8 || !is_fmt(v->format, "lq"))) {
            PyErr_SetString(PyExc_TypeError, "reclaim: int64 handle arrays");
            return -1;
        }
        S->offer[k] = v->buf; S->n_offer[k] = n;
        for (Py_ssize_t i = 0; i < n; i++)
            if (S->offer[k][i] < 0 || S->offer[k][i] >= P->n_handles) {
                PyErr_SetString(PyExc_ValueError, "reclaim: a handle out of range");
                return -1;
            }
    }
    return 0;
}

/* ---- one step ----------------------------------------------------------------------------- */
/* PlanContext.reclaim_keep: the handles the step admits on, kept from reclaim (on) until
 * admit_on ran (off). */
static void keep_admit_on_handles(Planner *P, Plan *S, int on) {
    for (Py_ssize_t i = 0; i < S->n[A_ON_H]; i++) {
        int64_t h = S->a[A_ON_H][i];
        if (h < 0 || h >= P->n_handles) continue;
        if (on) P->hflags[h] |= H_KEEP;
        else P->hflags[h] &= (uint8_t)~H_KEEP;
    }
}

/* reference.plan_step: the kinds in the step's order. */
static int plan_kinds(Planner *P, Plan *S) {
    keep_admit_on_handles(P, S, 1);
    TRY(plan_take(P, S));
    TRY(plan_release(P, S));
    TRY(plan_commit(P, S));
    TRY(plan_trim(P, S));
    TRY(plan_evict(P, S));
    TRY(plan_advance(P, S, S->a[A_ADV_R], S->a[A_ADV_P], S->n[A_ADV_R], K_ADVANCE, 0));
    TRY(plan_drops(P, S));
    TRY(plan_admit(P, S));
    TRY(plan_admit_on(P, S));
    keep_admit_on_handles(P, S, 0);
    TRY(plan_extend(P, S, S->a[A_DEC], S->a[A_DEC_N], S->a[A_DEC_SPEC], S->n[A_DEC], K_DECODE));
    TRY(plan_extend(P, S, S->a[A_EXT_R], S->a[A_EXT_N], NULL, S->n[A_EXT_R], K_EXTEND));
    return plan_load_back(P, S);
}

/* reference._finish: the frozen step shape (code 35, shapes 0-3). */
static int finish(Planner *P, Plan *S) {
    if (S->n_rel > P->max_rel) return refuse(S, R_STEP_OVER_SHAPE, K_STEP, 0, S->n_rel, P->max_rel);
    if (S->n_rel_pages > P->max_step_pages)
        return refuse(S, R_STEP_OVER_SHAPE, K_STEP, 1, S->n_rel_pages, P->max_step_pages);
    if (S->n_al > P->max_al) return refuse(S, R_STEP_OVER_SHAPE, K_STEP, 2, S->n_al, P->max_al);
    if (S->n_tokens > P->max_step_tokens)
        return refuse(S, R_STEP_OVER_SHAPE, K_STEP, 3, S->n_tokens, P->max_step_tokens);
    return 0;
}

/* Rows [0, written) of a section as they were: saved ones restored, new ones zeroed. */
static void restore_rows(int64_t *base, const int64_t *saved, int64_t written, int64_t cap,
                         int64_t old) {
    if (written > cap) written = cap;
    int64_t n_old = written < old ? written : old;
    if (n_old > 0) memcpy(base, saved, (size_t)n_old * ROW_WIDTH * 8);
    if (written > n_old) memset(base + n_old * ROW_WIDTH, 0, (size_t)(written - n_old) * ROW_WIDTH * 8);
}

/* A new step: per-step marks cleared, the length snapshot's generation moved on. */
static void begin_step(Planner *P, Plan *S) {
    memset(P->rflags, 0, (size_t)P->max_reqs);
    if (P->n_handles) memset(P->hflags, 0, (size_t)P->n_handles);
    if (++P->step_gen == 0) {
        memset(P->len0_gen, 0, (size_t)P->max_reqs * sizeof(uint32_t));
        P->step_gen = 1;
    }
    for (int pool = 0; pool < 2; pool++) {
        S->head[pool] = P->rings[2 * pool];
        S->nfree[pool] = S->free_before[pool] = P->rings[2 * pool + 1];
    }
    S->head[2] = P->rings[4];
    S->nfree[2] = P->rings[5];
    S->undo_mark = P->undo_n;
    P->n_reclaimed = 0;
    P->oom = 0;
}

/* Plans S (its inputs read). 0, -1 (S->refusal set; everything rolled back) or -2. */
static int run_step(Planner *P, Plan *S, int64_t *totals) {
    begin_step(P, S);
    int rc = plan_kinds(P, S);
    if (!rc) rc = finish(P, S);
    if (!rc && P->oom) { PyErr_NoMemory(); rc = -2; }
    if (!rc && P->has_tables) rc = check_lanes(P, S, totals);
    if (!rc) rc = states_check(P, S);
    if (rc) {  /* (lanes and state rows are written only below: nothing of theirs to undo) */
        undo_to(P, S->undo_mark);
        restore_rows(S->rel, P->saved_rel, S->n_rel, P->max_rel, S->old_rel);
        restore_rows(S->al, P->saved_al, S->n_al, P->max_al, S->old_al);
        return rc;
    }
    if (P->has_tables) write_lanes(P, S, totals);
    states_write(P, S);
    for (int pool = 0; pool < 3; pool++) {
        set64(P, &P->rings[2 * pool], S->head[pool]);
        set64(P, &P->rings[2 * pool + 1], S->nfree[pool]);
    }
    if (S->old_rel > S->n_rel)  /* ring.write: rows this buffer used before become padding */
        memset(S->rel + S->n_rel * ROW_WIDTH, 0, (size_t)(S->old_rel - S->n_rel) * ROW_WIDTH * 8);
    if (S->old_al > S->n_al)
        memset(S->al + S->n_al * ROW_WIDTH, 0, (size_t)(S->old_al - S->n_al) * ROW_WIDTH * 8);
    return 0;
}

/* plan(arrays, epoch, index (-1: scratch), old_rel, old_al, old_states, excluded_rows,
 * excluded_handles, reclaim) -> (0, n_rel, n_al, n_tokens, freed FULL, freed SWA, allocated
 * FULL, allocated SWA, evicted, fusable, n_results, n_lanes, FULL indices, SWA indices,
 * n_reclaimed, n_state_rows (the header included; 0 without state slots)), or the refusal
 * (code > 0, kind, row, value, limit) with nothing changed. old_*: the rows the buffer's
 * sections held before (they become padding). */
static PyObject *Planner_plan(Planner *P, PyObject *const *args, Py_ssize_t nargs) {
    long long t0 = now_ns();
    if (nargs != 9) return PyErr_Format(PyExc_TypeError, "plan() takes 9 arguments");
    PyObject *arrays = args[0];
    if (!PyTuple_Check(arrays) || PyTuple_GET_SIZE(arrays) != N_FIELDS)
        return PyErr_Format(PyExc_TypeError, "plan(): a StepArrays of %d fields", N_FIELDS);
    if (!P->live || (WIN_SHARES(P) && !P->page_of) || (P->has_states && !P->state_slot))
        return PyErr_Format(PyExc_RuntimeError, "compiled planner: ledger not bound");
    Plan S;
    memset(&S, 0, sizeof S);
    S.epoch = PyLong_AsLongLong(args[1]);
    long index = PyLong_AsLong(args[2]);
    S.old_rel = PyLong_AsLongLong(args[3]);
    S.old_al = PyLong_AsLongLong(args[4]);
    S.old_st = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (index < 0) index = P->n_bufs - 1;  /* the scratch buffer (a dry run) */
    else if (index >= P->n_bufs - 1) index = P->n_bufs;
    if (index >= P->n_bufs || !P->bufs[index].desc)
        return PyErr_Format(PyExc_IndexError, "compiled planner: buffer %ld not bound", index);
    S.buf = &P->bufs[index];
    S.rel = S.buf->desc + P->rel_row * ROW_WIDTH; S.al = S.buf->desc + P->al_row * ROW_WIDTH;
    if (S.old_rel > P->max_rel) S.old_rel = P->max_rel;
    if (S.old_al > P->max_al) S.old_al = P->max_al;
    Py_buffer views[N_FIELDS + 4];
    int held[N_FIELDS + 4] = {0};
    int rc = 0;
    for (int i = 0; i < N_FIELDS && !rc; i++)
        rc = get_field(P, &S, i, PyTuple_GET_ITEM(arrays, i), &views[i], &held[i]);
    if (!rc) rc = check_fields(P, &S);
    if (!rc) rc = get_context(P, &S, args + 6, views + N_FIELDS, held + N_FIELDS);
    int64_t totals[3] = {0, 0, 0};
    if (!rc) rc = run_step(P, &S, totals);
    for (int i = 0; i < N_FIELDS + 4; i++)
        if (held[i]) PyBuffer_Release(&views[i]);
    P->last_ns = now_ns() - t0;
    if (rc == -1 && PyErr_Occurred()) return NULL;
    if (rc == -1) {
        P->n_refused++;
        return Py_BuildValue("(LLLLL)", (long long)S.refusal[0], (long long)S.refusal[1],
                             (long long)S.refusal[2], (long long)S.refusal[3],
                             (long long)S.refusal[4]);
    }
    if (rc) return NULL;
    P->n_planned++;
    int fusable = S.allocd[0] <= S.free_before[0] && S.allocd[1] <= S.free_before[1] &&
                  !S.cut_alloc;
    return Py_BuildValue("(iLLLLLLLLOLLLLnL)", 0, (long long)S.n_rel, (long long)S.n_al,
                         (long long)S.n_tokens, (long long)S.freed[0], (long long)S.freed[1],
                         (long long)S.allocd[0], (long long)S.allocd[1], (long long)S.evicted,
                         fusable ? Py_True : Py_False, (long long)S.n_res,
                         (long long)totals[2], (long long)totals[0], (long long)totals[1],
                         P->n_reclaimed, (long long)S.n_st);
}

static PyObject *Planner_reclaimed(Planner *P, PyObject *unused) {
    (void)unused;
    PyObject *out = PyList_New(P->n_reclaimed);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < P->n_reclaimed; i++) {
        const int64_t *r = P->reclaimed + 4 * i;
        PyObject *t = Py_BuildValue("(LOLL)", (long long)r[0], r[1] ? Py_True : Py_False,
                                    (long long)r[2], (long long)r[3]);
        if (!t) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *Planner_mark(Planner *P, PyObject *unused) {
    (void)unused;
    return PyLong_FromSsize_t(P->undo_n);
}

/* Journal.rollback(mark): the writes of every step planned after `mark` undone. */
static PyObject *Planner_rollback(Planner *P, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t mark = 0;
    if (nargs > 1) return PyErr_Format(PyExc_TypeError, "rollback([mark])");
    if (nargs == 1 && (mark = PyLong_AsSsize_t(args[0])) < 0 && PyErr_Occurred()) return NULL;
    if (mark < 0) mark = 0;
    undo_to(P, mark);
    Py_RETURN_NONE;
}

/* Journal.commit: the writes are final, the log forgotten. */
static PyObject *Planner_commit(Planner *P, PyObject *unused) {
    (void)unused;
    P->undo_n = 0;
    Py_RETURN_NONE;
}

/* ---- the type --------------------------------------------------------------------------- */
static void Planner_dealloc(Planner *P) {
    for (int i = 0; i < P->n_views; i++) PyBuffer_Release(&P->views[i]);
    PyMem_Free(P->views);
    for (int i = 0; P->bufs && i < P->n_bufs; i++)
        for (int k = 0; k < 3; k++)
            if (P->bufs[i].res_view[k].obj) PyBuffer_Release(&P->bufs[i].res_view[k]);
    PyMem_Free(P->bufs);
    void *own[] = {P->rflags, P->hflags, P->seen_row.mark, P->seen_h.mark, P->seen_page.mark,
                   P->len0, P->len0_gen, P->t_rows, P->t_a, P->t_b, P->t_c, P->t_d, P->t_e,
                   P->spare, P->x_lane, P->x_pages, P->spare_flags, P->saved_rel, P->saved_al,
                   P->reclaimed, P->st_set, P->st_copy, P->st_spec, P->st_order, P->taken_src,
                   P->seen_slot.mark, P->seen_index.mark};
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) PyMem_Free(own[i]);
    for (int i = 0; i < N_FIELDS; i++) PyMem_Free(P->copies[i]);
    void *ex[] = {P->ex_r, P->ex_k, P->ex_pg, P->ex_sp, P->ex_ord, P->ex_act, P->undo};
    for (size_t i = 0; i < sizeof ex / sizeof ex[0]; i++) free(ex[i]);
    Py_XDECREF(P->empty);
    Py_TYPE(P)->tp_free((PyObject *)P);
}

static void *zalloc(size_t n, size_t item, int *failed) {
    void *p = PyMem_Calloc(n ? n : 1, item);
    if (!p) *failed = 1;
    return p;
}

/* Planner(ps, max_reqs, n_handles, max_ctx, max_tok_row, row_cap, max_rel, max_step_pages,
 * max_al, max_step_tokens, nf, ns, ppr, n_bufs, empty, window, tables, states, sections) with
 * sections the first rows of the descriptor's sections named by SECTIONS (-1: the layout
 * has none; lanes and states must be there when tables and states are given), window
 * None (no window layers) or (rule, tokens, ring_pages) (pools/window.py: the rule's c_kind,
 * w or the chunk, 0 for the pooled policy), tables None or (B, model_window,
 * max_full_indices, max_swa_indices, csr_full, csr_swa) and states None or
 * (num_state_slots, max_spec_tokens, state rows of a descriptor, the header included);
 * n_bufs counts the ring's buffers (one scratch buffer is added). */
static int Planner_init(Planner *P, PyObject *args, PyObject *kwds) {
    (void)kwds;
    long long v[13], sec[4];
    int n_bufs;
    PyObject *empty, *window, *tables, *states;
    if (!PyArg_ParseTuple(args, "LLLLLLLLLLLLLiOOOO(LLLL)", &v[0], &v[1], &v[2], &v[3], &v[4],
                          &v[5], &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &n_bufs,
                          &empty, &window, &tables, &states, &sec[0], &sec[1], &sec[2], &sec[3]))
        return -1;
    if (P->bufs) { PyErr_SetString(PyExc_RuntimeError, "Planner initialised twice"); return -1; }
    P->ps = v[0]; P->max_reqs = v[1]; P->n_handles = v[2]; P->max_ctx = v[3];
    P->max_tok_row = v[4]; P->row_cap = v[5]; P->max_rel = v[6]; P->max_step_pages = v[7];
    P->max_al = v[8]; P->max_step_tokens = v[9]; P->nf = v[10]; P->ns = v[11]; P->ppr = v[12];
    if (P->ps <= 0 || P->max_reqs <= 0 || P->row_cap <= 0 || n_bufs < 1 || P->nf <= 0 || P->ns < 0) {
        PyErr_SetString(PyExc_ValueError, "compiled planner: bad configuration");
        return -1;
    }
    P->ps_shift = (P->ps & (P->ps - 1)) == 0 ? __builtin_ctzll((unsigned long long)P->ps) : -1;
    P->win_policy = WP_NONE;
    if (window != Py_None) {
        long long w[3];
        if (!PyArg_ParseTuple(window, "LLL", &w[0], &w[1], &w[2])) return -1;
        P->rule = window_rule(w[0]);
        if (!P->rule || w[1] <= 0 || w[2] < 0 || P->ns <= 0) {
            PyErr_SetString(PyExc_ValueError, "compiled planner: bad window pool");
            return -1;
        }
        P->win_tokens = w[1]; P->ring_pages = w[2];
        P->win_policy = w[2] > 0 ? WP_RING : WP_POOLED;
    }
    if (tables != Py_None) {
        long long t[4]; int cf, cs;
        if (!PyArg_ParseTuple(tables, "LLLLpp", &t[0], &t[1], &t[2], &t[3], &cf, &cs)) return -1;
        P->has_tables = 1; P->B = t[0]; P->model_window = t[1];
        P->max_full_idx = t[2]; P->max_swa_idx = t[3]; P->csr_full = cf; P->csr_swa = cs;
    }
    if (states != Py_None) {
        long long t[3];
        if (!PyArg_ParseTuple(states, "LLL", &t[0], &t[1], &t[2])) return -1;
        if (t[0] <= 0 || t[1] <= 0 || t[2] < 1) {
            PyErr_SetString(PyExc_ValueError, "compiled planner: bad state-slot configuration");
            return -1;
        }
        P->has_states = 1; P->n_slots = t[0]; P->K = t[1]; P->n_st_rows = t[2];
    }
    /* the sections it writes, each inside [0, desc_rows), none overlapping another */
    P->rel_row = sec[0]; P->al_row = sec[1]; P->lane_row = sec[2]; P->st_base = sec[3];
    int64_t first[4] = {sec[0], sec[1], sec[2], sec[3]};
    int64_t size[4] = {P->max_rel, P->max_al, P->has_tables ? P->B : 0,
                       P->has_states ? P->n_st_rows : 0};
    P->desc_rows = 0;
    for (int i = 0; i < 4; i++) {
        if (size[i] && first[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "compiled planner: a section it writes is missing");
            return -1;
        }
        for (int j = 0; j < i; j++) {
            if (size[i] && size[j] && first[i] < first[j] + size[j]
                    && first[j] < first[i] + size[i]) {
                PyErr_SetString(PyExc_ValueError, "compiled planner: descriptor sections overlap");
                return -1;
            }
        }
        if (size[i] && first[i] + size[i] > P->desc_rows) P->desc_rows = first[i] + size[i];
    }
    Py_INCREF(empty);
    P->empty = empty;
    P->n_bufs = n_bufs + 1;
    int failed = 0;
    size_t n = (size_t)P->max_reqs, nh = (size_t)P->n_handles, nt = n + nh;
    P->bufs = zalloc((size_t)P->n_bufs, sizeof(Buf), &failed);
    P->rflags = zalloc(n, 1, &failed); P->hflags = zalloc(nh, 1, &failed);
    P->seen_row = (Stamp){zalloc(n, 4, &failed), 0, (Py_ssize_t)n};
    P->seen_h = (Stamp){zalloc(nh, 4, &failed), 0, (Py_ssize_t)nh};
    P->seen_page = (Stamp){zalloc((size_t)P->nf + 1, 4, &failed), 0, (Py_ssize_t)P->nf + 1};
    P->len0 = zalloc(n, 8, &failed); P->len0_gen = zalloc(n, 4, &failed);
    int64_t **tmp[] = {&P->t_rows, &P->t_a, &P->t_b, &P->t_c, &P->t_d, &P->t_e, &P->spare,
                       &P->x_lane, &P->x_pages};
    for (size_t i = 0; i < sizeof tmp / sizeof tmp[0]; i++) *tmp[i] = zalloc(2 * nt, 8, &failed);
    P->spare_flags = zalloc(2 * nt, 1, &failed);
    P->saved_rel = zalloc((size_t)P->max_rel * ROW_WIDTH, 8, &failed);
    P->saved_al = zalloc((size_t)P->max_al * ROW_WIDTH, 8, &failed);
    if (P->has_states) {  /* a step writes each row and handle's entry at most twice */
        P->cap_set = 2 * (Py_ssize_t)nt; P->cap_copy = (Py_ssize_t)nt;
        P->st_set = zalloc(2 * nt, 2 * 8, &failed);
        P->st_order = zalloc(2 * nt, 8, &failed);
        P->st_copy = zalloc(nt, 2 * 8, &failed);
        P->st_spec = zalloc(2 * n, 3 * 8, &failed);  /* a trim's and a decode's */
        P->taken_src = zalloc(nh, 8, &failed);
        P->seen_slot = (Stamp){zalloc((size_t)P->n_slots + 1, 4, &failed), 0,
                               (Py_ssize_t)P->n_slots + 1};
        P->seen_index = (Stamp){zalloc(nt, 4, &failed), 0, (Py_ssize_t)nt};
    }
    if (failed) { PyErr_NoMemory(); return -1; }
    return 0;
}

static PyObject *Planner_get_n_planned(Planner *P, void *c) {
    (void)c; return PyLong_FromLongLong(P->n_planned);
}
static PyObject *Planner_get_last_ns(Planner *P, void *c) {
    (void)c; return PyLong_FromLongLong(P->last_ns);
}
static PyObject *Planner_get_n_refused(Planner *P, void *c) {
    (void)c; return PyLong_FromLongLong(P->n_refused);
}

static PyMethodDef Planner_methods[] = {
    {"bind_ledger", (PyCFunction)Planner_bind_ledger, METH_VARARGS,
     "bind_ledger(live, admitted_once, seq_len, frontier, committed, spec_steps, h_live, "
     "h_len, h_swa_start, rings)"},
    {"bind_states", (PyCFunction)Planner_bind_states, METH_VARARGS,
     "bind_states(state_slot, spec_state, state_ring)"},
    {"bind_refs", (PyCFunction)Planner_bind_refs, METH_VARARGS,
     "bind_refs(page_of, swa_of, full_ring, swa_ring, full_ref, swa_ref)"},
    {"bind_buffer", (PyCFunction)Planner_bind_buffer, METH_VARARGS,
     "bind_buffer(i, descriptor, result_rows, result_first_lane, result_n_tokens, host)"},
    {"bind_results", (PyCFunction)Planner_bind_results, METH_VARARGS,
     "bind_results(i, result_rows, result_first_lane, result_n_tokens)"},
    {"plan", (PyCFunction)(void (*)(void))Planner_plan, METH_FASTCALL,
     "plan(arrays, epoch, index, old_rel, old_al, old_states, excluded_rows, "
     "excluded_handles, reclaim)"},
    {"reclaimed", (PyCFunction)Planner_reclaimed, METH_NOARGS,
     "the last step's (handle, tombstone, FULL freed, SWA freed)"},
    {"mark", (PyCFunction)Planner_mark, METH_NOARGS, "a position in the undo log"},
    {"rollback", (PyCFunction)(void (*)(void))Planner_rollback, METH_FASTCALL,
     "rollback([mark]): undo every write after mark (default: all)"},
    {"commit", (PyCFunction)Planner_commit, METH_NOARGS, "forget the undo log"},
    {NULL, NULL, 0, NULL}
};

static PyGetSetDef Planner_getset[] = {
    {"n_planned", (getter)Planner_get_n_planned, NULL, "steps planned", NULL},
    {"n_refused", (getter)Planner_get_n_refused, NULL, "steps refused", NULL},
    {"last_ns", (getter)Planner_get_last_ns, NULL, "the last plan()'s nanoseconds in C", NULL},
    {NULL, NULL, NULL, NULL, NULL}
};

static PyTypeObject PlannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "graphalloc.plan._cplan.Planner",
    .tp_basicsize = sizeof(Planner),
    .tp_dealloc = (destructor)Planner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled twin of the numpy step planner (graphalloc.plan.compiled).",
    .tp_methods = Planner_methods,
    .tp_getset = Planner_getset,
    .tp_init = (initproc)Planner_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef cplan_module = {
    PyModuleDef_HEAD_INIT, "graphalloc.plan._cplan",
    "The compiled twin of the numpy step planner (graphalloc.plan.compiled wraps it).", -1,
    NULL, NULL, NULL, NULL, NULL
};

/* The constants this build was compiled with, for compiled.py's check against
 * kernels/abi.py, state/references.py and Ledger.SPEC_DEPTH. */
static PyObject *abi_dict(void) {
    static const struct { const char *name; int value; } table[] = {
        {"ROW_WIDTH", ROW_WIDTH}, {"REL_REQ", REL_REQ}, {"REL_START_POS", REL_START_POS},
        {"REL_N_PAGES", REL_N_PAGES}, {"REL_FLAGS", REL_FLAGS}, {"REL_SWA_PUSH", REL_SWA_PUSH},
        {"REL_FULL_PUSH", REL_FULL_PUSH}, {"REL_LANE", REL_LANE}, {"REL_EPOCH", REL_EPOCH},
        {"REL_SWA", REL_SWA}, {"REL_FULL", REL_FULL}, {"REL_CLEAR", REL_CLEAR},
        {"REL_RING_RETURN", REL_RING_RETURN}, {"AL_REQ", AL_REQ},
        {"AL_START_POS", AL_START_POS}, {"AL_N_TOKENS", AL_N_TOKENS},
        {"AL_FULL_POP", AL_FULL_POP}, {"AL_SWA_POP", AL_SWA_POP}, {"AL_OUT", AL_OUT},
        {"AL_FLAGS", AL_FLAGS}, {"AL_N_PAGES", AL_N_PAGES}, {"AL_RING", AL_RING},
        {"AL_RING_ADMIT", AL_RING_ADMIT}, {"AL_SWA_ONLY", AL_SWA_ONLY}, {"AL_COPY", AL_COPY},
        {"AL_NO_WINDOW", AL_NO_WINDOW},
        {"PT_REQ", PT_REQ}, {"PT_SEQ_LEN", PT_SEQ_LEN}, {"PT_END_PAGE", PT_END_PAGE},
        {"PT_SWA_FIRST", PT_SWA_FIRST}, {"PT_FULL_OFF", PT_FULL_OFF},
        {"PT_SWA_OFF", PT_SWA_OFF}, {"PT_LAST_LEN", PT_LAST_LEN},
        {"PT_WINDOW_START", PT_WINDOW_START}, {"ST_KIND", ST_KIND}, {"ST_A", ST_A},
        {"ST_B", ST_B}, {"ST_SET", ST_SET}, {"ST_COPY", ST_COPY}, {"ST_SPEC", ST_SPEC},
        {"ST_SPEC_SLOTS", ST_SPEC_SLOTS}, {"ST_N_COPY", ST_N_COPY},
        {"ST_N_TABLE", ST_N_TABLE},
        {"ACT_NONE", ACT_NONE}, {"ACT_FULL", ACT_FULL}, {"ACT_SWA", ACT_SWA},
        {"ACT_BOTH", ACT_BOTH}, {"SPEC_DEPTH", SPEC_DEPTH}, {"N_FIELDS", N_FIELDS},
    };
    PyObject *abi = PyDict_New();
    for (size_t i = 0; abi && i < sizeof table / sizeof table[0]; i++) {
        PyObject *v = PyLong_FromLong(table[i].value);
        if (!v || PyDict_SetItemString(abi, table[i].name, v) < 0) {
            Py_XDECREF(v); Py_CLEAR(abi);
        } else {
            Py_DECREF(v);
        }
    }
    return abi;
}

/* The names of refusals.Kind and refusals.RefusalCode as this build knows them
 * (_cplan_refusals.h): compared with the enums at import (compiled.py). */
static PyObject *refusal_dict(void) {
    static const struct { const char *name; int value; } table[] = { REFUSAL_TABLE };
    PyObject *d = PyDict_New();
    for (size_t i = 0; d && i < sizeof table / sizeof table[0]; i++) {
        PyObject *v = PyLong_FromLong(table[i].value);
        if (!v || PyDict_SetItemString(d, table[i].name, v) < 0) {
            Py_XDECREF(v); Py_CLEAR(d);
        } else {
            Py_DECREF(v);
        }
    }
    return d;
}

PyMODINIT_FUNC PyInit__cplan(void) {
    if (PyType_Ready(&PlannerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&cplan_module);
    if (!m) return NULL;
    Py_INCREF(&PlannerType);
    PyObject *abi = abi_dict();
    if (PyModule_AddObject(m, "Planner", (PyObject *)&PlannerType) < 0) {
        Py_DECREF(&PlannerType); Py_XDECREF(abi); Py_DECREF(m); return NULL;
    }
    if (!abi || PyModule_AddObject(m, "ABI", abi) < 0) { Py_XDECREF(abi); Py_DECREF(m); return NULL; }
    PyObject *refusals = refusal_dict();
    if (!refusals || PyModule_AddObject(m, "REFUSALS", refusals) < 0) {
        Py_XDECREF(refusals); Py_DECREF(m); return NULL;
    }
    /* the descriptor sections (device/layout.py) whose first rows Planner() takes, in order */
    PyObject *sections = Py_BuildValue("(ssss)", "release", "allocation", "lanes", "states");
    if (!sections || PyModule_AddObject(m, "SECTIONS", sections) < 0) {
        Py_XDECREF(sections); Py_DECREF(m); return NULL;
    }
    PyObject *fields = Py_BuildValue("(sssssssssssssssssssssssss)", "take_handle", "take_row",
        "take_tokens", "release", "commit_row", "commit_n", "trim_row", "trim_len", "evict",
        "evict_all", "advance_row", "advance_pos", "drop", "drop_swa", "admit", "admit_on_row",
        "admit_on_handle", "admit_on_tokens", "decode", "decode_n", "decode_spec", "extend_row",
        "extend_n", "load_row", "load_pos");
    if (!fields || PyModule_AddObject(m, "FIELDS", fields) < 0) {
        Py_XDECREF(fields); Py_DECREF(m); return NULL;
    }
    return m;
}
