/* The compiled twin of the state pool (graphalloc/pools/state.py): recurrent-state slots
 * (who holds which slot, the state rows of a step) and the rules its hooks add (codes
 * 40-45). Every hook is a no-op without state slots (NoStates). See _cplan.h.
 *
 * The pool is the host-only FIFO ring Ledger.state_ring (n_slots entries): pops take the
 * head, pushes write the tail through the undo log, like every ledger write; the ring's
 * [head, n_free] is S->head[2] / S->nfree[2] while the step is planned (written back with
 * the page rings). The step's state rows are collected in order -- table writes (index,
 * slot), copies (source, destination), speculative steps (row, step, n) -- and laid out once
 * at the end, as states.finish does:
 *
 *     row 0                      header: [n_copy, n_table]
 *     [1, 1 + n_copy)            ST_COPY (source, destination), in the step's order
 *     then n_kept rows           ST_SET (index, slot): the last write per index, the latest
 *                                first (the reference's unique-over-reversed order)
 *     then n_spec_rows rows      ST_SPEC: each speculative step's slots, six per row
 *
 * Nothing reaches the descriptor before every refusal of the step was checked (45 last),
 * so a refused step has no state rows to put back; rows the buffer used before past the
 * section become padding (DescriptorRing.write_states). The collection arrays are sized at
 * construction from the same bound as AllocatorConfig.max_state_rows: no allocation per
 * step. Cost: O(rows + slots moved).
 */
#include "_cplan.h"

static int overflow(const char *what) {
    PyErr_Format(PyExc_RuntimeError, "compiled planner: more %s in one step than the state "
                 "section's bound allows (a planner bug)", what);
    return -2;
}

/* spec_state[r, step, :] (K slots) */
static inline int64_t *spec_slots(const Planner *P, int64_t r, int step) {
    return P->spec_state + (r * SPEC_DEPTH + step) * P->K;
}

/* states.pop, one slot: the ring's head (the caller checked states_need). */
static inline int64_t pop_slot(Planner *P, Plan *S) {
    int64_t slot = P->state_ring[S->head[2]];
    S->head[2] = wrap(S->head[2] + 1, P->n_slots);
    S->nfree[2]--;
    return slot;
}

/* states.push, one slot: written at the tail; 0 (no slot) is skipped. */
static inline void push_slot(Planner *P, Plan *S, int64_t slot) {
    if (!slot) return;
    set64(P, &P->state_ring[wrap(S->head[2] + S->nfree[2], P->n_slots)], slot);
    S->nfree[2]++;
}

/* states.set_slot: state_slot[index] = slot on the host, and its ST_SET row. */
static int set_slot(Planner *P, Plan *S, int64_t index, int64_t slot) {
    if (S->n_set == P->cap_set) return overflow("state-table writes");
    set64(P, &P->state_slot[index], slot);
    int64_t *w = P->st_set + 2 * S->n_set++;
    w[0] = index; w[1] = slot;
    return 0;
}

/* states.copy: one ST_COPY row. */
static int copy_slot(Planner *P, Plan *S, int64_t src, int64_t dst) {
    if (S->n_copy == P->cap_copy) return overflow("state copies");
    int64_t *c = P->st_copy + 2 * S->n_copy++;
    c[0] = src; c[1] = dst;
    return 0;
}

/* states.need: refuse (43) unless the pool holds n more slots, after the prefix cache's
 * offered entries were dropped (their snapshots come back). */
int states_need(Planner *P, Plan *S, int64_t n, int kind, int64_t row) {
    if (n > S->nfree[2] && S->reclaim) TRY(plan_reclaim(P, S, 0, 0, n));
    if (n > S->nfree[2]) return refuse(S, R_STATE_SLOTS_SHORT, kind, row, n, S->nfree[2]);
    return 0;
}

/* states.take: snapshots where a state exists (41: n == C when the step began), then one
 * pop per handle, its ST_SET and the copy of the row's slot into it. */
