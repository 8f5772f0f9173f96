/* The compiled twin of the chunk rule (graphalloc/pools/chunked.py): chunked local
 * attention keeps, at committed length L, the positions of the current chunk. Listed in
 * _cplan_window.c's RULES table as c_kind 1. */
#include "_cplan.h"

/* ChunkRule.needed_from: floor(L / C) * C. */
static int64_t chunk_needed_from(int64_t chunk, int64_t len) { return len / chunk * chunk; }

/* ChunkRule.min_length: ceil(f / C) * C. */
static int64_t chunk_min_length(int64_t chunk, int64_t f) {
    return (f + chunk - 1) / chunk * chunk;
}

/* ChunkRule.lane_start: the chunk of the lane's first query, at L - max(q, 1). */
static int64_t chunk_lane_start(int64_t chunk, int64_t model_window, int64_t L, int64_t q) {
    (void)model_window;
    return imax(L - imax(q, 1), 0) / chunk * chunk;
}

const WindowRule CHUNK_RULE = {chunk_needed_from, chunk_min_length, chunk_lane_start};
