/* The compiled twin's allocations: plan/allocation.py (take, admit, admit_on, extend for
 * decode and extend, load_back) and plan/lanes.py (attention lane rows and host copies).
 * The pools' hooks are their own files' (win_*: _cplan_window.c, states_*:
 * _cplan_states.c). See _cplan.h. */
#include "_cplan.h"

/* allocation._hold (+ _copy_row): dst takes references to src's pages of [0, n_tokens)
 * (SWA: [swa_start, n_tokens)), and one AL_COPY row when there are pages. */
static int hold(Planner *P, Plan *S, int64_t dst, int64_t src, int64_t n_tokens,
                int64_t swa_start) {
    int64_t n_pages = PDIV(P, n_tokens);
    if (n_pages > P->ppr) return mirror_error("page index", src, n_pages);
    const int32_t *from = page_row(P, src);
    int32_t *to = page_row(P, dst);
    for (int64_t k = 0; k < n_pages; k++) {
        int64_t page = from[k];
        if (page < 0 || page > P->nf) return mirror_error("page_of", src, page);
        set32(P, &to[k], page);
        set32(P, &P->full_ref[page], P->full_ref[page] + 1);
    }
    for (int64_t k = PDIV(P, swa_start); k < n_pages; k++) {
        int64_t sp = P->swa_of[from[k]];
        if (sp < 0 || sp > P->ns) return mirror_error("swa_of", from[k], sp);
        set32(P, &P->swa_ref[sp], P->swa_ref[sp] + 1);
    }
    if (n_pages) {
        int64_t *row = next_al_row(P, S);
        if (row) {
            memset(row, 0, ROW_WIDTH * 8);
            row[AL_REQ] = dst; row[AL_FULL_POP] = src; row[AL_FLAGS] = AL_COPY;
            row[AL_N_PAGES] = n_pages;
        }
    }
    return 0;
}

/* allocation.take: rules (9 pool mode, 5 range, 8 held, 7 once, rows live, 10 whole pages,
 * 11 within the committed length when the step began), rule-major, then the holds. */
int plan_take(Planner *P, Plan *S) {
    const int64_t *h = S->a[A_TAKE_H], *rows = S->a[A_TAKE_R], *tok = S->a[A_TAKE_N];
    Py_ssize_t n = S->n[A_TAKE_H];
    if (!n) return 0;
    if (!WIN_SHARES(P)) return refuse(S, R_SHARING_NEEDS_POOL_MODE, K_TAKE_HANDLE, 0, 0, 0);
    for (Py_ssize_t i = 0; i < n; i++)
        if (h[i] < 0 || h[i] >= P->n_handles)
            return refuse(S, R_HANDLE_NOT_HELD, K_TAKE_HANDLE, h[i], 0, P->n_handles);
    for (Py_ssize_t i = 0; i < n; i++)
        if (P->h_live[h[i]]) return refuse(S, R_HANDLE_HELD, K_TAKE_HANDLE, h[i], 0, 0);
    Py_ssize_t rep = first_repeat(&P->seen_h, h, n);
    if (rep >= 0) return refuse(S, R_HANDLE_REPEATED, K_TAKE_HANDLE, h[rep], 0, 0);
    TRY(live_rows(P, S, rows, n, K_TAKE_HANDLE, 1));
    for (Py_ssize_t i = 0; i < n; i++)
        if (PMOD(P, tok[i]) != 0)
            return refuse(S, R_NOT_WHOLE_PAGES, K_TAKE_HANDLE, rows[i], tok[i], P->ps);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t limit = imin(len_at_start(P, rows[i]), P->comm[rows[i]]);
        if (tok[i] <= 0 || tok[i] > limit)
            return refuse(S, R_TAKE_PAST_COMMITTED, K_TAKE_HANDLE, rows[i], tok[i], limit);
    }
    TRY(states_take(P, S, h, rows, tok, n));
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t swa_start = win_take_start(P, rows[i], tok[i]);
        set8(P, &P->h_live[h[i]], 1);
        set64(P, &P->h_len[h[i]], tok[i]);
        set64(P, &P->h_swa[h[i]], swa_start);
        TRY(hold(P, S, P->max_reqs + h[i], rows[i], tok[i], swa_start));
    }
    for (Py_ssize_t i = 0; i < n; i++) P->hflags[h[i]] |= H_WRITTEN;
    return 0;
}

/* allocation.admit: free rows become empty requests; the window pool's ring policy pops
 * each one's ring (win_admit; code 30 when short). */
