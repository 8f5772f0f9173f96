/* The compiled twin of the window pool (graphalloc/pools/window.py): what the window layers
 * hold, kind by kind, under the pool's policy (none, pooled, ring) and rule (the sliding
 * window here, the chunk rule in _cplan_chunked.c). Every policy branch of the twin lives in
 * this file; the kinds (_cplan_frees.c, _cplan_alloc.c) call these. See _cplan.h. */
#include "_cplan.h"

/* ---- the rules ------------------------------------------------------------------------ */
/* SlidingRule: the allocator's window w keeps [C - w, C); a lane's first query (at L - q)
 * reads from L - (q - 1) - W (W the page tables' model window). */
static int64_t sliding_needed_from(int64_t w, int64_t len) { return imax(len - w, 0); }
static int64_t sliding_min_length(int64_t w, int64_t f) { return f + w; }
static int64_t sliding_lane_start(int64_t w, int64_t W, int64_t L, int64_t q) {
    (void)w;
    return imax(L - (imax(q, 1) - 1) - W, 0);
}
static const WindowRule SLIDING_RULE = {sliding_needed_from, sliding_min_length,
                                        sliding_lane_start};
extern const WindowRule CHUNK_RULE;  /* _cplan_chunked.c */

/* Every rule, by its Python class's c_kind (a new rule: its file, one line here). */
static const WindowRule *const RULES[] = {&SLIDING_RULE, &CHUNK_RULE};

const WindowRule *window_rule(int64_t c_kind) {
    int64_t n = (int64_t)(sizeof RULES / sizeof RULES[0]);
    return c_kind >= 0 && c_kind < n ? RULES[c_kind] : NULL;
}

/* needed_from(len): the first position a window layer reads at committed length len. */
int64_t win_needed_from(const Planner *P, int64_t len) {
    return P->rule->needed_from(P->win_tokens, len);
}

/* min_length(f): the shortest length whose window starts at or after f (> 0). */
int64_t win_min_length(const Planner *P, int64_t f) {
    return P->rule->min_length(P->win_tokens, f);
}

/* lane_start: the first position the lane's first query reads (page tables). NoWindow: L. */
int64_t win_lane_start(const Planner *P, int64_t L, int64_t q) {
    if (P->win_policy == WP_NONE) return L;
    return P->rule->lane_start(P->win_tokens, P->model_window, L, q);
}

/* WindowPool.lane_window's first window page: ws's page; NoWindow: end (no window pages). */
int64_t win_lane_first(const Planner *P, int64_t ws, int64_t end) {
    return P->win_policy == WP_NONE ? end : PDIV(P, ws);
}

/* WindowPool.targets: max(f, floor_page(needed_from(min(L0, C)))). NoWindow: f. */
int64_t win_target(const Planner *P, int64_t r) {
    if (P->win_policy == WP_NONE) return P->front[r];
    int64_t len = imin(len_at_start(P, r), P->comm[r]);
    return imax(P->front[r], PFLOOR(P, win_needed_from(P, len)));
}

/* WindowPool.check_trim: refused when f > 0 and the new length is below min_length(f). */
int win_check_trim(Planner *P, Plan *S, const int64_t *rows, const int64_t *nl, Py_ssize_t n) {
    if (P->win_policy == WP_NONE) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t f = P->front[rows[i]], limit = win_min_length(P, f);
        if (f > 0 && nl[i] < limit)
            return refuse(S, R_TRIM_BELOW_WINDOW, K_TRIM, rows[i], nl[i], limit);
    }
    return 0;
}

/* ---- frees ------------------------------------------------------------------------------ */
/* WindowPool.release: FULL [0, ceil_page(L)) and the window's [f, ceil_page(L)); the ring
 * policy: three add_release calls, each over the rows in order. */
int win_release(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n) {
    if (P->win_policy == WP_RING) {
        for (Py_ssize_t i = 0; i < n; i++)
            add_release(P, S, rows[i], 0, PDIV(P, P->front[rows[i]]), REL_FULL);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t r = rows[i], f = P->front[r];
            add_release(P, S, r, f, PCEIL(P, P->seq[r]) - PDIV(P, f), REL_FULL | REL_CLEAR);
        }
        for (Py_ssize_t i = 0; i < n; i++)
            add_release(P, S, rows[i], 0, P->ring_pages, REL_RING_RETURN);
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i], end = PCEIL(P, P->seq[r]);
        P->t_a[i] = 0;
        P->t_b[i] = end;
        P->t_c[i] = P->win_policy == WP_NONE ? end : PDIV(P, P->front[r]);
    }
    int64_t freed;
    return drop_emit(P, S, rows, P->t_a, P->t_b, P->t_c, P->t_b, n, &freed);
}

/* WindowPool.cut: pages [lo, hi) of each row, FULL and window (ring: FULL freed, mapping
 * cleared; NoWindow: FULL only). */
