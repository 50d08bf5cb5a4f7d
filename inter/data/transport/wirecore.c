/* isthmus wirecore: a lane's per-byte receive work in one call, outside the GIL.
 *
 * Why: a chunk received in Python crosses memory three times after the kernel
 * hands it over (the copy out of the socket, its CRC-32C, its finite check), and
 * each of those Python calls takes the GIL back, which on a GPU host waits behind
 * the training loop's kernel launches.  Here the payload is read in pieces of at
 * most PIECE bytes, and each piece is checksummed (and, for fp32 payloads,
 * checked for NaN/Inf) while it is still in the cache; the caller (ctypes) drops
 * the GIL for the whole frame.
 *
 * Built on first use by isthmus/inter/data/transport/wirecore.py with the system's C
 * compiler; the Python fallback there computes the same results.
 */
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

#define PIECE (256 * 1024)

static uint32_t table[8][256];
static int table_ready = 0;

static void make_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
    table_ready = 1;
}

/* Slicing-by-8: the portable path (no SSE 4.2 / ARMv8 CRC instructions). */
static uint32_t crc_soft(uint32_t crc, const uint8_t *p, size_t n) {
    if (!table_ready) make_table();
    while (n && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff]; n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
              table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
              table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
    return crc;
}

/* The raw CRC register is linear: crc(s, A||B) = shift(s, |B|) ^ crc(0, B), where
 * shift(s, n) is the register after n zero bytes.  So three parts of a block can be
 * checksummed at once, which hides the instruction's latency (3 cycles, one issued
 * per cycle), and joined with two shifts by fixed lengths, each four table lookups. */
#define LANE 8192

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (int i = 0; vec; i++, vec >>= 1)
        if (vec & 1) sum ^= mat[i];
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int i = 0; i < 32; i++) square[i] = gf2_times(mat, mat[i]);
}

/* op: the operator that appends n zero bytes to a raw register. */
static void zeros_op(uint32_t *op, size_t n) {
    uint32_t a[32], b[32];
    a[0] = 0x82F63B78u; /* one zero bit */
    for (int i = 1; i < 32; i++) a[i] = 1u << (i - 1);
    gf2_square(b, a); /* two bits */
    gf2_square(a, b); /* four bits */
    for (int i = 0; i < 32; i++) op[i] = 1u << i; /* identity */
    int in_a = 1;     /* a holds the operator for 8 bits after the next square */
    for (;;) {
        uint32_t *sq = in_a ? b : a, *from = in_a ? a : b;
        gf2_square(sq, from); /* next power: 8, 16, 32 ... bits */
        in_a = !in_a;
        if (n & 1) {
            uint32_t t[32];
            for (int i = 0; i < 32; i++) t[i] = gf2_times(sq, op[i]);
            memcpy(op, t, sizeof t);
        }
        n >>= 1;
        if (!n) break;
    }
}

static uint32_t shift1[4][256], shift2[4][256];

static void shift_table(uint32_t table_out[4][256], size_t n) {
    uint32_t op[32];
    zeros_op(op, n);
    for (int k = 0; k < 4; k++)
        for (uint32_t i = 0; i < 256; i++) table_out[k][i] = gf2_times(op, i << (8 * k));
}

static uint32_t shift(uint32_t t[4][256], uint32_t crc) {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
}

#if defined(__x86_64__)
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c0 = crc;
    while (n && ((uintptr_t)p & 7)) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    while (n >= 3 * LANE) {
        uint64_t c1 = 0, c2 = 0;
        const uint8_t *end = p + LANE;
        do {
            uint64_t w0, w1, w2;
            memcpy(&w0, p, 8);
            memcpy(&w1, p + LANE, 8);
            memcpy(&w2, p + 2 * LANE, 8);
            c0 = _mm_crc32_u64(c0, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
            p += 8;
        } while (p < end);
        c0 = shift(shift2, (uint32_t)c0) ^ shift(shift1, (uint32_t)c1) ^ c2;
        p += 2 * LANE;
        n -= 3 * LANE;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c0 = _mm_crc32_u64(c0, w);
        p += 8;
        n -= 8;
    }
    while (n--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0;
}
static int have_hw(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}
#else
static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) { return crc_soft(crc, p, n); }
static int have_hw(void) { return 0; }
#endif

static int hw = -1;

/* CRC-32C of n bytes, continuing from a previous value (0 to start). */
uint32_t wc_crc32c(uint32_t value, const uint8_t *p, size_t n) {
    if (hw < 0) {
        shift_table(shift1, LANE);
        shift_table(shift2, 2 * LANE);
        hw = have_hw();
    }
    uint32_t crc = ~value;
    crc = hw ? crc_hw(crc, p, n) : crc_soft(crc, p, n);
    return ~crc;
}