int plan_admit(Planner *P, Plan *S) {
    const int64_t *rows = S->a[A_ADMIT];
    Py_ssize_t n = S->n[A_ADMIT];
    TRY(free_rows(P, S, rows, n, K_ADMIT));
    if (!n) return 0;
    TRY(win_check_admit(P, S, rows, n));
    TRY(states_admit(P, S, rows, n, K_ADMIT));
    reset_rows(P, rows, n, 1);
    for (Py_ssize_t i = 0; i < n; i++) P->rflags[rows[i]] |= F_ADMITTED;
    win_admit(P, S, rows, n);
    return 0;
}

/* allocation.admit_on: free rows become requests sharing handles' first n tokens (-1: all
 * of them): L = C = n, f = min(swa_start, n), the same references, the prefix copied. */
int plan_admit_on(Planner *P, Plan *S) {
    const int64_t *rows = S->a[A_ON_R], *h = S->a[A_ON_H], *nt = S->a[A_ON_N];
    Py_ssize_t n = S->n[A_ON_R];
    if (!n) return 0;
    if (!WIN_SHARES(P)) return refuse(S, R_SHARING_NEEDS_POOL_MODE, K_ADMIT_ON, 0, 0, 0);
    TRY(free_rows(P, S, rows, n, K_ADMIT_ON));
    TRY(live_handles(P, S, h, n, K_ADMIT_ON, 1));
    int64_t *m = P->x_lane;
    for (Py_ssize_t i = 0; i < n; i++) m[i] = nt[i] < 0 ? P->h_len[h[i]] : nt[i];
    for (Py_ssize_t i = 0; i < n; i++)
        if (PMOD(P, m[i]) != 0) return refuse(S, R_NOT_WHOLE_PAGES, K_ADMIT_ON, h[i], m[i], P->ps);
    for (Py_ssize_t i = 0; i < n; i++)
        if (m[i] <= 0 || m[i] > P->h_len[h[i]])
            return refuse(S, R_SHARE_PAST_HANDLE, K_ADMIT_ON, h[i], m[i], P->h_len[h[i]]);
    TRY(states_admit_on(P, S, rows, h, m, n));
    reset_rows(P, rows, n, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i], swa_start = imin(P->h_swa[h[i]], m[i]);
        P->rflags[r] |= F_ADMITTED;
        set_seq(P, r, m[i]);
        set64(P, &P->front[r], win_admitted_frontier(P, swa_start));
        set64(P, &P->comm[r], m[i]);
        TRY(hold(P, S, r, P->max_reqs + h[i], m[i], swa_start));
    }
    return 0;
}

/* allocation.extend, its rules after live_rows: 22/23 allocating twice, 24 speculative
 * steps full, 25 a speculative tail, 26 past max_context_len, 27 past the frozen row. */
static int extend_rules(Planner *P, Plan *S, const int64_t *rows, const int64_t *ntok,
                        const int64_t *spec_flags, Py_ssize_t n, int kind) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t f = P->rflags[rows[i]];
        if (f & F_ALLOCATED)
            return refuse(S, (f & F_RING_ADMITTED) ? R_RING_ADMIT_ALLOCATES
                                                   : R_ROW_ALLOCATES_TWICE, kind, rows[i], 0, 0);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (spec_flags && spec_flags[i] && P->spec[rows[i] * SPEC_DEPTH + SPEC_DEPTH - 1])
            return refuse(S, R_SPECULATION_TOO_DEEP, kind, rows[i], 0, SPEC_DEPTH);
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *sp = P->spec + rows[i] * SPEC_DEPTH;
        if ((spec_flags && spec_flags[i]) || !sp[0]) continue;
        int64_t tail = 0;
        for (int j = 0; j < SPEC_DEPTH; j++) tail += sp[j];
        return refuse(S, R_SPECULATIVE_TAIL_PENDING, kind, rows[i], tail, 0);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t end = P->seq[rows[i]] + ntok[i];
        if (end > P->max_ctx) return refuse(S, R_PAST_CONTEXT, kind, rows[i], end, P->max_ctx);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (ntok[i] > P->max_tok_row)
            return refuse(S, R_ROW_OVER_TOKEN_SHAPE, kind, rows[i], ntok[i], P->max_tok_row);
    return 0;
}

/* allocation._hold_new_pages: row r gets the popped pages at page indices from
 * ceil(start / ps), one reference each (window pages too when `window`). */
