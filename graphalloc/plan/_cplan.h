/* The compiled twin of the numpy reference planner: shared types and per-row helpers.
 *
 * The twin plans one StepArrays (graphalloc/plan/step.py) exactly as
 * graphalloc/plan/reference.py:plan_step does, kind by kind in the step's order, over the
 * ledger's own arrays (bound once; Ledger.arrays() never rebinds them). Every write to the
 * ledger and the page mirror goes through the undo log below (the C twin of
 * graphalloc/state/journal.py); descriptor rows go straight into the bound descriptor
 * buffer, the rows they overwrite saved so a refusal can put them back. A refusal is five
 * integers (graphalloc/plan/refusals.py: code, kind, row, value, limit), set once, after
 * which every function returns -1 up the stack; -2 means a Python exception is set.
 *
 * Files: _cplan_core.c (undo log, validators, release rows, drop_actions + _emit),
 * _cplan_frees.c (release, commit, trim, evict, advance, drops, reclaim), _cplan_alloc.c
 * (take, admit, admit_on, decode / extend, load_back, lanes), the pools' own files --
 * _cplan_window.c (the window pool: its policies and sliding rule, pools/window.py),
 * _cplan_chunked.c (the chunk rule, pools/chunked.py), _cplan_states.c (recurrent-state
 * slots, pools/state.py) -- and _cplan.c (the Python type: binding, the step's entry,
 * finish).
 */
#ifndef GRAPHALLOC_CPLAN_H
#define GRAPHALLOC_CPLAN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---- the device ABI (kernels/abi.py; compared with it at import by compiled.py) ------- */
#define ROW_WIDTH 8
enum { REL_REQ, REL_START_POS, REL_N_PAGES, REL_FLAGS, REL_SWA_PUSH, REL_FULL_PUSH, REL_LANE,
       REL_EPOCH };
enum { AL_REQ, AL_START_POS, AL_N_TOKENS, AL_FULL_POP, AL_SWA_POP, AL_OUT, AL_FLAGS,
       AL_N_PAGES };
enum { PT_REQ, PT_SEQ_LEN, PT_END_PAGE, PT_SWA_FIRST, PT_FULL_OFF, PT_SWA_OFF, PT_LAST_LEN,
       PT_WINDOW_START };
enum { ST_KIND, ST_A, ST_B };
#define ST_SET 1
#define ST_COPY 2
#define ST_SPEC 3
#define ST_SPEC_SLOTS (ROW_WIDTH - 2)
#define ST_N_COPY 0
#define ST_N_TABLE 1
#define REL_SWA 1
#define REL_FULL 2
#define REL_CLEAR 4
#define REL_RING_RETURN 8
#define AL_RING 1
#define AL_RING_ADMIT 2
#define AL_SWA_ONLY 4
#define AL_COPY 8
#define AL_NO_WINDOW 16
/* graphalloc/state/references.py */
#define ACT_NONE 0
#define ACT_FULL 1
#define ACT_SWA 2
#define ACT_BOTH 3
#define SPEC_DEPTH 2 /* Ledger.SPEC_DEPTH */

/* Kind and RefusalCode (graphalloc/plan/refusals.py), emitted from the enums */
#include "_cplan_refusals.h"

/* StepArrays fields, in its order (evict_all is an int) */
enum { A_TAKE_H, A_TAKE_R, A_TAKE_N, A_RELEASE, A_COMMIT_R, A_COMMIT_N, A_TRIM_R, A_TRIM_L,
       A_EVICT, A_EVICT_ALL, A_ADV_R, A_ADV_P, A_DROP, A_DROP_SWA, A_ADMIT, A_ON_R, A_ON_H,
       A_ON_N, A_DEC, A_DEC_N, A_DEC_SPEC, A_EXT_R, A_EXT_N, A_LOAD_R, A_LOAD_P, N_FIELDS };

/* PlanContext's per-row marks of one step (released, allocated, cut, ring_admitted,
 * admitted) and per-handle marks (written_handles, dropped_handles) */
#define F_RELEASED 1
#define F_ALLOCATED 2
#define F_CUT 4
#define F_RING_ADMITTED 8
#define F_ADMITTED 16
#define H_WRITTEN 1
#define H_DROPPED 2
#define H_TAKEN 4 /* states.take: taken_src[h] holds the slot its snapshot copies */
#define H_KEEP 8  /* PlanContext.reclaim_keep: the step admits on it later */

#define N_HOST 5 /* host copies: full indptr, full last len, swa indptr, swa last, seq lens */

typedef struct { void *p; int64_t old; int32_t size; } UndoEntry;

/* "seen in this pass" marks without clearing: mark[i] == gen */
typedef struct { uint32_t *mark; uint32_t gen; Py_ssize_t n; } Stamp;

