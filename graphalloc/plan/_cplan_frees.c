/* The compiled twin's frees: plan/frees.py (release, commit, trim, evict, advance,
 * drop_handles), reference._drops and allocation.reclaim. The pools' hooks are their own
 * files' (win_*: _cplan_window.c, states_*: _cplan_states.c). See _cplan.h. */
#include "_cplan.h"

/* frees.release: free everything the requests hold and return their rows. */
int plan_release(Planner *P, Plan *S) {
    const int64_t *rows = S->a[A_RELEASE];
    Py_ssize_t n = S->n[A_RELEASE];
    TRY(live_rows(P, S, rows, n, K_RELEASE, 0));
    if (!n) return 0;
    TRY(win_release(P, S, rows, n));
    for (Py_ssize_t i = 0; i < n; i++) TRY(states_release(P, S, rows[i]));
    reset_rows(P, rows, n, 0);
    for (Py_ssize_t i = 0; i < n; i++) P->rflags[rows[i]] |= F_RELEASED;
    return 0;
}

/* frees._cut: lengths set to new_len (<= L); references to the pages wholly past it
 * dropped (ring mode: FULL freed, mapping cleared); rows that dropped pages marked cut. */
static int cut(Planner *P, Plan *S, const int64_t *rows, const int64_t *new_len, Py_ssize_t n) {
    int64_t *lo = P->t_d, *hi = P->t_e;
    for (Py_ssize_t i = 0; i < n; i++) {
        lo[i] = PCEIL(P, new_len[i]);
        hi[i] = PCEIL(P, P->seq[rows[i]]);
    }
    TRY(win_cut(P, S, rows, lo, hi, n));
    for (Py_ssize_t i = 0; i < n; i++) {
        set_seq(P, rows[i], new_len[i]);
        if (hi[i] > lo[i]) P->rflags[rows[i]] |= F_CUT;
    }
    return 0;
}

/* frees.commit: keep n of each row's oldest speculative step, the next one in flight, trim
 * the rest (C' = C + n, L' = C' + s2). */
int plan_commit(Planner *P, Plan *S) {
    const int64_t *rows = S->a[A_COMMIT_R], *cn = S->a[A_COMMIT_N];
    Py_ssize_t n = S->n[A_COMMIT_R];
    TRY(live_rows(P, S, rows, n, K_COMMIT, 0));
    if (!n) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (P->spec[rows[i] * SPEC_DEPTH] == 0)
            return refuse(S, R_NO_SPECULATIVE_STEP, K_COMMIT, rows[i], 0, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t oldest = P->spec[rows[i] * SPEC_DEPTH];
        if (cn[i] > oldest)
            return refuse(S, R_ACCEPTED_PAST_STEP, K_COMMIT, rows[i], cn[i], oldest);
    }
    int64_t *new_len = P->t_a, *committed = P->t_b;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *sp = P->spec + rows[i] * SPEC_DEPTH;
        committed[i] = P->comm[rows[i]] + cn[i];
        new_len[i] = committed[i];
        for (int j = 1; j < SPEC_DEPTH; j++) new_len[i] += sp[j];
    }
    TRY(cut(P, S, rows, new_len, n));
    for (Py_ssize_t i = 0; i < n; i++)
        TRY(states_commit(P, S, rows[i], cn[i], P->spec[rows[i] * SPEC_DEPTH]));
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t *sp = P->spec + rows[i] * SPEC_DEPTH;
        set64(P, &P->comm[rows[i]], committed[i]);
        for (int j = 0; j < SPEC_DEPTH; j++) set64(P, &sp[j], j + 1 < SPEC_DEPTH ? sp[j + 1] : 0);
    }
    return 0;
}

/* frees.shared_end: positions [0, end) of `row` lie in pages another holder references. */
static int64_t shared_end(const Planner *P, int64_t row) {
    int64_t n_pages = PCEIL(P, P->seq[row]);
    const int32_t *prow = page_row(P, row);
    for (int64_t k = 0; k < n_pages; k++)
        if (P->full_ref[prow[k]] <= 1) return k * P->ps;
    return n_pages * P->ps;
}

/* frees.trim, its rules (15 negative, 16 above L, 17 below the window's min_length, 18
 * inside a shared page), rule-major. */