static int hold_new_pages(Planner *P, int64_t r, int64_t start, int64_t pages, int64_t fpos,
                          int64_t spos, int window) {
    int64_t first = PCEIL(P, start);
    if (first + pages > P->ppr) return mirror_error("page index", r, first + pages);
    int32_t *prow = page_row(P, r) + first;
    for (int64_t j = 0; j < pages; j++) {
        int64_t fp = P->full_ring[wrap(fpos + j, P->nf)];
        if (fp < 0 || fp > P->nf) return mirror_error("ring", r, fp);
        set32(P, &prow[j], fp);
        set32(P, &P->full_ref[fp], 1);
        if (!window) continue;
        int64_t sp = P->swa_ring[wrap(spos + j, P->ns)];
        if (sp < 0 || sp > P->ns) return mirror_error("ring", r, sp);
        set32(P, &P->swa_of[fp], sp);
        set32(P, &P->swa_ref[sp], 1);
    }
    return 0;
}

/* allocation.extend, its writes: rows, pops, mirror, lengths, speculative steps, results. */
static int extend_write(Planner *P, Plan *S, const int64_t *rows, const int64_t *ntok,
                        const int64_t *spec_flags, Py_ssize_t n, int64_t need,
                        int64_t need_swa) {
    int64_t fpop = S->head[0], spop = S->head[1], lane = S->n_tokens, pb = 0;
    if (need) ring_pop(P, S, 0, need, &fpop);
    if (need_swa) ring_pop(P, S, 1, need_swa, &spop);
    int64_t *res_r = S->buf->res[0], *res_f = S->buf->res[1], *res_n = S->buf->res[2];
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i], t = ntok[i], start = P->seq[r], pages = P->x_pages[i];
        res_r[S->n_res] = r; res_f[S->n_res] = lane; res_n[S->n_res] = t; S->n_res++;
        if (t > 0) {
            int64_t *row = next_al_row(P, S);
            if (row) {
                row[AL_REQ] = r; row[AL_START_POS] = start; row[AL_N_TOKENS] = t;
                row[AL_FULL_POP] = wrap(fpop + pb, P->nf);
                win_row_columns(P, row, spop + pb);
                row[AL_OUT] = lane; row[AL_N_PAGES] = pages;
            }
            if (P->page_of && need)
                TRY(hold_new_pages(P, r, start, pages, fpop + pb, spop + pb, need_swa > 0));
            pb += pages;
            lane += t;
        }
        int64_t *sp = P->spec + r * SPEC_DEPTH;
        if (spec_flags && spec_flags[i]) {  /* the step joins the row's speculative steps */
            int slot = 0;
            for (int j = 0; j < SPEC_DEPTH; j++) slot += sp[j] != 0;
            set64(P, &sp[slot], t);
            TRY(states_speculative_slots(P, S, r, slot, t));
        } else {
            set64(P, &P->comm[r], start + t);
        }
        set_seq(P, r, start + t);
        if (P->rflags[r] & F_CUT) S->cut_alloc = 1;
        P->rflags[r] |= F_ALLOCATED;
    }
    S->n_tokens = lane;
    S->allocd[0] += need;
    S->allocd[1] += need_swa;
    return 0;
}

/* allocation.extend: allocate ntok[i] positions for rows[i] (lanes in row order); refused
 * whole when a pool is short (28, after the prefix cache's reclaim) or a ring span is too
 * long (29). spec_flags: per row 1 for a speculative step (decode with lookahead), or NULL. */
int plan_extend(Planner *P, Plan *S, const int64_t *rows, const int64_t *ntok,
                const int64_t *spec_flags, Py_ssize_t n, int kind) {
    TRY(live_rows(P, S, rows, n, kind, 0));
    if (!n) return 0;
    TRY(extend_rules(P, S, rows, ntok, spec_flags, n, kind));
    int64_t need = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t start = P->seq[rows[i]];
        P->x_pages[i] = PCEIL(P, start + ntok[i]) - PCEIL(P, start);
        need += P->x_pages[i];
    }
    int64_t need_swa = win_pages_needed(P, need);
    if ((need > S->nfree[0] || need_swa > S->nfree[1]) && S->reclaim)
        TRY(plan_reclaim(P, S, need, need_swa, 0));
    if (need > S->nfree[0])
        return refuse(S, R_PAGES_SHORT, kind, 0, need - S->nfree[0], S->nfree[0]);
    if (need_swa > S->nfree[1])
        return refuse(S, R_PAGES_SHORT, kind, 1, need_swa - S->nfree[1], S->nfree[1]);
    TRY(win_check_span(P, S, rows, ntok, n, kind));
    TRY(states_speculative(P, S, rows, ntok, spec_flags, n, kind));
    return extend_write(P, S, rows, ntok, spec_flags, n, need, need_swa);
}