/* The loops below are built for AVX2 and for the baseline, the CPU picks at load. */
#if defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* 1 if any of the n little-endian fp32 words at p is NaN or +-Inf (exponent all ones). */
VECTOR_CLONES static int any_nonfinite(const uint8_t *p, size_t words) {
    uint32_t bad = 0;
    for (size_t i = 0; i < words; i++) {
        uint32_t w;
        memcpy(&w, p + 4 * i, 4);
        bad |= ((w & 0x7f800000u) == 0x7f800000u);
    }
    return bad != 0;
}

/* Reads exactly n bytes from fd into dst.  Each piece is folded into *crc_out
 * (CRC-32C from 0) and, when check_f32, into *nonfinite_out (1 if any complete
 * fp32 word is NaN/Inf).  A non-blocking fd (Python's socket with a timeout) is
 * polled, at most stall_ms between two pieces.
 * Returns n; 0 if the peer closed first; -ETIMEDOUT on a stall; -errno otherwise. */
long wc_recv_frame(int fd, uint8_t *dst, size_t n, int stall_ms, int check_f32,
                   uint32_t *crc_out, int *nonfinite_out) {
    size_t got = 0, checked = 0;
    uint32_t crc = 0;
    int nonfinite = 0;
    while (got < n) {
        size_t want = n - got < PIECE ? n - got : PIECE;
        ssize_t r = recv(fd, dst + got, want, 0);
        if (r == 0) return 0;
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct pollfd pfd = {fd, POLLIN, 0};
                int ready = poll(&pfd, 1, stall_ms);
                if (ready == 0) return -ETIMEDOUT;
                if (ready < 0 && errno != EINTR) return -errno;
                continue;
            }
            return -errno;
        }
        crc = wc_crc32c(crc, dst + got, (size_t)r);
        got += (size_t)r;
        if (check_f32 && !nonfinite) {
            size_t upto = got & ~(size_t)3;
            nonfinite = any_nonfinite(dst + checked, (upto - checked) / 4);
            checked = upto;
        }
    }
    *crc_out = crc;
    *nonfinite_out = nonfinite;
    return (long)n;
}

/* 1 if every one of the n fp32 values at p is finite: one read pass, no temporary. */
int wc_all_finite(const uint8_t *p, size_t n) { return !any_nonfinite(p, n); }

/* The CRC-32C (from 0) of n fp32 values at p, each piece checked for NaN/Inf while it is
 * in the cache: what a raw chunk's sender needs of its bytes, in one pass instead of two.
 * Returns 0 with *crc_out set, or 1 if a value is NaN or +-Inf. */
int wc_crc32c_f32(const uint8_t *p, size_t n, uint32_t *crc_out) {
    uint32_t crc = 0;
    for (size_t lo = 0; lo < n; lo += 3 * LANE) {
        size_t m = n - lo < 3 * LANE ? n - lo : 3 * LANE;
        if (any_nonfinite(p + 4 * lo, m)) return 1;
        crc = wc_crc32c(crc, p + 4 * lo, 4 * m);
    }
    *crc_out = crc;
    return 0;
}

/* The owner's sum of one fp32 chunk (below), a block of values at a time: 96 KiB of each
 * part and of the result stay in the cache while the block is added, checked and
 * checksummed, and a block is four runs of the CRC's three interleaved 8 KiB lanes. */
#define SUM_BLOCK ((size_t)3 * LANE)

VECTOR_CLONES static void add_two(float *restrict o, const float *restrict a,
                                  const float *restrict b, size_t n) {
    for (size_t i = 0; i < n; i++) o[i] = a[i] + b[i];
}

VECTOR_CLONES static void add_into(float *restrict o, const float *restrict b, size_t n) {
    for (size_t i = 0; i < n; i++) o[i] = o[i] + b[i];
}

VECTOR_CLONES static void divide_into(float *o, float d, size_t n) {
    for (size_t i = 0; i < n; i++) o[i] = o[i] / d;
}

/* out[i] = ((parts[0][i] + parts[1][i]) + parts[2][i] + ...) / divisor, the adds in site
 * order and IEEE fp32 (no FMA, no reassociation: the same bits as numpy's np.add and
 * np.divide, which every site's replica depends on); divisor 0 divides by nothing.
 * out may be the memory of parts[0] or parts[1], never of a later part.
 * One pass instead of four: part `own` (-1: none) is checked for NaN/Inf before its block
 * is added (it may be out's memory), and the result's block is checked and folded into
 * its CRC-32C while it is in the cache.
 * Returns 0 with *crc_out set; 1 if part own holds NaN/Inf; 2 if the result does (its
 * parts being finite: an overflow).  Either stops the sum there. */
