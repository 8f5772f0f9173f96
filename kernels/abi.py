"""The device ABI: what the host writes and the kernels read, and how kernels report faults.

This is the bottom of the house. It imports nothing from graphalloc; the kernels
define their behaviour against it and the runtime (planner, executor, integrity
checks) imports it. A change here is a change of every kernel and of the planner.

Step descriptor
---------------
A step is two tables of int64 rows, ``ROW_WIDTH`` = 8 columns each (64 bytes, one
vector load per program), written by the host planner and read by the kernels.

Release rows, one per segment of one request::

    col  name          meaning
    0    REL_REQ       request row r of req_to_token
    1    REL_START_POS first position s of the segment (page-aligned)
    2    REL_N_PAGES   pages in the segment; 0 marks a padded row (exits at once)
    3    REL_FLAGS     REL_SWA | REL_FULL | REL_CLEAR | REL_RING_RETURN
    4    REL_SWA_PUSH  free-ring position where SWA page j is pushed (+ j, mod capacity)
    5    REL_FULL_PUSH free-ring position where FULL page j is pushed (+ j, mod capacity)
    6    REL_LANE      exclusive prefix sum of pages: the row's first page lane
    7    REL_EPOCH     the step's epoch (> 0, a step counter; 0 skips validate mode's
                       duplicate-free check for the row)

    For page j < n: rep = req_to_token[r, s + j*ps]; the full page is rep // ps.
    REL_SWA:   peer = full_to_swa[rep]; push peer // ps (0, the sink marker, and a
               fault, when unmapped).
    REL_CLEAR: zero full_to_swa over the whole full page (a partial tail too).
    REL_FULL:  push the full page.
    REL_RING_RETURN: push ring_pages[r, q0 + j] (ring mode release; q0 = s // ps, the
               row's first ring column, so a ring split over rows returns each page once).

Allocation rows, one per allocating request::

    col  name          meaning
    0    AL_REQ        request row r
    1    AL_START_POS  first new position s (may be mid-page: the page is continued)
    2    AL_N_TOKENS   tokens to allocate; 0 with AL_N_PAGES 0 marks a padded row
    3    AL_FULL_POP   free-ring position of the first popped FULL page
    4    AL_SWA_POP    free-ring position of the first popped SWA page
    5    AL_OUT        exclusive prefix sum of tokens: the row's first output lane
    6    AL_FLAGS      AL_RING (SWA slot from the request's ring) | AL_RING_ADMIT |
                       AL_SWA_ONLY (re-pair existing FULL pages with popped SWA pages) |
                       AL_COPY (copy another row's prefix: shared pages) |
                       AL_NO_WINDOW (a model without window layers: FULL pages only, no
                       SWA page popped or mapped, the SWA output lanes hold 0 * ps + off) |
                       AL_NO_OUT (with AL_SWA_ONLY: no output lanes; the row's tokens are
                       not bounded by the launch's n_lanes)
    7    AL_N_PAGES    new pages (informative); for AL_RING_ADMIT, ring pages to pop;
                       for AL_SWA_ONLY, the SWA pages to pop

    AL_COPY (prefix sharing): req_to_token[r, t] = req_to_token[src, t] for t < n_pages*ps,
    src = the AL_FULL_POP column (a request row or a handle row); n_tokens is 0 (no output
    lanes, no pops): a new request or handle takes references to existing pages.

    AL_SWA_ONLY (load-back): for page k < n_pages of ``[s, s + n_pages*ps)`` the FULL page
    is req_to_token[r, s + k*ps] // ps (it exists), the SWA page is popped at
    AL_SWA_POP + k, and the page-dense mapping is written; the output lanes get the
    SWA slots of the n_tokens = n_pages*ps positions (where the caller copies KV back).
    With AL_NO_OUT nothing is written to the output lanes: a further window pool's new
    pages (graphalloc.pools.extra_window) are paired this way, launched over that pool's
    tables after the step's main allocation wrote req_to_token.

Padded rows are marked in the row itself, so no program reads a shared header from
host memory. Free lists are FIFO rings: pops take from the head, pushes go to the
tail, positions wrap at the pool's page count. The host owns head and fill count and
writes the positions into the rows, so no shape or address depends on device data.

Step stamp
----------
Beside each descriptor buffer the host keeps one int64 word in pinned memory, the step's
*stamp* (``DescriptorRing.stamp(i)``): a plan serial, > 0, larger for every plan, written
when the step is planned. The device keeps ``seen`` (int64, ``SEEN_WORDS`` = 2 entries,
``DeviceState.seen_buf``)::

    SEEN_MAX    the largest stamp any step kernel has read
    SEEN_COUNT  steps counted: program 0 of each step kernel (release, allocate, fused)
                does old = atomic_max(seen[SEEN_MAX], stamp); if old < stamp: SEEN_COUNT += 1

so the two kernels of one step count it once. ``check()`` compares SEEN_COUNT with the
submitted steps that had rows: a ``mark_submitted`` without a replay shows there
(:mod:`graphalloc.kernels.stamp`). Cost: one 8-byte pinned read and one atomic per kernel,
program 0 only.

Error word
----------
``err`` (int64, ``ERR_WORDS`` = 8 entries, on the device)::

    ERR_CODES   OR of every FaultCode bit seen since the last reset
    ERR_COUNT   number of faulting lanes since the last reset
    ERR_CLAIMED 0 until the first fault claims the record below (compare-and-swap)
    ERR_CODE    first fault's code (its lowest bit)
    ERR_ROW     first fault's descriptor row
    ERR_REQ     first fault's request
    ERR_PAGE    first fault's page (full page for release, popped value for alloc)
    ERR_STAGE   first fault's stage: STAGE_NAMES[stage]
"""