static int trim_rules(Planner *P, Plan *S, const int64_t *rows, const int64_t *nl,
                      Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (nl[i] < 0) return refuse(S, R_NEGATIVE_LENGTH, K_TRIM, rows[i], nl[i], 0);
    for (Py_ssize_t i = 0; i < n; i++)
        if (nl[i] > P->seq[rows[i]])
            return refuse(S, R_TRIM_LENGTHENS, K_TRIM, rows[i], nl[i], P->seq[rows[i]]);
    TRY(win_check_trim(P, S, rows, nl, n));
    if (P->page_of) {  /* a page mirror: pages may be shared */
        for (Py_ssize_t i = 0; i < n; i++) {
            if (PMOD(P, nl[i]) == 0) continue;
            int64_t end = shared_end(P, rows[i]);
            if (nl[i] < end)
                return refuse(S, R_TRIM_INSIDE_SHARED_PAGE, K_TRIM, rows[i], nl[i], end);
        }
    }
    return 0;
}

/* frees.trim: cut each row to new_len; C' = min(C, L'); speculative steps cut at L'. */
int plan_trim(Planner *P, Plan *S) {
    const int64_t *rows = S->a[A_TRIM_R], *nl = S->a[A_TRIM_L];
    Py_ssize_t n = S->n[A_TRIM_R];
    TRY(live_rows(P, S, rows, n, K_TRIM, 0));
    if (!n) return 0;
    TRY(trim_rules(P, S, rows, nl, n));
    TRY(states_trim(P, S, rows, nl, n));
    TRY(cut(P, S, rows, nl, n));
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i], committed = P->comm[r], keep = nl[i] - committed, before = 0;
        int64_t *sp = P->spec + r * SPEC_DEPTH;
        int depth = 0;
        for (int j = 0; j < SPEC_DEPTH; j++) {
            int64_t s = sp[j], v = imin(imax(keep - before, 0), s);
            before += s;
            depth += s != 0;
            TRY(states_trim_slots(P, S, r, j, v));
            set64(P, &sp[j], v);
        }
        TRY(states_trim_newest(P, S, r, depth));
        set64(P, &P->comm[r], imin(committed, nl[i]));
    }
    return 0;
}

/* frees.advance: free the SWA pages of [frontier, new_pos) (page-aligned 19, forward only
 * 20, within the whole committed pages that existed when the step began 21). */
int plan_advance(Planner *P, Plan *S, const int64_t *rows, const int64_t *pos, Py_ssize_t n,
                 int kind, int checked) {
    if (!checked) TRY(live_rows(P, S, rows, n, kind, 0));
    if (!n) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (PMOD(P, pos[i]) != 0)
            return refuse(S, R_FRONTIER_NOT_ALIGNED, kind, rows[i], pos[i], P->ps);
    for (Py_ssize_t i = 0; i < n; i++)
        if (pos[i] < P->front[rows[i]])
            return refuse(S, R_FRONTIER_BACKWARDS, kind, rows[i], pos[i], P->front[rows[i]]);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i], limit = PFLOOR(P, imin(len_at_start(P, r), P->comm[r]));
        if (pos[i] > limit)
            return refuse(S, R_FRONTIER_PAST_COMMITTED, kind, rows[i], pos[i], limit);
    }
    Py_ssize_t m = 0;  /* the rows that move */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (pos[i] <= P->front[r]) continue;
        P->t_rows[m] = r; P->t_a[m] = 0;
        P->t_b[m] = PDIV(P, P->front[r]); P->t_c[m] = PDIV(P, pos[i]);
        P->t_d[m] = pos[i];
        m++;
    }
    if (m) TRY(win_moves_allowed(P, S, kind));  /* no window layers: no frontier to move */
    int64_t freed = 0;
    TRY(win_advance(P, S, m, &freed));
    for (Py_ssize_t i = 0; i < m; i++) set64(P, &P->front[P->t_rows[i]], P->t_d[i]);
    S->evicted += freed;
    return 0;
}

/* frees.evict + frees.window_frontier (the window pool's rule on the lengths when the step
 * began, win_target): rows, or every live row not in an open free group (rows named with
 * evict_all are checked as without it). */
int plan_evict(Planner *P, Plan *S) {
    const int64_t *rows = S->a[A_EVICT];
    Py_ssize_t n = S->n[A_EVICT];
    if (!S->evict_all && !n) return 0;
    int64_t *own = P->t_e;  /* t_rows .. t_d are advance's */
    if (n) TRY(live_rows(P, S, rows, n, K_EVICT, 0));
    if (S->evict_all) {
        n = 0;
        for (int64_t r = 0; r < P->max_reqs; r++)
            if (P->live[r] && !(S->excl_rows && S->excl_rows[r])) own[n++] = r;
        rows = own;
    }
    int64_t *target = P->spare;
    for (Py_ssize_t i = 0; i < n; i++) target[i] = win_target(P, rows[i]);
    return plan_advance(P, S, rows, target, n, K_EVICT, 1);
}

