/* Copies GPT samples out of a Megatron `.bin` in one call: for each requested sample, walk its
 * pieces (document-index positions b..e, cut at the sample's start and end offsets), check that
 * every piece lies inside its sequence and inside the `.bin`, then copy the pieces back to back
 * into the sample's row. Loaded with ctypes by gather.py (ctypes releases the GIL meanwhile).
 *
 * Arrays are little-endian and C-contiguous, not necessarily aligned. The document and sample
 * indices may be int32 or int64. With `vocab` > 0 every token id is checked against
 * [0, vocab) as it is copied. Returns 0; r + 1 when the sample of batch row r
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

#if defined(__x86_64__) && defined(__GNUC__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Copies n tokens of `item` bytes and returns the largest, read as unsigned (a negative id reads
 * as a large one): the vocabulary check rides on the copy, one pass over the data. The loop
 * vectorises (a max per vector); it is built for AVX2 and for any CPU, the better one picked
 * when the library loads. */
#define COPY_MAX(U)                                        \
  {                                                        \
    const U *restrict s = (const U *)src;                  \
    U *restrict d = (U *)dst, m = 0;                       \
    for (int64_t i = 0; i < n; i++) {                      \
      U v = s[i];                                          \
      d[i] = v;                                            \
      m = v > m ? v : m;                                   \
    }                                                      \
    return m;                                              \
  }
VECTOR_CLONES static uint64_t copy_max(char *restrict dst, const char *restrict src, int64_t n,
                                       int64_t item) {
  switch (item) {
    case 1: COPY_MAX(uint8_t)
    case 2: COPY_MAX(uint16_t)
    case 4: COPY_MAX(uint32_t)
    case 8: COPY_MAX(uint64_t)
  }
  return 0;
}

/* The smallest id, read as unsigned, outside [0, vocab) for integer dtype `code` (Megatron's
 * codes); 0 when every id of the dtype fits, or for float dtypes (checked by floats_outside). */
static uint64_t id_limit(int code, int64_t vocab) {
  uint64_t v = (uint64_t)vocab, top;
  switch (code) {
    case 1: return v > UINT8_MAX ? 0 : v;
    case 8: return v > UINT16_MAX ? 0 : v;
    case 2: top = 1ull << 7; break;
    case 3: top = 1ull << 15; break;
    case 4: top = 1ull << 31; break;
    case 5: top = 1ull << 63; break;
    default: return 0;
  }
  return v < top ? v : top;
}

/* Whether any of the n float64 (code 6) or float32 (code 7) tokens at p lies outside [0, vocab). */
static int floats_outside(const char *p, int64_t n, int code, int64_t vocab) {
  for (int64_t i = 0; i < n; i++) {
    double x = code == 6 ? ((const double *)p)[i] : ((const float *)p)[i];
    if (!(x >= 0 && x < (double)vocab)) return 1;
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
  uint64_t lim = vocab > 0 ? id_limit(code, vocab) : 0;
  int floats = vocab > 0 && (code == 6 || code == 7);
  for (int64_t r = 0; r < nj; r++) {
    int64_t j = js[r], bytes, next_bytes = 0;
    if ((totals[r] = check(&d, j)) < 0) return r + 1;
    if (!out) continue;
    int64_t b = at(smp, smp64, 2 * j), bo = at(smp, smp64, 2 * j + 1);
    int64_t e = at(smp, smp64, 2 * j + 2), eo = at(smp, smp64, 2 * j + 3);
    char *dst = out + r * want * item;
    const char *src = piece(&d, b, b, bo, e, eo, &bytes);
    uint64_t most = 0;
    for (int64_t p = b; p <= e; p++) {
      const char *next = p < e ? piece(&d, p + 1, b, bo, e, eo, &next_bytes) : NULL;
      if (next) {  /* the next piece lies elsewhere in the file: ask for its first lines now */
        __builtin_prefetch(next);
        __builtin_prefetch(next + 64);
      }
      if (lim) {
        uint64_t m = copy_max(dst, src, bytes / item, item);
        most = m > most ? m : most;
      } else {
        memcpy(dst, src, (size_t)bytes);
      }
      dst += bytes;
      src = next;
      bytes = next_bytes;
    }
    if ((lim && most >= lim) || (floats && floats_outside(out + r * want * item, totals[r], code, vocab)))
      return -(r + 1);
  }
  return 0;
}
