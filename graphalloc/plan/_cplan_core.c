/* The compiled twin's machinery: undo log, validators, release rows, and the drop of
 * references (state/references.py:drop_actions + plan/frees.py:_emit). See _cplan.h. */
#include "_cplan.h"

#include <stdlib.h>

/* ---- undo log (state/journal.py) ------------------------------------------------------- */
/* Doubles the log; on failure marks the planner out of memory (the write is skipped, so the
 * ledger stays what the log can restore) and the step is refused with MemoryError. */
int undo_grow(Planner *P) {
    Py_ssize_t cap = P->undo_cap ? 2 * P->undo_cap : 4096;
    UndoEntry *u = (UndoEntry *)realloc(P->undo, (size_t)cap * sizeof(UndoEntry));
    if (!u) { P->oom = 1; return -1; }
    P->undo = u; P->undo_cap = cap;
    return 0;
}

/* Journal.rollback(mark): every write after `mark` undone, newest first. */
void undo_to(Planner *P, Py_ssize_t mark) {
    for (Py_ssize_t i = P->undo_n - 1; i >= mark; i--) {
        UndoEntry *e = &P->undo[i];
        if (e->size == 8) *(int64_t *)e->p = e->old;
        else if (e->size == 4) *(int32_t *)e->p = (int32_t)e->old;
        else *(uint8_t *)e->p = (uint8_t)e->old;
    }
    if (mark < P->undo_n) P->undo_n = mark;
}

int mirror_error(const char *what, int64_t row, int64_t value) {
    PyErr_Format(PyExc_RuntimeError, "compiled planner: the page mirror is corrupt (%s: row "
                 "%lld, value %lld); check_integrity() says where", what, (long long)row,
                 (long long)value);
    return -2;
}

/* ---- validators (plan/context.py) -------------------------------------------------------- */
uint32_t stamp_next(Stamp *s) {
    if (++s->gen == 0) {
        memset(s->mark, 0, (size_t)s->n * sizeof(uint32_t));
        s->gen = 1;
    }
    return s->gen;
}

/* context.first_repeat: index of the first entry equal to an earlier one, or -1. */
Py_ssize_t first_repeat(Stamp *s, const int64_t *v, Py_ssize_t n) {
    if (n < 2) return -1;
    uint32_t g = stamp_next(s);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s->mark[v[i]] == g) return i;
        s->mark[v[i]] = g;
    }
    return -1;
}

/* PlanContext.live_rows: live, not released in this step or an open free group (code 1),
 * each once unless `repeats` (code 2). */
int live_rows(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n, int kind, int repeats) {
    if (!n) return 0;
    const uint8_t *excl = S->excl_rows;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (P->live[r] && !(excl && excl[r])) continue;
        int state = (excl && excl[r]) ? 3 : (P->rflags[r] & F_RELEASED) ? 2
                    : P->admitted_once[r] ? 1 : 0;
        return refuse(S, R_ROW_NOT_LIVE, kind, r, state, 0);
    }
    if (!repeats) {
        Py_ssize_t i = first_repeat(&P->seen_row, rows, n);
        if (i >= 0) return refuse(S, R_ROW_REPEATED, kind, rows[i], 0, 0);
    }
    return 0;
}

/* PlanContext.free_rows: not live, not released here or in an open group (3), not admitted
 * twice (4). */
int free_rows(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n, int kind) {
    if (!n) return 0;
    const uint8_t *excl = S->excl_rows;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        uint8_t f = P->rflags[r];
        if (!(P->live[r] || (f & (F_RELEASED | F_ADMITTED)) || (excl && excl[r]))) continue;
        if (f & F_ADMITTED) return refuse(S, R_ROW_ADMITTED_TWICE, kind, r, 0, 0);
        int state = (excl && excl[r]) ? 2 : (f & F_RELEASED) ? 1 : 0;
        return refuse(S, R_ROW_NOT_FREE, kind, r, state, 0);
    }
    Py_ssize_t i = first_repeat(&P->seen_row, rows, n);
    if (i >= 0) return refuse(S, R_ROW_ADMITTED_TWICE, kind, rows[i], 0, 0);
    return 0;
}