from __future__ import annotations

__all__ = [
    "ROW_WIDTH",
    "REL_REQ", "REL_START_POS", "REL_N_PAGES", "REL_FLAGS", "REL_SWA_PUSH", "REL_FULL_PUSH",
    "REL_LANE", "REL_EPOCH",
    "REL_SWA", "REL_FULL", "REL_CLEAR", "REL_RING_RETURN",
    "AL_REQ", "AL_START_POS", "AL_N_TOKENS", "AL_FULL_POP", "AL_SWA_POP", "AL_OUT", "AL_FLAGS",
    "AL_N_PAGES", "AL_RING", "AL_RING_ADMIT", "AL_SWA_ONLY", "AL_COPY", "AL_NO_WINDOW",
    "AL_NO_OUT",
    "ERR_CODES", "ERR_COUNT", "ERR_CLAIMED", "ERR_CODE", "ERR_ROW", "ERR_REQ", "ERR_PAGE",
    "ERR_STAGE", "ERR_WORDS", "SEEN_MAX", "SEEN_COUNT", "SEEN_WORDS",
    "STAGE_RELEASE", "STAGE_ALLOC", "STAGE_SINGLE", "STAGE_NAMES",
    "FaultCode", "FAULT_NAMES", "N_FAULT_BITS",
]

ROW_WIDTH = 8

# ---- release rows ----------------------------------------------------------------------
REL_REQ, REL_START_POS, REL_N_PAGES, REL_FLAGS, REL_SWA_PUSH, REL_FULL_PUSH, REL_LANE = range(7)
REL_EPOCH = 7
REL_SWA, REL_FULL, REL_CLEAR, REL_RING_RETURN = 1, 2, 4, 8

# ---- allocation rows -------------------------------------------------------------------
AL_REQ, AL_START_POS, AL_N_TOKENS, AL_FULL_POP, AL_SWA_POP, AL_OUT, AL_FLAGS, AL_N_PAGES = range(8)
AL_RING, AL_RING_ADMIT, AL_SWA_ONLY, AL_COPY, AL_NO_WINDOW = 1, 2, 4, 8, 16
AL_NO_OUT = 32  # with AL_SWA_ONLY: no output lanes (a further window pool's new pages)

# ---- error word ------------------------------------------------------------------------
ERR_CODES, ERR_COUNT, ERR_CLAIMED, ERR_CODE, ERR_ROW, ERR_REQ, ERR_PAGE, ERR_STAGE = range(8)
ERR_WORDS = 8

# ---- step stamp ------------------------------------------------------------------------
SEEN_MAX, SEEN_COUNT = 0, 1
SEEN_WORDS = 2
STAGE_RELEASE, STAGE_ALLOC, STAGE_SINGLE = 0, 1, 2
STAGE_NAMES = {STAGE_RELEASE: "release", STAGE_ALLOC: "alloc", STAGE_SINGLE: "single-call"}


class FaultCode:
    """Bits of the device error word. Each is set by a kernel, never by a device assert."""

    UNMAPPED_PEER = 1  # a freed full page had no live SWA peer (mapping 0)
    SINK_POP = 2  # an allocation popped the sink marker (page 0) from a free list
    NOT_PAGE_DENSE = 4  # validate mode: a page's slots do not map into one SWA page
    OUT_OF_RANGE = 8  # validate mode: a representative or popped page is out of range
    DUPLICATE_FREE = 16  # validate mode: one page pushed twice in one step
    MAPPED_PEER = 32  # validate mode: a load-back onto a full page that still has an SWA peer


N_FAULT_BITS = 6  # FaultCode bits 1 .. 32

FAULT_NAMES = {
    FaultCode.UNMAPPED_PEER: "unmapped SWA peer (full_to_swa == 0 for a freed page)",
    FaultCode.SINK_POP: "sink marker popped from a free list (a page was lost earlier)",
    FaultCode.NOT_PAGE_DENSE: "mapping not page-dense",
    FaultCode.OUT_OF_RANGE: "page or representative out of range",
    FaultCode.DUPLICATE_FREE: "page pushed to a free ring twice in one step",
    FaultCode.MAPPED_PEER: "load-back onto a full page whose SWA peer is still mapped",
}


