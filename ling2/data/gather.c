/* Copies GPT samples out of a Megatron `.bin` in one call: for each requested sample, walk its
 * pieces (document-index positions b..e, cut at the sample's start and end offsets), check that
 * every piece lies inside its sequence and inside the `.bin`, then copy the pieces back to back
 * into the sample's row. Loaded with ctypes by gather.py (ctypes releases the GIL meanwhile).
 *
 * Arrays are little-endian and C-contiguous, not necessarily aligned. The document and sample
 * indices may be int32 (Megatron's prebuilt files) or int64 (ours). Returns 0, or the 1-based
 * batch row of the first sample that does not fit; nothing is read out of bounds. With
 * out == NULL it only checks.
 */
#include <stdint.h>
#include <string.h>

typedef struct {
  const char *bin;
  int64_t bin_bytes, item, n_seq, n_doc, n_smp, add, want;
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
 * `.bin`, more than `want` tokens, or fewer anywhere but in the last (keep-partial) sample. */
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
  return tokens < d->want && j != d->n_smp - 1 ? -1 : tokens;
}

int64_t ling2_gather_samples(const char *bin, int64_t bin_bytes, int64_t item,
                             const void *seq_ptr, const void *seq_len, int64_t n_seq,
                             const void *doc, int doc64, int64_t n_doc, const void *smp,
                             int smp64, int64_t n_smp, const int64_t *js, int64_t nj,
                             int64_t add, int64_t want, char *out, int64_t *totals) {
  data_t d = {bin, bin_bytes, item, n_seq, n_doc, n_smp, add, want,
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
  }
  return 0;
}