/* allocation.load_back, its rules after live_rows: 31 pool mode, 22 allocating twice, 19
 * page-aligned, 32 back into [0, f], 33 pages nobody maps (nor an earlier row of the step
 * loads back), 34 the frozen row, 28 SWA short. */
static int load_back_rules(Planner *P, Plan *S, const int64_t *rows, const int64_t *pos,
                           Py_ssize_t n, int64_t *need) {
    const int k = K_LOAD_BACK;
    for (Py_ssize_t i = 0; i < n; i++)
        if (P->rflags[rows[i]] & F_ALLOCATED)
            return refuse(S, R_ROW_ALLOCATES_TWICE, k, rows[i], 0, 0);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PMOD(P, pos[i]) != 0)
            return refuse(S, R_FRONTIER_NOT_ALIGNED, k, rows[i], pos[i], P->ps);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t old = P->front[rows[i]];
        if (pos[i] < 0 || pos[i] > old)
            return refuse(S, R_LOAD_BACK_OUTSIDE_FRONTIER, k, rows[i], pos[i], old);
    }
    uint32_t g = stamp_next(&P->seen_page);  /* pages an earlier row of the step loads back */
    for (Py_ssize_t i = 0; i < n; i++) {
        const int32_t *prow = page_row(P, rows[i]);
        int64_t lo = PDIV(P, pos[i]), hi = PDIV(P, P->front[rows[i]]);
        for (int64_t q = lo; q < hi; q++) {
            if (P->swa_of[prow[q]] || P->seen_page.mark[prow[q]] == g)
                return refuse(S, R_LOAD_BACK_MAPPED_PAGE, k, rows[i], pos[i] + (q - lo) * P->ps, 0);
            P->seen_page.mark[prow[q]] = g;
        }
    }
    *need = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t len = (P->front[rows[i]] - pos[i]);  /* (old - new) // ps * ps: aligned */
        if (len > P->max_tok_row)
            return refuse(S, R_LOAD_BACK_OVER_TOKEN_SHAPE, k, rows[i], len, P->max_tok_row);
        *need += PDIV(P, len);
    }
    if (*need > S->nfree[1])
        return refuse(S, R_PAGES_SHORT, k, 1, *need - S->nfree[1], S->nfree[1]);
    return 0;
}

/* allocation.load_back: frontiers moved back to pos, the FULL pages of [pos, f) re-paired
 * with fresh SWA pages (one AL_SWA_ONLY row each; its lanes are the SWA slots). */
int plan_load_back(Planner *P, Plan *S) {
    const int64_t *rows = S->a[A_LOAD_R], *pos = S->a[A_LOAD_P];
    Py_ssize_t n = S->n[A_LOAD_R];
    if (!n) return 0;
    TRY(win_load_back_allowed(P, S));
    TRY(live_rows(P, S, rows, n, K_LOAD_BACK, 0));
    int64_t need, spop = 0, before = 0, lane = S->n_tokens;
    TRY(load_back_rules(P, S, rows, pos, n, &need));
    if (need) ring_pop(P, S, 1, need, &spop);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i], pages = PDIV(P, P->front[r] - pos[i]), first = PDIV(P, pos[i]);
        S->buf->res[0][S->n_res] = r; S->buf->res[1][S->n_res] = lane;
        S->buf->res[2][S->n_res] = pages * P->ps; S->n_res++;
        if (pages > 0) {
            int64_t *row = next_al_row(P, S);
            if (row) {
                row[AL_REQ] = r; row[AL_START_POS] = pos[i]; row[AL_N_TOKENS] = pages * P->ps;
                row[AL_FULL_POP] = 0; row[AL_SWA_POP] = wrap(spop + before, P->ns);
                row[AL_OUT] = lane; row[AL_FLAGS] = AL_SWA_ONLY; row[AL_N_PAGES] = pages;
            }
            const int32_t *prow = page_row(P, r) + first;
            for (int64_t j = 0; j < pages; j++) {
                int64_t sp = P->swa_ring[wrap(spop + before + j, P->ns)];
                if (sp < 0 || sp > P->ns) return mirror_error("swa_ring", r, sp);
                set32(P, &P->swa_of[prow[j]], sp);
                set32(P, &P->swa_ref[sp], 1);
            }
            before += pages;
            lane += pages * P->ps;
        }
        set64(P, &P->front[r], pos[i]);
        if (P->rflags[r] & F_CUT) S->cut_alloc = 1;
        P->rflags[r] |= F_ALLOCATED;
    }
    S->n_tokens = lane;
    S->allocd[1] += need;
    return 0;
}