int states_take(Planner *P, Plan *S, const int64_t *h, const int64_t *rows, const int64_t *tok,
                Py_ssize_t n) {
    if (!P->has_states) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t limit = imin(len_at_start(P, rows[i]), P->comm[rows[i]]);
        if (tok[i] != limit)
            return refuse(S, R_STATE_TAKE_NOT_AT_COMMITTED, K_TAKE_HANDLE, rows[i], tok[i], limit);
    }
    TRY(states_need(P, S, n, K_TAKE_HANDLE, rows[0]));
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = pop_slot(P, S), src = P->state_slot[rows[i]];
        TRY(set_slot(P, S, P->max_reqs + h[i], slot));
        TRY(copy_slot(P, S, src, slot));
        P->taken_src[h[i]] = src;  /* an admit on h this step copies from the same state */
        P->hflags[h[i]] |= H_TAKEN;
    }
    return 0;
}

/* states.release for one row: its slot, then its speculative ones (oldest step first) back
 * to the pool; its table entry 0. */
int states_release(Planner *P, Plan *S, int64_t r) {
    if (!P->has_states) return 0;
    push_slot(P, S, P->state_slot[r]);
    for (int j = 0; j < SPEC_DEPTH; j++) {
        const int64_t *sp = spec_slots(P, r, j);
        for (int64_t i = 0; i < P->K; i++) push_slot(P, S, sp[i]);
    }
    TRY(set_slot(P, S, r, 0));
    for (int j = 0; j < SPEC_DEPTH; j++) {
        int64_t *sp = spec_slots(P, r, j);
        for (int64_t i = 0; i < P->K; i++) set64(P, &sp[i], 0);
    }
    return 0;
}

/* states.commit for one row (`oldest`: its oldest speculative step's tokens): n >= 1 keeps
 * the slot after token n - 1 (the old one and the rest of the step go back); n == 0 gives
 * the whole step back. The next step moves up. */
int states_commit(Planner *P, Plan *S, int64_t r, int64_t n_accepted, int64_t oldest) {
    if (!P->has_states) return 0;
    const int64_t *step = spec_slots(P, r, 0);
    if (n_accepted > P->K) return mirror_error("speculative step past max_spec_tokens", r,
                                               n_accepted);
    if (n_accepted > 0) push_slot(P, S, P->state_slot[r]);
    for (int64_t j = 0; j < P->K; j++)
        if (j < oldest && !(n_accepted > 0 && j == n_accepted - 1)) push_slot(P, S, step[j]);
    if (n_accepted > 0) TRY(set_slot(P, S, r, step[n_accepted - 1]));
    for (int d = 0; d < SPEC_DEPTH; d++) {
        int64_t *sp = spec_slots(P, r, d);
        const int64_t *next = d + 1 < SPEC_DEPTH ? spec_slots(P, r, d + 1) : NULL;
        for (int64_t i = 0; i < P->K; i++) set64(P, &sp[i], next ? next[i] : 0);
    }
    return 0;
}

/* states.trim: a cut below the committed length is refused (42: no state to roll back to). */
int states_trim(Planner *P, Plan *S, const int64_t *rows, const int64_t *new_len, Py_ssize_t n) {
    if (!P->has_states) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (new_len[i] < P->comm[rows[i]])
            return refuse(S, R_STATE_TRIM_BELOW_COMMITTED,
                          K_TRIM, rows[i], new_len[i], P->comm[rows[i]]);
    return 0;
}

/* states.trim_slots for one step of one row: `kept` tokens stay, the other slots go back. */
int states_trim_slots(Planner *P, Plan *S, int64_t r, int step, int64_t kept) {
    if (!P->has_states) return 0;
    int64_t *sp = spec_slots(P, r, step);
    for (int64_t i = imax(kept, 0); i < P->K; i++) {
        push_slot(P, S, sp[i]);
        set64(P, &sp[i], 0);
    }
    return 0;
}

/* states.drop for one whole drop: the snapshot back (a tombstone keeps it). */
int states_drop(Planner *P, Plan *S, int64_t h) {
    if (!P->has_states) return 0;
    int64_t index = P->max_reqs + h;
    push_slot(P, S, P->state_slot[index]);
    return set_slot(P, S, index, 0);
}

/* allocation.admit's hook (states.need + states.admit): a slot for each admitted row. */
int states_admit(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n, int kind) {
    if (!P->has_states) return 0;
    TRY(states_need(P, S, n, kind, rows[0]));
    for (Py_ssize_t i = 0; i < n; i++) TRY(set_slot(P, S, rows[i], pop_slot(P, S)));
    return 0;
}