/* One descriptor buffer of the ring (or the scratch one) and what is written beside it. */
typedef struct {
    int64_t *desc;             /* [desc_rows, 8]: the sections of the layout given */
    int64_t *res[3];           /* result rows, first lanes, tokens: [max_reqs] */
    void *host[N_HOST];        /* the pinned host copies of the tables, or NULL */
    int host_size;             /* 4 or 8 */
    Py_buffer res_view[3];     /* the result arrays' exports (replaced by bind_results) */
} Buf;

/* The window pool (pools/window.py): its policy and rule. */
enum { WP_NONE, WP_POOLED, WP_RING };  /* NoWindow, pooled, ring */
/* A window rule (pools/window.py SlidingRule, pools/chunked.py ChunkRule, ...): its three
 * functions of the rule's tokens (w, or the chunk). Each rule is a file of its own that
 * defines one; _cplan_window.c lists them by c_kind (its RULES table). */
typedef struct {
    int64_t (*needed_from)(int64_t tokens, int64_t len);
    int64_t (*min_length)(int64_t tokens, int64_t f);
    int64_t (*lane_start)(int64_t tokens, int64_t model_window, int64_t L, int64_t q);
} WindowRule;

typedef struct {
    PyObject_HEAD
    /* config (graphalloc/config.py) */
    int ps_shift;
    int64_t ps, max_reqs, n_handles, max_ctx, max_tok_row, row_cap, max_rel, max_step_pages,
        max_al, max_step_tokens, nf, ns, ppr;
    /* the window pool: policy, rule, its tokens (w, or the chunk), ring pages (ring policy) */
    int win_policy;
    const WindowRule *rule;
    int64_t win_tokens, ring_pages;
    /* page tables (attention/spec.py), has_tables 0 when absent */
    int has_tables, csr_full, csr_swa;
    int64_t B, model_window, max_full_idx, max_swa_idx;
    /* the ledger (state/ledger.py) and page mirror (state/references.py) */
    uint8_t *live, *admitted_once, *h_live;
    int64_t *seq, *front, *comm, *spec, *h_len, *h_swa, *rings;
    /* recurrent-state slots (state/ledger.py; has_states 0 when num_state_slots is 0):
     * state_slot [max_reqs + n_handles], spec_state [max_reqs, SPEC_DEPTH, K], state_ring
     * [n_slots]; the descriptor's state section starts at row st_base, n_st_rows long */
    int has_states;
    int64_t n_slots, K, n_st_rows, st_base;
    int64_t *state_slot, *spec_state, *state_ring;
    int32_t *page_of, *swa_of, *full_ring, *swa_ring, *full_ref, *swa_ref;
    Py_buffer *views; int n_views, cap_views;
    /* descriptor buffers: n_bufs of the ring, then the scratch one; the first rows of the
     * sections this twin writes (device/layout.py, given at construction in SECTIONS order:
     * release, allocation, lanes, states; st_base above), and the rows a buffer needs */
    Buf *bufs; int n_bufs;
    int64_t rel_row, al_row, lane_row, desc_rows;
    /* per-step scratch */
    uint8_t *rflags, *hflags;
    Stamp seen_row, seen_h, seen_page;
    int64_t *len0; uint32_t *len0_gen; uint32_t step_gen;
    int64_t *t_rows, *t_a, *t_b, *t_c, *t_d, *t_e;  /* [max_reqs + n_handles] temporaries */
    int64_t *spare, *x_lane, *x_pages;                /* the same size: evict / drops, extend */
    uint8_t *spare_flags;
    int64_t *saved_rel, *saved_al;                   /* rows overwritten this step */
    int64_t *ex_r, *ex_k, *ex_pg, *ex_sp; int32_t *ex_ord; uint8_t *ex_act;
    Py_ssize_t ex_cap;
    int64_t *copies[N_FIELDS]; Py_ssize_t copy_cap[N_FIELDS];  /* strided inputs */
    int64_t *reclaimed; Py_ssize_t n_reclaimed, cap_reclaimed;  /* (h, tomb, full, swa) */
    /* one step's state rows before plan/states.finish orders them (sized at construction):
     * st_set (index, slot) pairs in write order, st_copy (source, destination) pairs,
     * st_spec (row, step, n) per speculative step, st_order the kept writes */
    int64_t *st_set, *st_copy, *st_spec, *st_order, *taken_src;
    Py_ssize_t cap_set, cap_copy;
    Stamp seen_slot, seen_index;
    UndoEntry *undo; Py_ssize_t undo_n, undo_cap; int oom;
    PyObject *empty;           /* step.EMPTY: an absent kind */
    long long n_planned, n_refused;
    long long last_ns;         /* the last plan()'s time inside C (benchmarks) */
} Planner;