# =========================================================================================
# Page-table rows (attention page tables; kernels.page_table, graphalloc.page_tables)
# =========================================================================================
#
# A separate table from the step descriptor, with the same row shape: one int64 row of
# ROW_WIDTH = 8 columns (64 bytes, one vector load) per attention lane i, written by the
# host planner (graphalloc.page_tables) and read by kernels.page_table, program i.
#
#     col  name             meaning
#     0    PT_REQ           request row r of req_to_token (0 on a padded lane; not read there)
#     1    PT_SEQ_LEN       L: positions [0, L) exist (seq_lens[i]; 0 on a padded lane)
#     2    PT_END_PAGE      ceil(L / ps): FULL pages are columns [0, end); 0 marks a lane
#                           with nothing to read (padded or empty): it writes empty ranges
#                           and zero rows only
#     3    PT_SWA_FIRST     first SWA column: max(f, L - W, 0) // ps (f the page-aligned
#                           frontier); SWA pages are columns [swa_first, end)
#     4    PT_FULL_OFF      exclusive prefix sum over lanes of FULL page counts: the lane's
#                           first kv_indices entry (full_indptr[i]); padded lanes carry the
#                           running total so that indptr stays monotone
#     5    PT_SWA_OFF       the same for SWA page counts (swa_indptr[i])
#     6    PT_LAST_LEN      tokens in the last page, L - (end - 1) * ps in [1, ps]; 0 if L == 0
#     7    PT_WINDOW_START  first position an SWA layer may read, max(f, L - W, 0)
#                           (informative: not read by the kernel)
#
#     FULL page of column c (c < end):           req_to_token[r, c * ps] // ps
#     SWA page of column c (swa_first <= c < end): full_to_swa[full_page * ps] // ps
PT_REQ, PT_SEQ_LEN, PT_END_PAGE, PT_SWA_FIRST, PT_FULL_OFF, PT_SWA_OFF, PT_LAST_LEN = range(7)
PT_WINDOW_START = 7

__all__ += [  # appended: the step-descriptor section above stays as it is
    "PT_REQ", "PT_SEQ_LEN", "PT_END_PAGE", "PT_SWA_FIRST", "PT_FULL_OFF", "PT_SWA_OFF",
    "PT_LAST_LEN", "PT_WINDOW_START",
]


# =========================================================================================
# State rows (recurrent-state slots; kernels.state, graphalloc.plan.states)
# =========================================================================================
#
# A fourth section of the step descriptor when the allocator has recurrent-state slots:
# a header row, then one int64 row of ROW_WIDTH columns per state copy, then one per
# state-table write, planned on the host (which knows every slot id: the state pool is a
# host-only FIFO), read by kernels.state.
#
#     header (row 0):  col 0 ST_N_COPY  copy rows that follow;  col 1 ST_N_TABLE  table rows
#                      after them (the kernels loop to these counts: padding costs nothing)
#
#     col  name     meaning
#     0    ST_KIND  ST_SET | ST_COPY | ST_SPEC; 0 marks a padded row
#     1    ST_A     ST_SET / ST_SPEC: index into the state table; ST_COPY: the source slot
#     2    ST_B     ST_SET: the slot written there; ST_COPY: the destination slot;
#     2..7          ST_SPEC: up to ST_SPEC_SLOTS slots, written at A, A + 1, ... (a 0 ends)
#
#     ST_COPY: for every registered state tensor t: t[.., B, ..] = t[.., A, ..]   (a snapshot
#              taken, a snapshot restored). The planner guarantees no destination is a
#              source of the same step, so the copies run in parallel.
#     ST_SET:  state_table[A] = B          (a request's slot, a handle's snapshot; one row
#                                           per index: the planner keeps the last write)
#     ST_SPEC: state_table[A + i] = row[2 + i]  (the slots after the tokens of a speculative
#                                           step, six per row)
#
# The state table: [0, max_reqs) requests' slots, [max_reqs, max_reqs + max_handles)
# handles' snapshots, then max_reqs x max_spec_tokens slots of each request's newest
# speculative step (row-major), then one scratch entry.
ST_KIND, ST_A, ST_B = 0, 1, 2
ST_SET, ST_COPY, ST_SPEC = 1, 2, 3
ST_SPEC_SLOTS = ROW_WIDTH - 2  # slots one ST_SPEC row carries
ST_N_COPY, ST_N_TABLE = 0, 1  # columns of the header row

__all__ += ["ST_KIND", "ST_A", "ST_B", "ST_SET", "ST_COPY", "ST_SPEC", "ST_SPEC_SLOTS",
            "ST_N_COPY", "ST_N_TABLE"]