int wc_sum_f32(float *out, const float *const *parts, int nparts, int own, float divisor,
               size_t n, uint32_t *crc_out) {
    uint32_t crc = 0;
    for (size_t lo = 0; lo < n; lo += SUM_BLOCK) {
        size_t m = n - lo < SUM_BLOCK ? n - lo : SUM_BLOCK;
        float *o = out + lo;
        if (own >= 0 && any_nonfinite((const uint8_t *)(parts[own] + lo), m)) return 1;
        if (parts[0] == out) {
            add_into(o, parts[1] + lo, m);
        } else if (parts[1] == out) {
            add_into(o, parts[0] + lo, m); /* a + b is b + a, bit for bit, when finite */
        } else {
            add_two(o, parts[0] + lo, parts[1] + lo, m);
        }
        for (int s = 2; s < nparts; s++) add_into(o, parts[s] + lo, m);
        if (divisor != 0.0f) divide_into(o, divisor, m);
        if (any_nonfinite((const uint8_t *)o, m)) return 2;
        crc = wc_crc32c(crc, (const uint8_t *)o, 4 * m);
    }
    *crc_out = crc;
    return 0;
}

/* The same receive inside TLS: the payload decrypted by the OpenSSL that Python's ssl
 * module already loaded (found by wirecore.py, opened with RTLD_NOLOAD so that it is
 * that very library and never another), one TLS record per SSL_read_ex, each
 * checksummed while it is in the cache, the GIL dropped for the whole frame.  Through
 * Python every record (16 KiB) took the GIL back: 256 hand-offs a 4 MiB chunk, which
 * on a 16-core host capped a TLS lane at a quarter of the plain one. */
typedef int (*ssl_read_ex_fn)(void *, void *, size_t, size_t *);
typedef int (*ssl_int_fn)(const void *, int);
typedef int (*ssl_fd_fn)(const void *);
typedef void (*err_clear_fn)(void);
static ssl_read_ex_fn ssl_read_ex;
static ssl_int_fn ssl_get_error;
static ssl_fd_fn ssl_get_fd;
static err_clear_fn err_clear;

/* 0 once the four functions are bound from the two (already loaded) libraries. */
int wc_ssl_bind(const char *libssl, const char *libcrypto) {
    void *s = dlopen(libssl, RTLD_NOW | RTLD_NOLOAD);
    void *c = dlopen(libcrypto, RTLD_NOW | RTLD_NOLOAD);
    if (!s || !c) return -1;
    ssl_read_ex = (ssl_read_ex_fn)dlsym(s, "SSL_read_ex");
    ssl_get_error = (ssl_int_fn)dlsym(s, "SSL_get_error");
    ssl_get_fd = (ssl_fd_fn)dlsym(s, "SSL_get_fd");
    err_clear = (err_clear_fn)dlsym(c, "ERR_clear_error");
    return ssl_read_ex && ssl_get_error && ssl_get_fd && err_clear ? 0 : -2;
}

/* The descriptor an SSL object reads (wirecore.py checks it against the socket's). */
int wc_ssl_fd(const void *ssl) { return ssl_get_fd ? ssl_get_fd(ssl) : -1; }

/* wc_recv_frame's contract, reading through ssl (on the non-blocking fd under it).
 * Returns n; 0 if the peer closed first; -ETIMEDOUT on a stall; -EPROTO on a TLS
 * error; -errno otherwise. */
long wc_ssl_recv_frame(void *ssl, int fd, uint8_t *dst, size_t n, int stall_ms,
                       int check_f32, uint32_t *crc_out, int *nonfinite_out) {
    size_t got = 0, checked = 0;
    uint32_t crc = 0;
    int nonfinite = 0;
    if (!ssl_read_ex) return -ENOSYS;
    while (got < n) {
        size_t r = 0;
        err_clear();
        int ok = ssl_read_ex(ssl, dst + got, n - got, &r);
        if (!ok) {
            int e = ssl_get_error(ssl, ok);
            if (e == 2 || e == 3) { /* SSL_ERROR_WANT_READ, _WANT_WRITE */
                struct pollfd pfd = {fd, e == 2 ? POLLIN : POLLOUT, 0};
                int ready = poll(&pfd, 1, stall_ms);
                if (ready == 0) return -ETIMEDOUT;
                if (ready < 0 && errno != EINTR) return -errno;
                continue;
            }
            int sys = errno;
            err_clear();
            if (e == 6) return 0; /* SSL_ERROR_ZERO_RETURN: the peer's close_notify */
            if (e == 5) return sys ? -sys : 0; /* SSL_ERROR_SYSCALL: EOF or a socket error */
            /* OpenSSL 3 reports an EOF without close_notify as a TLS error: a peer
             * gone mid-frame is "closed", as on plain TCP; anything else a protocol
             * error. */
            char byte;
            if (recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0) return 0;
            return -EPROTO;
        }
        crc = wc_crc32c(crc, dst + got, r);
        got += r;
        if (check_f32 && !nonfinite) {
            size_t upto = got & ~(size_t)3;
            nonfinite = any_nonfinite(dst + checked, (upto - checked) / 4);
            checked = upto;
        }
    }
    *crc_out = crc;
    *nonfinite_out = nonfinite;
    return (long)n;
}