/* PlanContext.live_handles: a window pool that shares (9), in range and held (5), not written in this step
 * (6), each once unless `repeats` (7). Rule-major. */
int live_handles(Planner *P, Plan *S, const int64_t *h, Py_ssize_t n, int kind, int repeats) {
    if (!n) return 0;
    if (!WIN_SHARES(P)) return refuse(S, R_SHARING_NEEDS_POOL_MODE, kind, 0, 0, 0);
    int64_t nh = P->n_handles;
    for (Py_ssize_t i = 0; i < n; i++)
        if (h[i] < 0 || h[i] >= nh) return refuse(S, R_HANDLE_NOT_HELD, kind, h[i], 0, nh);
    const uint8_t *excl = S->excl_h;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t x = h[i];
        int dropped = (P->hflags[x] & H_DROPPED) != 0, ex = excl && excl[x];
        if (P->h_live[x] && !dropped && !ex) continue;
        return refuse(S, R_HANDLE_NOT_HELD, kind, x, ex ? 2 : dropped ? 3 : 1, nh);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (P->hflags[h[i]] & H_WRITTEN)
            return refuse(S, R_HANDLE_WRITTEN_THIS_STEP, kind, h[i], 0, 0);
    if (!repeats) {
        Py_ssize_t i = first_repeat(&P->seen_h, h, n);
        if (i >= 0) return refuse(S, R_HANDLE_REPEATED, kind, h[i], 0, 0);
    }
    return 0;
}

/* ---- descriptor rows ------------------------------------------------------------------- */
/* The next release / allocation row, its old contents saved for a refusal; NULL past the
 * frozen shape (the step is then refused by _finish: its rows are counted, not written). */
int64_t *next_rel_row(Planner *P, Plan *S) {
    int64_t i = S->n_rel++;
    if (i >= P->max_rel) return NULL;
    int64_t *row = S->rel + i * ROW_WIDTH;
    if (i < S->old_rel) memcpy(P->saved_rel + i * ROW_WIDTH, row, ROW_WIDTH * 8);
    return row;
}

int64_t *next_al_row(Planner *P, Plan *S) {
    int64_t i = S->n_al++;
    if (i >= P->max_al) return NULL;
    int64_t *row = S->al + i * ROW_WIDTH;
    if (i < S->old_al) memcpy(P->saved_al + i * ROW_WIDTH, row, ROW_WIDTH * 8);
    return row;
}

/* frees.add_release for one segment: rows of at most max_pages_per_row pages, lanes and
 * push positions in row order (a call over several rows is these calls in row order). */
void add_release(Planner *P, Plan *S, int64_t r, int64_t start_pos, int64_t n_pages,
                 int64_t flags) {
    if (n_pages <= 0) return;
    int64_t cap = P->row_cap;
    for (int64_t done = 0; done < n_pages; done += cap) {
        int64_t n = n_pages - done < cap ? n_pages - done : cap;
        int64_t *row = next_rel_row(P, S);
        int64_t swa_push = 0, full_push = 0;
        if (flags & (REL_SWA | REL_RING_RETURN)) {
            swa_push = wrap(S->head[1] + S->nfree[1], P->ns);
            S->nfree[1] += n; S->freed[1] += n;
        }
        if (flags & REL_FULL) {
            full_push = wrap(S->head[0] + S->nfree[0], P->nf);
            S->nfree[0] += n; S->freed[0] += n;
        }
        if (row) {
            row[REL_REQ] = r; row[REL_START_POS] = start_pos + done * P->ps;
            row[REL_N_PAGES] = n; row[REL_FLAGS] = flags;
            row[REL_SWA_PUSH] = swa_push; row[REL_FULL_PUSH] = full_push;
            row[REL_LANE] = S->n_rel_pages; row[REL_EPOCH] = S->epoch;
        }
        S->n_rel_pages += n;
    }
}

