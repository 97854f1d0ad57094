/* Copies GPT samples out of a Megatron `.bin` in one call: for each requested sample, walk its
 * pieces (document-index positions b..e, cut at the sample's start and end offsets), check that
 * every piece lies inside its sequence and inside the `.bin`, then copy the pieces back to back
 * into the sample's row. Loaded with ctypes by gather.py (ctypes releases the GIL meanwhile).
 *
 * Arrays are little-endian and C-contiguous, not necessarily aligned. The document and sample
 * indices may be int32 or int64. With `vocab` > 0 every copied row is then scanned (while it
 * is in L1) for token ids outside [0, vocab). Returns 0; r + 1 when the sample of batch row r
 * does not fit the data (nothing is read out of bounds); -(r + 1) when row r holds an id
 * outside the vocabulary. With out == NULL it only checks the indices.
 */
#include <stdint.h>
#include <string.h>

typedef struct {
  const char *bin;
  int64_t bin_bytes, item, n_seq, n_doc, n_smp, n_full, add, want;
  const void *seq_ptr, *seq_len, *doc, *smp;
  int doc64, smp64;
} data_t;

/* Element i of an int32 or int64 array that may be unaligned (the `.idx` header is 34 bytes). */
static inline int64_t at(const void *a, int is64, int64_t i) {
  if (is64) {
    int64_t v;
    memcpy(&v, (const char *)a + 8 * i, 8);
    return v;
  }
  int32_t v;
  memcpy(&v, (const char *)a + 4 * i, 4);
  return v;
}

/* Piece p of a sample spanning positions [b, e] with offsets bo, eo: its source and bytes. */
static inline const char *piece(const data_t *d, int64_t p, int64_t b, int64_t bo, int64_t e,
                                int64_t eo, int64_t *bytes) {
  int64_t s = at(d->doc, d->doc64, p);
  int64_t lo = p == b ? bo : 0, hi = p == e ? eo + d->add : at(d->seq_len, 0, s);
  *bytes = (hi - lo) * d->item;
  return d->bin + at(d->seq_ptr, 1, s) + lo * d->item;
}

/* Tokens of sample j, or -1 if it does not fit the data: a piece outside its sequence or the
 * `.bin`, more than `want` tokens, or fewer in one of the first n_full (full) samples. */
static int64_t check(const data_t *d, int64_t j) {
  if (j < 0 || j >= d->n_smp) return -1;
  int64_t b = at(d->smp, d->smp64, 2 * j), bo = at(d->smp, d->smp64, 2 * j + 1);
  int64_t e = at(d->smp, d->smp64, 2 * j + 2), eo = at(d->smp, d->smp64, 2 * j + 3);
  if (b < 0 || e < b || e >= d->n_doc) return -1;
  int64_t tokens = 0;
  for (int64_t p = b; p <= e; p++) {
    int64_t s = at(d->doc, d->doc64, p);
    if (s < 0 || s >= d->n_seq) return -1;
    int64_t len = at(d->seq_len, 0, s), ptr = at(d->seq_ptr, 1, s);
    int64_t lo = p == b ? bo : 0, hi = p == e ? eo + d->add : len;
    if (lo < 0 || lo > hi || hi > len || ptr < 0 || ptr % d->item) return -1;
    if (hi > (d->bin_bytes - ptr) / d->item) return -1;
    tokens += hi - lo;
    if (tokens > d->want) return -1;
  }
  return tokens < d->want && j < d->n_full ? -1 : tokens;
}

/* Whether any of the n tokens at p (dtype by Megatron's code) lies outside [0, vocab). One
 * unsigned compare per token (a negative signed id reads as a large unsigned one), which the
 * compiler vectorises. */
#define OUTSIDE(U, SIGNED)                                                        \
  {                                                                               \
    const U *q = (const U *)p;                                                    \
    uint64_t top = SIGNED ? (uint64_t)((U)-1 >> 1) + 1 : (uint64_t)(U)-1;         \
    if (!SIGNED && (uint64_t)vocab > top) return 0;                               \
    U lim = (U)((uint64_t)vocab < top ? (uint64_t)vocab : top);                   \
    int bad = 0;                                                                  \
    for (int64_t i = 0; i < n; i++) bad |= q[i] >= lim;                           \
    return bad;                                                                   \
  }
static int outside(const char *p, int64_t n, int code, int64_t vocab) {
  switch (code) {
    case 1: OUTSIDE(uint8_t, 0)
    case 2: OUTSIDE(uint8_t, 1)
    case 3: OUTSIDE(uint16_t, 1)
    case 4: OUTSIDE(uint32_t, 1)
    case 5: OUTSIDE(uint64_t, 1)
    case 8: OUTSIDE(uint16_t, 0)
    case 6: {
      const double *q = (const double *)p;
      for (int64_t i = 0; i < n; i++)
        if (!(q[i] >= 0 && q[i] < (double)vocab)) return 1;
      return 0;
    }
    case 7: {
      const float *q = (const float *)p;
      for (int64_t i = 0; i < n; i++)
        if (!(q[i] >= 0 && q[i] < (float)vocab)) return 1;
      return 0;
    }
  }
  return 0;
}

int64_t ling2_gather_samples(const char *bin, int64_t bin_bytes, int64_t item,
                             const void *seq_ptr, const void *seq_len, int64_t n_seq,
                             const void *doc, int doc64, int64_t n_doc, const void *smp,
                             int smp64, int64_t n_smp, int64_t n_full, const int64_t *js,
                             int64_t nj, int64_t add, int64_t want, char *out, int64_t *totals,
                             int code, int64_t vocab) {
  data_t d = {bin, bin_bytes, item, n_seq, n_doc, n_smp, n_full, add, want,
              seq_ptr, seq_len, doc, smp, doc64, smp64};
  for (int64_t r = 0; r < nj; r++) {
    int64_t j = js[r], bytes, next_bytes = 0;
    if ((totals[r] = check(&d, j)) < 0) return r + 1;
    if (!out) continue;
    int64_t b = at(smp, smp64, 2 * j), bo = at(smp, smp64, 2 * j + 1);
    int64_t e = at(smp, smp64, 2 * j + 2), eo = at(smp, smp64, 2 * j + 3);
    char *dst = out + r * want * item;
    const char *src = piece(&d, b, b, bo, e, eo, &bytes);
    for (int64_t p = b; p <= e; p++) {
      const char *next = p < e ? piece(&d, p + 1, b, bo, e, eo, &next_bytes) : NULL;
      if (next) {  /* the next piece lies elsewhere in the file: ask for its first lines now */
        __builtin_prefetch(next);
        __builtin_prefetch(next + 64);
      }
      memcpy(dst, src, (size_t)bytes);
      dst += bytes;
      src = next;
      bytes = next_bytes;
    }
    if (vocab > 0 && outside(out + r * want * item, totals[r], code, vocab)) return -(r + 1);
  }
  return 0;
}
