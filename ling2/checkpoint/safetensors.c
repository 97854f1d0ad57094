/* Writes a run of tensor blocks to consecutive file offsets in one call: each block is copied
 * as it is, or transposed (its source a C-contiguous [C, R] matrix, written as [R, C]) in 8 x 8
 * SIMD tiles into the staging buffer (in L2), which is written with pwrite whenever it is full.
 * A block whose source is a view of a ShardedReader mapping (`fd` >= 0) is read with pread from
 * its file (into the staging buffer, or a source buffer when it is transposed) instead of
 * through its pages, which costs a page-table entry per 4 KB; too big for that, it is copied in
 * the kernel (copy_file_range, as a file copy does) or its pages are mapped with one madvise
 * call and dropped again after (they stay in the page cache), so memory stays at the blocks in
 * flight. Loaded with ctypes by safetensors_io.py; ctypes releases the GIL meanwhile, so two
 * writer threads and the main thread run at once.
 *
 * ling2_write_blocks returns 0 or -errno of the failed read or write (-EIO: the source file ends
 * early); -EINVAL when the buffer cannot hold one row of a transposed block (the caller sizes it).
 * ling2_count_beyond scans a tensor's bytes for NaN, Inf and values a narrowing cast makes Inf (the
 * converter refuses them).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct {
  const char *src;
  int64_t rows, cols; /* the source matrix [rows, cols]; the block is rows * cols elements */
  int64_t es;         /* bytes per element */
  int64_t transpose;  /* 1: written as [cols, rows] */
  int64_t fd, off;    /* fd >= 0: src is a shared read-only mapping of file fd at offset off */
  int64_t ld;         /* elements between source rows (>= cols: a strip of a wider matrix) */
} block_t;

enum { POPULATE_READ = 22 }; /* MADV_POPULATE_READ, Linux >= 5.14 (older: pages fault in) */
static const int64_t WINDOW = 4 << 20;

/* madvise over the pages holding [p, p + n) (`inner`: only those wholly inside). Dropping
 * stops at pages shared with a neighbour, which another thread may be reading: faulting one
 * back in would map the pages around it too (fault-around), and those would stay. */
static void advise(const char *p, int64_t n, int advice, int inner) {
  uintptr_t m = (uintptr_t)sysconf(_SC_PAGESIZE) - 1, lo = (uintptr_t)p, hi = lo + (uintptr_t)n;
  lo = inner ? (lo + m) & ~m : lo & ~m;
  hi = inner ? hi & ~m : (hi + m) & ~m;
  if (hi > lo) madvise((void *)lo, hi - lo, advice);
}

/* Drops the pages of [p, p + n) of a file mapping from the process (for callers reading it
 * otherwise). */
void ling2_drop_pages(const char *p, int64_t n) { advise(p, n, MADV_DONTNEED, 1); }

enum { TILE = 16 }; /* output rows per pass; the buffer holds at least this many */

/* Writers take turns: two threads writing one file contend for its inode lock in the kernel,
 * where the waiter spins on the CPU the other thread could use to transpose; here it sleeps. */
static pthread_mutex_t write_lock = PTHREAD_MUTEX_INITIALIZER;

static int write_all(int fd, const char *p, int64_t n, int64_t off) {
  int rc = 0;
  pthread_mutex_lock(&write_lock);
  while (n > 0) {
    ssize_t k = pwrite(fd, p, (size_t)n, off);
    if (k < 0) {
      if (errno == EINTR) continue;
      rc = -errno;
      break;
    }
    p += k, n -= k, off += k;
  }
  pthread_mutex_unlock(&write_lock);
  return rc;
}

/* Tiles: dst[r * ld + c] = src[c * ls + r] for r < nr, c < nc (tile_any: any element size, the
 * ragged edges), or r, c < 8 (the SIMD tiles below; their shuffles move bits, so NaN payloads
 * and every bf16 pattern are kept). */
static void tile_any(char *d, const char *s, int64_t ld, int64_t ls, int64_t es, int64_t nr,
                     int64_t nc) {
  for (int64_t r = 0; r < nr; r++)
    for (int64_t c = 0; c < nc; c++) memcpy(d + (r * ld + c) * es, s + (c * ls + r) * es, (size_t)es);
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2"))) static void tile32_avx2(char *d, const char *s, int64_t ld,
                                                        int64_t ls) {
  __m256 r[8], t[8], u[8];
  for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps((const float *)(s + 4 * k * ls));
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
    u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int k = 0; k < 4; k++) {
    _mm256_storeu_ps((float *)(d + 4 * k * ld), _mm256_permute2f128_ps(u[k], u[k + 4], 0x20));
    _mm256_storeu_ps((float *)(d + 4 * (k + 4) * ld), _mm256_permute2f128_ps(u[k], u[k + 4], 0x31));
  }
}