/* states.admit_on: a request on a handle restores its snapshot (40: only at the handle's
 * length); the source is read after the pool's reclaim, a handle taken this step copies
 * from the take's source. */
int states_admit_on(Planner *P, Plan *S, const int64_t *rows, const int64_t *h,
                    const int64_t *n_tokens, Py_ssize_t n) {
    if (!P->has_states) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (n_tokens[i] != P->h_len[h[i]])
            return refuse(S, R_STATE_SHARE_NOT_AT_SNAPSHOT,
                          K_ADMIT_ON, h[i], n_tokens[i], P->h_len[h[i]]);
    TRY(states_need(P, S, n, K_ADMIT_ON, rows[0]));
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t src = P->state_slot[P->max_reqs + h[i]];
        if ((P->hflags[h[i]] & H_TAKEN) && P->taken_src[h[i]]) src = P->taken_src[h[i]];
        int64_t slot = pop_slot(P, S);
        TRY(set_slot(P, S, rows[i], slot));
        TRY(copy_slot(P, S, src, slot));
    }
    return 0;
}

/* states.speculative: a slot for every token of the new speculative steps; 44 when a step
 * is longer than max_spec_tokens, 43 when the pool is short. */
int states_speculative(Planner *P, Plan *S, const int64_t *rows, const int64_t *ntok,
                       const int64_t *spec_flags, Py_ssize_t n, int kind) {
    if (!P->has_states) return 0;
    if (!spec_flags) return 0;
    Py_ssize_t first = -1;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!spec_flags[i]) continue;
        if (first < 0) first = i;
        if (ntok[i] > P->K) return refuse(S, R_STATE_SPEC_OVER_SHAPE, kind, rows[i], ntok[i], P->K);
    }
    if (first < 0) return 0;
    for (Py_ssize_t i = 0; i < n; i++) total += spec_flags[i] ? ntok[i] : 0;
    return states_need(P, S, total, kind, rows[first]);
}

/* A row's newest speculative step for the ST_SPEC rows (plan/states.py spec_parts). */
static int spec_entry(Planner *P, Plan *S, int64_t r, int step, int64_t n_tokens) {
    if (S->n_spec == 2 * P->max_reqs) return overflow("speculative steps");
    int64_t *e = P->st_spec + 3 * S->n_spec++;
    e[0] = r; e[1] = step; e[2] = n_tokens;
    return 0;
}

/* states.speculative_slots for one row: the pops of its new step `step` (n_tokens slots). */
int states_speculative_slots(Planner *P, Plan *S, int64_t r, int step, int64_t n_tokens) {
    if (!P->has_states) return 0;
    if (step < 0 || step >= SPEC_DEPTH || n_tokens > P->K)
        return mirror_error("speculative step", r, step);
    int64_t *sp = spec_slots(P, r, step);
    for (int64_t i = 0; i < n_tokens; i++) set64(P, &sp[i], pop_slot(P, S));
    return n_tokens ? spec_entry(P, S, r, step, n_tokens) : 0;
}

/* states.trim_slots' last part: a row whose newest step was cut whole while an older one
 * stays (`depth` steps before the trim) shows that one on the device. */
int states_trim_newest(Planner *P, Plan *S, int64_t r, int depth_before) {
    if (!P->has_states) return 0;
    const int64_t *steps = P->spec + r * SPEC_DEPTH;
    int depth = 0;
    for (int j = 0; j < SPEC_DEPTH; j++) depth += steps[j] != 0;
    if (depth == 0 || depth >= depth_before) return 0;
    return spec_entry(P, S, r, depth - 1, steps[depth - 1]);
}

/* states.finish's speculative rows: the last entry per request row kept, in order (a
 * trimmed row that also decodes: its decode's step); their ST_SPEC row count. */