int win_cut(Planner *P, Plan *S, const int64_t *rows, const int64_t *lo, const int64_t *hi,
            Py_ssize_t n) {
    if (P->win_policy == WP_RING) {
        for (Py_ssize_t i = 0; i < n; i++)
            add_release(P, S, rows[i], lo[i] * P->ps, hi[i] - lo[i], REL_FULL | REL_CLEAR);
        return 0;
    }
    int64_t freed;
    return drop_emit(P, S, rows, lo, hi, P->win_policy == WP_NONE ? hi : lo, hi, n, &freed);
}

/* WindowPool.moves_allowed: an explicit frontier move needs a window pool (46). */
int win_moves_allowed(Planner *P, Plan *S, int kind) {
    if (P->win_policy == WP_NONE) return refuse(S, R_NO_WINDOW_POOL, kind, 0, 0, 0);
    return 0;
}

/* WindowPool.advance over the m moving rows (t_rows; t_b, t_c: old and new page index):
 * pooled: their window references of [old, new) dropped; ring: the mapping cleared. */
int win_advance(Planner *P, Plan *S, Py_ssize_t m, int64_t *freed) {
    *freed = 0;
    if (P->win_policy == WP_RING) {
        for (Py_ssize_t i = 0; i < m; i++) {
            int64_t pages = P->t_c[i] - P->t_b[i];
            add_release(P, S, P->t_rows[i], P->front[P->t_rows[i]], pages, REL_CLEAR);
            *freed += pages;
        }
        return 0;
    }
    if (P->win_policy == WP_NONE) return 0;
    return drop_emit(P, S, P->t_rows, P->t_a, P->t_a, P->t_b, P->t_c, m, freed);
}

/* ---- allocations ---------------------------------------------------------------------- */
/* WindowPool.check_admit: the ring policy pops each request's ring (30 when short). */
int win_check_admit(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n) {
    int64_t R = P->ring_pages;
    if (P->win_policy == WP_RING && R * n > S->nfree[1])
        return refuse(S, R_RING_ADMIT_SHORT, K_ADMIT, rows[0], S->nfree[1], R * n);
    return 0;
}

/* WindowPool.admit (allocation.ring_admit): one AL_RING_ADMIT row per request. */
void win_admit(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n) {
    if (P->win_policy != WP_RING) return;
    int64_t R = P->ring_pages, pop;
    ring_pop(P, S, 1, R * n, &pop);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t *row = next_al_row(P, S);
        if (row) {
            memset(row, 0, ROW_WIDTH * 8);
            row[AL_REQ] = rows[i]; row[AL_SWA_POP] = wrap(pop + R * i, P->ns);
            row[AL_FLAGS] = AL_RING_ADMIT; row[AL_N_PAGES] = R;
        }
        if (P->rflags[rows[i]] & F_CUT) S->cut_alloc = 1;
        P->rflags[rows[i]] |= F_ALLOCATED | F_RING_ADMITTED;
    }
    S->allocd[1] += R * n;
}

/* WindowPool.pages_needed: window pages an allocation of `need` FULL pages pops. */
int64_t win_pages_needed(const Planner *P, int64_t need) {
    return P->win_policy == WP_POOLED ? need : 0;
}

/* WindowPool.check_span: the ring policy's pages from the frontier fit the ring (29). */
int win_check_span(Planner *P, Plan *S, const int64_t *rows, const int64_t *ntok, Py_ssize_t n,
                   int kind) {
    if (P->win_policy != WP_RING) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        int64_t span = PCEIL(P, P->seq[r] + ntok[i]) - PDIV(P, P->front[r]);
        if (span > P->ring_pages)
            return refuse(S, R_RING_SPAN_TOO_LONG, kind, r, span, P->ring_pages);
    }
    return 0;
}

/* WindowPool.pop_columns for one allocation row: the pooled pop position, the ring flag, or
 * NoWindow's flag. */
void win_row_columns(const Planner *P, int64_t *row, int64_t swa_pos) {
    if (P->win_policy == WP_POOLED) { row[AL_SWA_POP] = wrap(swa_pos, P->ns); row[AL_FLAGS] = 0; }
    else { row[AL_SWA_POP] = 0; row[AL_FLAGS] = P->win_policy == WP_RING ? AL_RING : AL_NO_WINDOW; }
}

/* WindowPool.take_start: min(f, n); NoWindow: n (nothing held). */
int64_t win_take_start(const Planner *P, int64_t r, int64_t n) {
    return P->win_policy == WP_NONE ? n : imin(P->front[r], n);
}

/* WindowPool.admitted_frontier: a request admitted on a handle starts its window pages at
 * the handle's (min(swa_start, n)); NoWindow: its frontier stays 0. */
int64_t win_admitted_frontier(const Planner *P, int64_t swa_start) {
    return P->win_policy == WP_NONE ? 0 : swa_start;
}

/* WindowPool.load_back_allowed: the ring policy has nothing to load back (31); NoWindow has
 * no frontier (46). */
int win_load_back_allowed(Planner *P, Plan *S) {
    if (P->win_policy == WP_RING)
        return refuse(S, R_LOAD_BACK_IN_RING_MODE, K_LOAD_BACK, 0, 0, 0);
    if (P->win_policy == WP_NONE) return refuse(S, R_NO_WINDOW_POOL, K_LOAD_BACK, 0, 0, 0);
    return 0;
}