/* One step being planned (the C side of PlanContext). */
typedef struct {
    const int64_t *a[N_FIELDS]; Py_ssize_t n[N_FIELDS]; int evict_all;
    const uint8_t *excl_rows, *excl_h;
    int reclaim; const int64_t *offer[2]; Py_ssize_t n_offer[2], offer_next[2];
    int64_t epoch;
    Buf *buf; int64_t *rel, *al;
    int64_t old_rel, old_al;
    int64_t n_rel, n_al, n_rel_pages, n_tokens, n_res;
    int64_t head[3], nfree[3], free_before[2];  /* the rings as the step goes (FULL, SWA,
                                                    state slots) */
    int64_t freed[2], allocd[2], evicted;
    int cut_alloc;             /* a row cut its tail and allocates again */
    Py_ssize_t undo_mark;
    int64_t refusal[5];
    /* state rows of the step (plan/states.py; the counts index the Planner's st_* arrays) */
    Py_ssize_t n_set, n_copy, n_spec, n_kept;
    int64_t n_spec_rows, old_st, n_st;
} Plan;

/* ---- arithmetic ---------------------------------------------------------------------- */
/* floor(a / ps) for any a (numpy's //): a shift for a power-of-two page size */
static inline int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
#define PDIV(P, a) ((P)->ps_shift >= 0 ? (int64_t)(a) >> (P)->ps_shift : floor_div((a), (P)->ps))
#define PCEIL(P, a) PDIV(P, (int64_t)(a) + (P)->ps - 1)
#define PFLOOR(P, a) (PDIV(P, a) * (P)->ps)
#define PMOD(P, a) ((int64_t)(a) - PFLOOR(P, a))
/* x mod m for ring positions (x in [0, 2m) in a valid ledger; any x >= 0 otherwise) */
static inline int64_t wrap(int64_t x, int64_t m) {
    return x < m ? x : (x < 2 * m ? x - m : x % m);
}
static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- the undo log (journal.py: put / add; rollback newest first) ---------------------- */
int undo_grow(Planner *P);
static inline void logged(Planner *P, void *p, int64_t old, int32_t size) {
    if (P->undo_n == P->undo_cap && undo_grow(P) < 0) return;
    UndoEntry *e = &P->undo[P->undo_n++];
    e->p = p; e->old = old; e->size = size;
}
static inline void set64(Planner *P, int64_t *p, int64_t v) {
    if (*p == v) return;
    logged(P, p, *p, 8);
    if (!P->oom) *p = v;
}
static inline void set32(Planner *P, int32_t *p, int64_t v) {
    if (*p == (int32_t)v) return;
    logged(P, p, *p, 4);
    if (!P->oom) *p = (int32_t)v;
}
static inline void set8(Planner *P, uint8_t *p, int v) {
    if (*p == (uint8_t)v) return;
    logged(P, p, *p, 1);
    if (!P->oom) *p = (uint8_t)v;
}
void undo_to(Planner *P, Py_ssize_t mark);

/* ---- ledger reads and writes ----------------------------------------------------------- */
/* PlanContext.len_at_start: seq_len when the step began (kept at its first write) */
static inline int64_t len_at_start(const Planner *P, int64_t r) {
    return P->len0_gen[r] == P->step_gen ? P->len0[r] : P->seq[r];
}
static inline void set_seq(Planner *P, int64_t r, int64_t v) {
    if (P->len0_gen[r] != P->step_gen) { P->len0[r] = P->seq[r]; P->len0_gen[r] = P->step_gen; }
    set64(P, &P->seq[r], v);
}
static inline int32_t *page_row(const Planner *P, int64_t r) { return P->page_of + r * P->ppr; }

/* ---- refusals ---------------------------------------------------------------------------- */
static inline int refuse(Plan *S, int code, int kind, int64_t row, int64_t value,
                         int64_t limit) {
    S->refusal[0] = code; S->refusal[1] = kind; S->refusal[2] = row;
    S->refusal[3] = value; S->refusal[4] = limit;
    return -1;
}
#define TRY(x) do { int rc_ = (x); if (rc_) return rc_; } while (0)

/* _cplan_core.c */
uint32_t stamp_next(Stamp *s);
Py_ssize_t first_repeat(Stamp *s, const int64_t *v, Py_ssize_t n);
int live_rows(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n, int kind, int repeats);
int free_rows(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n, int kind);
int live_handles(Planner *P, Plan *S, const int64_t *h, Py_ssize_t n, int kind, int repeats);
int64_t *next_rel_row(Planner *P, Plan *S);
int64_t *next_al_row(Planner *P, Plan *S);
void add_release(Planner *P, Plan *S, int64_t r, int64_t start_pos, int64_t n_pages,
                 int64_t flags);