/* FreeRing.pop: `n` entries at the head of pool 0 (FULL) or 1 (SWA); *start the first. */
int ring_pop(Planner *P, Plan *S, int pool, int64_t n, int64_t *start) {
    *start = S->head[pool];
    S->head[pool] = wrap(S->head[pool] + n, pool ? P->ns : P->nf);
    S->nfree[pool] -= n;
    return 0;
}

/* Ledger.reset_rows: empty requests (live) or free rows, journaled. */
void reset_rows(Planner *P, const int64_t *rows, Py_ssize_t n, int live) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        set8(P, &P->live[r], live);
        if (live) set8(P, &P->admitted_once[r], 1);
        set_seq(P, r, 0);
        set64(P, &P->front[r], 0);
        set64(P, &P->comm[r], 0);
        for (int j = 0; j < SPEC_DEPTH; j++) set64(P, &P->spec[r * SPEC_DEPTH + j], 0);
    }
}

/* ---- dropping references --------------------------------------------------------------- */
static int ensure_exam(Planner *P, Py_ssize_t need) {
    if (need <= P->ex_cap) return 0;
    Py_ssize_t cap = P->ex_cap ? P->ex_cap : 1024;
    while (cap < need) cap *= 2;
    void *p[6] = {P->ex_r, P->ex_k, P->ex_pg, P->ex_sp, P->ex_ord, P->ex_act};
    size_t item[6] = {8, 8, 8, 8, 4, 1};
    for (int i = 0; i < 6; i++) {
        void *q = realloc(p[i], (size_t)cap * item[i]);
        if (!q) { PyErr_NoMemory(); return -2; }
        p[i] = q;
    }
    P->ex_r = p[0]; P->ex_k = p[1]; P->ex_pg = p[2]; P->ex_sp = p[3];
    P->ex_ord = p[4]; P->ex_act = p[5]; P->ex_cap = cap;
    return 0;
}

/* drop_actions, part 1: examine each row's pages (FULL range, or the SWA range when the
 * FULL one is empty) and drop the counts. Returns the entries examined, or -2. */
static Py_ssize_t drop_examine(Planner *P, const int64_t *rows, const int64_t *flo,
                               const int64_t *fhi, const int64_t *slo, const int64_t *shi,
                               Py_ssize_t m) {
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int full = fhi[i] - flo[i] > 0;
        int64_t lo = full ? flo[i] : slo[i], hi = full ? fhi[i] : shi[i];
        if (hi > lo) total += hi - lo;
    }
    if (ensure_exam(P, total)) return -2;
    Py_ssize_t t = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int full = fhi[i] - flo[i] > 0;
        int64_t r = rows[i], lo = full ? flo[i] : slo[i], hi = full ? fhi[i] : shi[i];
        if (hi <= lo) continue;
        if (lo < 0 || hi > P->ppr) return mirror_error("page index", r, lo < 0 ? lo : hi);
        const int32_t *prow = page_row(P, r);
        for (int64_t k = lo; k < hi; k++, t++) {
            int64_t page = prow[k];
            if (page < 0 || page > P->nf) return mirror_error("page_of", r, page);
            int64_t sp = P->swa_of[page];
            if (sp < 0 || sp > P->ns) return mirror_error("swa_of", page, sp);
            if (full) set32(P, &P->full_ref[page], P->full_ref[page] - 1);
            if (k >= slo[i] && k < shi[i]) set32(P, &P->swa_ref[sp], P->swa_ref[sp] - 1);
            P->ex_r[t] = r; P->ex_k[t] = k; P->ex_pg[t] = page; P->ex_sp[t] = sp;
        }
    }
    return t;
}