/* lanes.plan_lanes for lane i: row, query tokens (decode rows, then extend rows with new
 * tokens); the values of its row. */
static void lane_values(const Planner *P, const Plan *S, Py_ssize_t i, int64_t *v) {
    Py_ssize_t nd = S->n[A_DEC];
    int64_t r, q;
    if (i < nd) { r = S->a[A_DEC][i]; q = S->a[A_DEC_N][i]; }
    else { r = S->a[A_EXT_R][i - nd]; q = S->a[A_EXT_N][i - nd]; }
    int64_t L = P->seq[r], f = P->front[r], end = PCEIL(P, L);
    int64_t ws = imax(win_lane_start(P, L, q), f);
    v[PT_REQ] = r; v[PT_SEQ_LEN] = L; v[PT_END_PAGE] = end;
    v[PT_SWA_FIRST] = win_lane_first(P, ws, end);
    v[PT_LAST_LEN] = L > 0 ? L - (end - 1) * P->ps : 0; v[PT_WINDOW_START] = ws;
}

static inline void host_put(void *arr, int size, Py_ssize_t i, int64_t v) {
    if (!arr) return;
    if (size == 4) ((int32_t *)arr)[i] = (int32_t)v;
    else ((int64_t *)arr)[i] = v;
}

/* lanes.plan_lanes, its refusals (35, shapes 4-6): totals = (FULL indices, SWA indices,
 * lanes); the extend rows with tokens listed in t_rows for write_lanes. Writes nothing. */
int check_lanes(Planner *P, Plan *S, int64_t *totals) {
    Py_ssize_t nd = S->n[A_DEC], ne = S->n[A_EXT_R], n = nd, B = (Py_ssize_t)P->B;
    for (Py_ssize_t i = 0; i < ne; i++) {
        if (S->a[A_EXT_N][i] > 0) P->t_rows[n - nd] = i, n++;
    }
    if (n > B) return refuse(S, R_STEP_OVER_SHAPE, K_STEP, 4, n, B);
    int64_t v[ROW_WIDTH], full = 0, swa = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        lane_values(P, S, i < nd ? i : nd + P->t_rows[i - nd], v);
        full += v[PT_END_PAGE]; swa += v[PT_END_PAGE] - v[PT_SWA_FIRST];
    }
    if (full > P->max_full_idx && P->csr_full)
        return refuse(S, R_STEP_OVER_SHAPE, K_STEP, 5, full, P->max_full_idx);
    if (swa > P->max_swa_idx && P->csr_swa)
        return refuse(S, R_STEP_OVER_SHAPE, K_STEP, 6, swa, P->max_swa_idx);
    totals[0] = full; totals[1] = swa; totals[2] = n;
    return 0;
}

/* lanes.plan_lanes, its rows: the step's batch as B lane rows (padding lanes carry the
 * running offsets) and the host copies (after check_lanes and every other refusal). */
void write_lanes(Planner *P, Plan *S, const int64_t *totals) {
    Py_ssize_t nd = S->n[A_DEC], n = (Py_ssize_t)totals[2], B = (Py_ssize_t)P->B;
    int64_t full = 0, swa = 0;
    int64_t *out = S->buf->desc + P->lane_row * ROW_WIDTH;
    void **host = S->buf->host;
    int hs = S->buf->host_size;
    for (Py_ssize_t i = 0; i < B; i++, out += ROW_WIDTH) {
        if (i < n) lane_values(P, S, i < nd ? i : nd + P->t_rows[i - nd], out);
        else memset(out, 0, ROW_WIDTH * 8);
        out[PT_FULL_OFF] = full; out[PT_SWA_OFF] = swa;
        host_put(host[0], hs, i, full); host_put(host[2], hs, i, swa);
        host_put(host[1], hs, i, out[PT_LAST_LEN]);
        host_put(host[3], hs, i, out[PT_END_PAGE] > out[PT_SWA_FIRST] ? out[PT_LAST_LEN] : 0);
        host_put(host[4], hs, i, out[PT_SEQ_LEN]);
        full += out[PT_END_PAGE]; swa += out[PT_END_PAGE] - out[PT_SWA_FIRST];
    }
    host_put(host[0], hs, B, full); host_put(host[2], hs, B, swa);
}