int drop_emit(Planner *P, Plan *S, const int64_t *rows, const int64_t *flo, const int64_t *fhi,
              const int64_t *slo, const int64_t *shi, Py_ssize_t m, int64_t *swa_freed);
int ring_pop(Planner *P, Plan *S, int pool, int64_t n, int64_t *start);
void reset_rows(Planner *P, const int64_t *rows, Py_ssize_t n, int live);
int mirror_error(const char *what, int64_t row, int64_t value);

/* _cplan_frees.c */
int plan_release(Planner *P, Plan *S);
int plan_commit(Planner *P, Plan *S);
int plan_trim(Planner *P, Plan *S);
int plan_evict(Planner *P, Plan *S);
int plan_advance(Planner *P, Plan *S, const int64_t *rows, const int64_t *pos, Py_ssize_t n,
                 int kind, int checked);
int plan_drops(Planner *P, Plan *S);
int drop_handles(Planner *P, Plan *S, const int64_t *h, const uint8_t *swa_only, Py_ssize_t n);
int plan_reclaim(Planner *P, Plan *S, int64_t need_full, int64_t need_swa,
                 int64_t need_states);

/* _cplan_alloc.c */
int plan_take(Planner *P, Plan *S);
int plan_admit(Planner *P, Plan *S);
int plan_admit_on(Planner *P, Plan *S);
int plan_extend(Planner *P, Plan *S, const int64_t *rows, const int64_t *ntok,
                const int64_t *spec_flags, Py_ssize_t n, int kind);
int plan_load_back(Planner *P, Plan *S);
int check_lanes(Planner *P, Plan *S, int64_t *totals);
void write_lanes(Planner *P, Plan *S, const int64_t *totals);

/* _cplan_window.c (pools/window.py) and _cplan_chunked.c (pools/chunked.py) */
#define WIN_SHARES(P) ((P)->win_policy != WP_RING) /* prefix sharing, handles, a page mirror */
int64_t win_needed_from(const Planner *P, int64_t len);
int64_t win_min_length(const Planner *P, int64_t f);
int64_t win_lane_start(const Planner *P, int64_t L, int64_t q);
int64_t win_lane_first(const Planner *P, int64_t ws, int64_t end);
int64_t win_target(const Planner *P, int64_t r);
int win_check_trim(Planner *P, Plan *S, const int64_t *rows, const int64_t *nl, Py_ssize_t n);
int win_release(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n);
int win_cut(Planner *P, Plan *S, const int64_t *rows, const int64_t *lo, const int64_t *hi,
            Py_ssize_t n);
int win_moves_allowed(Planner *P, Plan *S, int kind);
int win_advance(Planner *P, Plan *S, Py_ssize_t m, int64_t *freed);
int win_check_admit(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n);
void win_admit(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n);
int64_t win_pages_needed(const Planner *P, int64_t need);
int win_check_span(Planner *P, Plan *S, const int64_t *rows, const int64_t *ntok, Py_ssize_t n,
                   int kind);
void win_row_columns(const Planner *P, int64_t *row, int64_t swa_pos);
int64_t win_take_start(const Planner *P, int64_t r, int64_t n);
int64_t win_admitted_frontier(const Planner *P, int64_t swa_start);
int win_load_back_allowed(Planner *P, Plan *S);
const WindowRule *window_rule(int64_t c_kind);  /* NULL: no such rule */

/* _cplan_states.c (pools/state.py; each a no-op without state slots) */
int states_need(Planner *P, Plan *S, int64_t n, int kind, int64_t row);
int states_take(Planner *P, Plan *S, const int64_t *h, const int64_t *rows, const int64_t *tok,
                Py_ssize_t n);
int states_release(Planner *P, Plan *S, int64_t r);
int states_commit(Planner *P, Plan *S, int64_t r, int64_t n_accepted, int64_t oldest);
int states_trim(Planner *P, Plan *S, const int64_t *rows, const int64_t *new_len, Py_ssize_t n);
int states_trim_slots(Planner *P, Plan *S, int64_t r, int step, int64_t kept);
int states_trim_newest(Planner *P, Plan *S, int64_t r, int depth_before);
int states_drop(Planner *P, Plan *S, int64_t h);
int states_admit(Planner *P, Plan *S, const int64_t *rows, Py_ssize_t n, int kind);
int states_admit_on(Planner *P, Plan *S, const int64_t *rows, const int64_t *h,
                    const int64_t *n_tokens, Py_ssize_t n);
int states_speculative(Planner *P, Plan *S, const int64_t *rows, const int64_t *ntok,
                       const int64_t *spec_flags, Py_ssize_t n, int kind);
int states_speculative_slots(Planner *P, Plan *S, int64_t r, int step, int64_t n_tokens);
int states_check(Planner *P, Plan *S);
void states_write(Planner *P, Plan *S);

#endif