/* drop_actions, part 2: each entry's action from the counts after the whole call; a page
 * freed by several entries only at its first; FULL-only pages first (stable). Fills ex_ord
 * and returns the kept count. */
static Py_ssize_t drop_order(Planner *P, Py_ssize_t t) {
    uint32_t g = stamp_next(&P->seen_page);
    Py_ssize_t n_keep = 0, n_full = 0;
    for (Py_ssize_t j = 0; j < t; j++) {
        int64_t page = P->ex_pg[j], sp = P->ex_sp[j];
        int act = P->full_ref[page] == 0 ? (sp > 0 ? ACT_BOTH : ACT_FULL)
                  : (sp > 0 && P->swa_ref[sp] == 0) ? ACT_SWA : ACT_NONE;
        P->ex_act[j] = (uint8_t)act;
        if (act == ACT_NONE || P->seen_page.mark[page] == g) { P->ex_act[j] = ACT_NONE; continue; }
        P->seen_page.mark[page] = g;
        n_keep++;
        n_full += act == ACT_FULL;
    }
    Py_ssize_t a = 0, b = n_full;  /* phase 1 then phase 2, each in entry order */
    for (Py_ssize_t j = 0; j < t; j++) {
        if (P->ex_act[j] == ACT_NONE) continue;
        P->ex_ord[P->ex_act[j] == ACT_FULL ? a++ : b++] = (int32_t)j;
    }
    return n_keep;
}

/* frees._emit: the freed pages as release rows (consecutive pages of one row with one
 * action are one segment) and the host mirror: the rings' pushed entries, SWA mappings
 * cleared. Returns the SWA pages freed. */
static int64_t emit(Planner *P, Plan *S, Py_ssize_t n_keep) {
    int64_t swa_freed = 0;
    Py_ssize_t s = 0;
    while (s < n_keep) {
        int32_t j0 = P->ex_ord[s];
        int64_t r = P->ex_r[j0], k0 = P->ex_k[j0];
        int act = P->ex_act[j0];
        Py_ssize_t e = s + 1;
        while (e < n_keep) {
            int32_t j = P->ex_ord[e];
            if (P->ex_r[j] != r || P->ex_act[j] != act || P->ex_k[j] != k0 + (e - s)) break;
            e++;
        }
        int64_t flags = act == ACT_FULL ? REL_FULL
                        : act == ACT_BOTH ? (REL_SWA | REL_FULL | REL_CLEAR) : (REL_SWA | REL_CLEAR);
        int64_t full_tail = S->head[0] + S->nfree[0], swa_tail = S->head[1] + S->nfree[1];
        add_release(P, S, r, k0 * P->ps, e - s, flags);
        for (Py_ssize_t q = s; q < e; q++) {
            int32_t j = P->ex_ord[q];
            int64_t page = P->ex_pg[j];
            if (act != ACT_SWA) set32(P, &P->full_ring[wrap(full_tail++, P->nf)], page);
            if (act != ACT_FULL) {
                set32(P, &P->swa_ring[wrap(swa_tail++, P->ns)], P->ex_sp[j]);
                set32(P, &P->swa_of[page], 0);
                swa_freed++;
            }
        }
        s = e;
    }
    return swa_freed;
}

/* frees._drop: one drop call (drop_actions, then _emit). Row rows[i] drops its FULL
 * references of page indices [flo, fhi) and SWA of [slo, shi). *swa_freed: SWA pages freed. */
int drop_emit(Planner *P, Plan *S, const int64_t *rows, const int64_t *flo, const int64_t *fhi,
              const int64_t *slo, const int64_t *shi, Py_ssize_t m, int64_t *swa_freed) {
    *swa_freed = 0;
    Py_ssize_t t = drop_examine(P, rows, flo, fhi, slo, shi, m);
    if (t < 0) return (int)t;
    if (t == 0) return 0;
    Py_ssize_t n_keep = drop_order(P, t);
    if (n_keep) *swa_freed = emit(P, S, n_keep);
    return 0;
}