static void tile32_sse(char *d, const char *s, int64_t ld, int64_t ls) {
  for (int rb = 0; rb < 8; rb += 4)
    for (int cb = 0; cb < 8; cb += 4) {
      __m128 a = _mm_loadu_ps((const float *)(s + 4 * ((cb + 0) * ls + rb)));
      __m128 b = _mm_loadu_ps((const float *)(s + 4 * ((cb + 1) * ls + rb)));
      __m128 c = _mm_loadu_ps((const float *)(s + 4 * ((cb + 2) * ls + rb)));
      __m128 e = _mm_loadu_ps((const float *)(s + 4 * ((cb + 3) * ls + rb)));
      _MM_TRANSPOSE4_PS(a, b, c, e);
      _mm_storeu_ps((float *)(d + 4 * ((rb + 0) * ld + cb)), a);
      _mm_storeu_ps((float *)(d + 4 * ((rb + 1) * ld + cb)), b);
      _mm_storeu_ps((float *)(d + 4 * ((rb + 2) * ld + cb)), c);
      _mm_storeu_ps((float *)(d + 4 * ((rb + 3) * ld + cb)), e);
    }
}

static void tile16_sse(char *d, const char *s, int64_t ld, int64_t ls) {
  __m128i a[8], b[8], c[8];
  for (int k = 0; k < 8; k++) a[k] = _mm_loadu_si128((const __m128i *)(s + 2 * k * ls));
  for (int k = 0; k < 8; k += 2) {
    b[k / 2] = _mm_unpacklo_epi16(a[k], a[k + 1]);     /* columns 0-3 of rows k, k+1 */
    b[k / 2 + 4] = _mm_unpackhi_epi16(a[k], a[k + 1]); /* columns 4-7 */
  }
  for (int h = 0; h < 8; h += 4) {
    c[h] = _mm_unpacklo_epi32(b[h], b[h + 1]);
    c[h + 1] = _mm_unpackhi_epi32(b[h], b[h + 1]);
    c[h + 2] = _mm_unpacklo_epi32(b[h + 2], b[h + 3]);
    c[h + 3] = _mm_unpackhi_epi32(b[h + 2], b[h + 3]);
  }
  for (int h = 0; h < 8; h += 4)
    for (int k = 0; k < 2; k++) {
      int col = h + 2 * k; /* c[h + k] holds columns col, col+1 of rows 0-3; c[h + k + 2] of rows 4-7 */
      _mm_storeu_si128((__m128i *)(d + 2 * col * ld), _mm_unpacklo_epi64(c[h + k], c[h + k + 2]));
      _mm_storeu_si128((__m128i *)(d + 2 * (col + 1) * ld), _mm_unpackhi_epi64(c[h + k], c[h + k + 2]));
    }
}

typedef void (*tile_fn)(char *, const char *, int64_t, int64_t);

static tile_fn tile_for(int64_t es) {
  if (es == 4) return __builtin_cpu_supports("avx2") ? tile32_avx2 : tile32_sse;
  if (es == 2) return tile16_sse;
  return 0;
}
#else
typedef void (*tile_fn)(char *, const char *, int64_t, int64_t);
static tile_fn tile_for(int64_t es) { return 0; }
#endif

/* dst[i - i0, j] = src[j * ld + i] for rows i0 <= i < i1 of the [R, C] output: in bands of
 * JB source rows (few pages, in L1), 8 x 8 tiles down the strip, then the ragged edges. */
#ifndef JB
#define JB 16
#endif
static void transpose_rows(char *dst, const char *src, int64_t ld, int64_t C, int64_t i0,
                           int64_t i1, int64_t es) {
  tile_fn tile = tile_for(es);
  int64_t n = i1 - i0, r8 = tile ? n / 8 * 8 : 0, c8 = tile ? C / 8 * 8 : 0;
  for (int64_t jb0 = 0; jb0 < c8; jb0 += JB) {
    int64_t je = jb0 + JB < c8 ? jb0 + JB : c8;
    for (int64_t r = 0; r < r8; r += 8)
      for (int64_t jb = jb0; jb < je; jb += 8)
        tile(dst + (r * C + jb) * es, src + (jb * ld + i0 + r) * es, C, ld);
  }
  if (c8 < C) tile_any(dst + c8 * es, src + (c8 * ld + i0) * es, C, ld, es, r8, C - c8);
  if (r8 < n) tile_any(dst + r8 * C * es, src + (i0 + r8) * es, C, ld, es, n - r8, C);
}