/* frees.drop_handles: one drop call over the handles in order, every reference
 * (swa_only 0) or the SWA ones only (a tombstone: SWA start becomes n). */
int drop_handles(Planner *P, Plan *S, const int64_t *h, const uint8_t *swa_only, Py_ssize_t n) {
    if (!n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t pages = PDIV(P, P->h_len[h[i]]);
        P->t_rows[i] = P->max_reqs + h[i];
        P->t_a[i] = 0;
        P->t_b[i] = swa_only[i] ? 0 : pages;
        P->t_c[i] = PDIV(P, P->h_swa[h[i]]);
        P->t_d[i] = pages;
    }
    int64_t freed;
    TRY(drop_emit(P, S, P->t_rows, P->t_a, P->t_b, P->t_c, P->t_d, n, &freed));
    for (Py_ssize_t i = 0; i < n; i++)
        if (!swa_only[i]) TRY(states_drop(P, S, h[i]));
    for (Py_ssize_t i = 0; i < n; i++)
        if (swa_only[i]) set64(P, &P->h_swa[h[i]], P->h_len[h[i]]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (swa_only[i]) continue;
        set8(P, &P->h_live[h[i]], 0);
        set64(P, &P->h_len[h[i]], 0);
        set64(P, &P->h_swa[h[i]], 0);
        P->hflags[h[i]] |= H_DROPPED;
    }
    return 0;
}

/* reference._drops: drop and drop_swa validated (each, then together once: code 7), then
 * one drop call in that order. */
int plan_drops(Planner *P, Plan *S) {
    const int64_t *d = S->a[A_DROP], *ds = S->a[A_DROP_SWA];
    Py_ssize_t nd = S->n[A_DROP], ns = S->n[A_DROP_SWA], n = nd + ns;
    if (!n) return 0;
    TRY(live_handles(P, S, d, nd, K_DROP_HANDLE, 0));
    TRY(live_handles(P, S, ds, ns, K_DROP_HANDLE_SWA, 0));
    int64_t *both = P->spare;
    uint8_t *flags = P->spare_flags;
    for (Py_ssize_t i = 0; i < n; i++) {
        both[i] = i < nd ? d[i] : ds[i - nd];
        flags[i] = i >= nd;
    }
    Py_ssize_t i = first_repeat(&P->seen_h, both, n);
    if (i >= 0) return refuse(S, R_HANDLE_REPEATED, K_DROP_HANDLE_SWA, both[i], 0, 0);
    return drop_handles(P, S, both, flags, n);
}

/* allocation.reclaim: the prefix cache's offered entries dropped in its order until the
 * pools hold what the step needs or the offer runs out: SWA by tombstoning first, then
 * FULL by evicting, then state slots by evicting (the evict offer goes on where FULL left
 * it); each drop its own call. */
int plan_reclaim(Planner *P, Plan *S, int64_t need_full, int64_t need_swa,
                 int64_t need_states) {
    static const int pools[3] = {1, 0, 2};  /* SWA (tombstones), FULL, state slots */
    for (int pass = 0; pass < 3; pass++) {
        int pool = pools[pass], tomb = pass == 0, k = tomb ? 0 : 1;  /* k: which offer */
        int64_t need = pool == 1 ? need_swa : pool == 0 ? need_full : need_states;
        const int64_t *offer = S->offer[k];
        while (S->nfree[pool] < need && S->offer_next[k] < S->n_offer[k]) {
            int64_t h = offer[S->offer_next[k]++];
            if (!P->h_live[h] || (P->hflags[h] & (H_WRITTEN | H_DROPPED | H_KEEP))
                || (tomb && P->h_swa[h] >= P->h_len[h]))
                continue;
            int64_t full0 = S->nfree[0], swa0 = S->nfree[1];
            uint8_t flag = (uint8_t)tomb;
            TRY(drop_handles(P, S, &h, &flag, 1));
            if (P->n_reclaimed == P->cap_reclaimed) {
                Py_ssize_t cap = P->cap_reclaimed ? 2 * P->cap_reclaimed : 64;
                int64_t *q = PyMem_Realloc(P->reclaimed, (size_t)cap * 4 * sizeof(int64_t));
                if (!q) { PyErr_NoMemory(); return -2; }
                P->reclaimed = q; P->cap_reclaimed = cap;
            }
            int64_t *rec = P->reclaimed + 4 * P->n_reclaimed++;
            rec[0] = h; rec[1] = tomb; rec[2] = S->nfree[0] - full0; rec[3] = S->nfree[1] - swa0;
        }
    }
    return 0;
}