static void spec_dedupe(Planner *P, Plan *S) {
    uint32_t g = stamp_next(&P->seen_index);
    for (Py_ssize_t e = S->n_spec - 1; e >= 0; e--) {
        int64_t *sp = P->st_spec + 3 * e;
        if (P->seen_index.mark[sp[0]] == g) sp[2] = -1;  /* a later entry names the row */
        else P->seen_index.mark[sp[0]] = g;
    }
    Py_ssize_t m = 0;
    S->n_spec_rows = 0;
    for (Py_ssize_t e = 0; e < S->n_spec; e++) {
        const int64_t *sp = P->st_spec + 3 * e;
        if (sp[2] < 0) continue;
        memmove(P->st_spec + 3 * m++, sp, 3 * sizeof *sp);
        S->n_spec_rows += (sp[2] + ST_SPEC_SLOTS - 1) / ST_SPEC_SLOTS;
    }
    S->n_spec = m;
}

/* states.finish, its refusal and layout: 45 when a copy's destination is a slot another copy
 * of the step reads; the table writes kept (the last per index, latest first); the
 * section's size checked against the descriptor's. Writes nothing. */
int states_check(Planner *P, Plan *S) {
    if (!P->has_states) return 0;
    if (S->n_copy) {
        uint32_t g = stamp_next(&P->seen_slot);
        for (Py_ssize_t c = 0; c < S->n_copy; c++) {
            int64_t src = P->st_copy[2 * c], dst = P->st_copy[2 * c + 1];
            if (src < 0 || src > P->n_slots) return mirror_error("state slot", 0, src);
            if (dst < 0 || dst > P->n_slots) return mirror_error("state slot", 0, dst);
            P->seen_slot.mark[src] = g;
        }
        for (Py_ssize_t c = 0; c < S->n_copy; c++) {
            int64_t dst = P->st_copy[2 * c + 1];
            if (P->seen_slot.mark[dst] == g)
                return refuse(S, R_STATE_COPY_SOURCE_BUSY, K_ADMIT_ON, 0, dst, 0);
        }
    }
    uint32_t g = stamp_next(&P->seen_index);
    S->n_kept = 0;
    for (Py_ssize_t k = S->n_set - 1; k >= 0; k--) {
        int64_t index = P->st_set[2 * k];
        if (P->seen_index.mark[index] == g) continue;
        P->seen_index.mark[index] = g;
        P->st_order[S->n_kept++] = k;
    }
    spec_dedupe(P, S);
    S->n_st = 1 + S->n_copy + S->n_kept + S->n_spec_rows;
    if (S->n_st > P->n_st_rows) return overflow("state rows");
    return 0;
}

/* states.finish, its rows: the section laid out in the descriptor buffer (after
 * states_check passed); the rows this buffer used before past it become padding. */
void states_write(Planner *P, Plan *S) {
    if (!P->has_states) return;
    int64_t *out = S->buf->desc + P->st_base * ROW_WIDTH, *row = out;
    memset(out, 0, (size_t)S->n_st * ROW_WIDTH * 8);
    row[ST_N_COPY] = S->n_copy;
    row[ST_N_TABLE] = S->n_kept + S->n_spec_rows;
    for (Py_ssize_t c = 0; c < S->n_copy; c++) {
        row += ROW_WIDTH;
        row[ST_KIND] = ST_COPY; row[ST_A] = P->st_copy[2 * c]; row[ST_B] = P->st_copy[2 * c + 1];
    }
    for (Py_ssize_t q = 0; q < S->n_kept; q++) {
        const int64_t *w = P->st_set + 2 * P->st_order[q];
        row += ROW_WIDTH;
        row[ST_KIND] = ST_SET; row[ST_A] = w[0]; row[ST_B] = w[1];
    }
    int64_t table = P->max_reqs + P->n_handles;  /* the speculative entries' first index */
    for (Py_ssize_t e = 0; e < S->n_spec; e++) {
        const int64_t *sp = P->st_spec + 3 * e;
        const int64_t *slots = spec_slots(P, sp[0], (int)sp[1]);
        for (int64_t q = 0; q < sp[2]; q += ST_SPEC_SLOTS) {
            row += ROW_WIDTH;
            row[ST_KIND] = ST_SPEC; row[ST_A] = table + sp[0] * P->K + q;
            for (int64_t i = q; i < sp[2] && i < q + ST_SPEC_SLOTS; i++)
                row[ST_B + i - q] = slots[i];
        }
    }
    int64_t old = imin(S->old_st, P->n_st_rows);
    if (old > S->n_st)
        memset(out + S->n_st * ROW_WIDTH, 0, (size_t)(old - S->n_st) * ROW_WIDTH * 8);
}