/* Reads n bytes at off of fd into p; -errno, or -EIO where the file ends first. */
static int read_all(int fd, char *p, int64_t n, int64_t off) {
  while (n > 0) {
    ssize_t k = pread(fd, p, (size_t)n, off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return k < 0 ? -errno : -EIO;
    p += k, n -= k, off += k;
  }
  return 0;
}

/* Counts the elements of n elements of es bytes (2, 4 or 8: an IEEE float format) at offset off of
 * fd whose magnitude bits (all but the sign) are >= limit. Magnitudes order as their bit patterns,
 * NaN and Inf above every finite value, so with `limit` the exponent field (the pattern of Inf)
 * these are exactly the NaNs and Infs, and with a lower one also the values a cast to a narrower
 * format turns into Inf. Read with pread through buf (cap bytes, in L2), so no page of the file
 * is mapped. Returns the count (*first: the index of the first, -1 for none), or -errno of the
 * failed read, -EIO where the file ends first, -EINVAL for another element size or a buffer
 * smaller than one element. */
#define COUNT_BEYOND(T)                                                      \
  {                                                                          \
    const T *x = (const T *)buf, lim = (T)limit, mag = (T)~((T)1 << (8 * sizeof(T) - 1)); \
    int64_t c = 0;                                                           \
    for (int64_t j = 0; j < m; j++) c += (x[j] & mag) >= lim;                \
    for (int64_t j = 0; c && *first < 0; j++)                                \
      if ((x[j] & mag) >= lim) *first = i + j;                               \
    count += c;                                                              \
  }
int64_t ling2_count_beyond(int fd, int64_t off, int64_t n, int64_t es, uint64_t limit, char *buf,
                           int64_t cap, int64_t *first) {
  int64_t count = 0, step = cap / es;
  *first = -1;
  if ((es != 2 && es != 4 && es != 8) || step < 1) return -EINVAL;
  for (int64_t i = 0; i < n; i += step) {
    int64_t m = n - i < step ? n - i : step;
    int rc = read_all(fd, buf, m * es, off + i * es);
    if (rc) return rc;
    if (es == 2) COUNT_BEYOND(uint16_t)
    else if (es == 4) COUNT_BEYOND(uint32_t)
    else COUNT_BEYOND(uint64_t)
  }
  return count;
}

/* A block written as it is, too big to stage: copied in the kernel from its file (as a file
 * copy does), else written from memory WINDOW bytes at a time. */
static int write_direct(int fd, int64_t offset, const block_t *k, int64_t bytes) {
  int64_t done = 0;
  if (k->fd >= 0) {
    while (done < bytes) {
      loff_t in = k->off + done, out = offset + done;
      int64_t m = bytes - done < WINDOW ? bytes - done : WINDOW;
      pthread_mutex_lock(&write_lock);
      ssize_t c = copy_file_range((int)k->fd, &in, fd, &out, (size_t)m, 0);
      pthread_mutex_unlock(&write_lock);
      if (c < 0 && errno == EINTR) continue;
      if (c <= 0) {
        if (c == 0) return -EIO;
        if (errno != ENOSYS && errno != EXDEV && errno != EINVAL && errno != EOPNOTSUPP) return -errno;
        break; /* not between these files: write from the mapping */
      }
      done += c;
    }
  }
  for (int64_t w = done; w < bytes; w += WINDOW) {
    int64_t m = bytes - w < WINDOW ? bytes - w : WINDOW;
    if (k->fd >= 0) advise(k->src + w, m, POPULATE_READ, 0);
    int rc = write_all(fd, k->src + w, m, offset + w);
    if (k->fd >= 0) advise(k->src + w, m, MADV_DONTNEED, 1);
    if (rc) return rc;
  }
  return 0;
}

int64_t ling2_write_blocks(int fd, int64_t offset, const block_t *blocks, int64_t n, char *buf,
                           int64_t cap, char *sbuf, int64_t scap) {
  int64_t pos = 0; /* bytes staged in buf, bound for offset */
  int rc = 0;
  for (int64_t b = 0; b < n; b++) {
    const block_t *k = &blocks[b];
    int64_t es = k->es, bytes = k->rows * k->cols * es;
    if (!k->transpose) {
      if (bytes > cap - pos) { /* does not fit: flush, then stage or write it directly */
        if ((rc = write_all(fd, buf, pos, offset))) return rc;
        offset += pos, pos = 0;
        if (bytes > cap) {
          if ((rc = write_direct(fd, offset, k, bytes))) return rc;
          offset += bytes;
          continue;
        }
      }
      if (k->fd >= 0) {
        if ((rc = read_all((int)k->fd, buf + pos, bytes, k->off))) return rc;
      } else {
        memcpy(buf + pos, k->src, (size_t)bytes);
      }
      pos += bytes;
      continue;
    }
    int64_t R = k->cols, C = k->rows, row = C * es; /* output [R, C] from source [C, R] */
    int64_t span = ((C - 1) * k->ld + R) * es;     /* source bytes, gaps between rows included */
    if (row > cap || k->ld < R) return -EINVAL;
    const char *src = k->src;
    int mapped = k->fd >= 0 && (bytes > scap || k->ld != R); /* else read into sbuf */
    if (k->fd >= 0 && !mapped) {
      if ((rc = read_all((int)k->fd, sbuf, bytes, k->off))) return rc;
      src = sbuf;
    }
    if (mapped) advise(src, span, POPULATE_READ, 0);
    for (int64_t i = 0; i < R;) {
      int64_t rows = (cap - pos) / row;
      if (rows == 0 || (rows < TILE && rows < R - i && pos > 0)) {
        if ((rc = write_all(fd, buf, pos, offset))) break;
        offset += pos, pos = 0;
        rows = cap / row;
      }
      if (rows > R - i) rows = R - i;
      transpose_rows(buf + pos, src, k->ld, C, i, i + rows, es);
      pos += rows * row, i += rows;
    }
    if (mapped) advise(src, span, MADV_DONTNEED, 1);
    if (rc) return rc;
  }
  return write_all(fd, buf, pos, offset);
}
