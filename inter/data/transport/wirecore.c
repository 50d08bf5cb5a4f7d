/* isthmus wirecore: a lane's per-byte work in one call, outside the GIL (the extension
 * module isthmus.inter.data.transport._wirecore, built at install by setup.py).
 *
 * Why: a chunk received in Python crosses memory three times after the kernel
 * hands it over (the copy out of the socket, its CRC-32C, its finite check), and
 * each of those Python calls takes the GIL back, which on a GPU host waits behind
 * the training loop's kernel launches.  Here the payload is read in pieces of at
 * most PIECE bytes, and each piece is checksummed (and, for fp32 payloads,
 * checked for NaN/Inf) while it is still in the cache, the GIL dropped for the
 * whole frame.  wirecore.py computes the same results in Python where this module
 * was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: it sets the feature macros (poll, recv) */

#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

#define PIECE (256 * 1024)

static uint32_t table[8][256];

static void make_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
}

/* Slicing-by-8: the portable path (no SSE 4.2 / ARMv8 CRC instructions). */
static uint32_t crc_soft(uint32_t crc, const uint8_t *p, size_t n) {
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

static int hw;

/* The tables, made once when the module is imported (before any call can run). */
static void crc_init(void) {
    make_table();
    shift_table(shift1, LANE);
    shift_table(shift2, 2 * LANE);
    hw = have_hw();
}

/* CRC-32C of n bytes, continuing from a previous value (0 to start). */
static uint32_t wc_crc32c(uint32_t value, const uint8_t *p, size_t n) {
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
static long wc_recv_frame(int fd, uint8_t *dst, size_t n, int stall_ms, int check_f32,
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

/* The CRC-32C (from 0) of n fp32 values at p, each piece checked for NaN/Inf while it is
 * in the cache: what a raw chunk's sender needs of its bytes, in one pass instead of two.
 * Returns 0 with *crc_out set, or 1 if a value is NaN or +-Inf. */
static int wc_crc32c_f32(const uint8_t *p, size_t n, uint32_t *crc_out) {
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
static int wc_sum_f32(float *out, const float *const *parts, int nparts, int own, float divisor,
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

/* --- the module's functions (wirecore.py holds their contracts), each one call with the
 * GIL dropped; buffers come through the buffer protocol, C-contiguous. */

static PyObject *recv_frame(PyObject *self, PyObject *args) {
    int fd, stall_ms, check_f32;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "iw*ip", &fd, &buf, &stall_ms, &check_f32)) return NULL;
    uint32_t crc = 0;
    int nonfinite = 0;
    long got;
    Py_BEGIN_ALLOW_THREADS
    got = wc_recv_frame(fd, buf.buf, (size_t)buf.len, stall_ms, check_f32, &crc, &nonfinite);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return Py_BuildValue("lki", got, (unsigned long)crc, nonfinite);
}

static PyObject *all_finite(PyObject *self, PyObject *args) {
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = any_nonfinite(buf.buf, (size_t)buf.len / 4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyBool_FromLong(!bad);
}

static PyObject *crc32c_f32(PyObject *self, PyObject *args) {
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    uint32_t crc = 0;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = wc_crc32c_f32(buf.buf, (size_t)buf.len / 4, &crc);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (bad) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *sum_f32(PyObject *self, PyObject *args) {
    Py_buffer out;
    PyObject *seq, *result = NULL;
    int own;
    float divisor;
    if (!PyArg_ParseTuple(args, "w*Oif", &out, &seq, &own, &divisor)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "parts must be a sequence");
    Py_ssize_t k = fast ? PySequence_Fast_GET_SIZE(fast) : 0, held = 0;
    Py_buffer *views = fast ? PyMem_Calloc((size_t)k + 1, sizeof *views) : NULL;
    const float **parts = views ? PyMem_Calloc((size_t)k + 1, sizeof *parts) : NULL;
    if (!parts) {
        if (fast) PyErr_NoMemory();
        goto done;
    }
    if (k < 2 || k > INT_MAX || own >= k) {
        PyErr_SetString(PyExc_ValueError, "two parts or more, own one of them or -1");
        goto done;
    }
    for (; held < k; held++) {
        Py_buffer *v = &views[held];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), v, PyBUF_SIMPLE) < 0) goto done;
        parts[held] = v->buf;
        if (v->len != out.len) {
            held++;
            PyErr_SetString(PyExc_ValueError, "every part must be as long as out");
            goto done;
        }
    }
    uint32_t crc = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = wc_sum_f32(out.buf, parts, (int)k, own, divisor, (size_t)out.len / 4, &crc);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("ik", status, (unsigned long)crc);
done:
    while (held > 0) PyBuffer_Release(&views[--held]);
    PyMem_Free(parts);
    PyMem_Free(views);
    Py_XDECREF(fast);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"recv_frame", recv_frame, METH_VARARGS,
     "recv_frame(fd, buf, stall_ms, check_f32) -> (result, crc, nonfinite)"},
    {"all_finite", all_finite, METH_VARARGS, "all_finite(fp32 buffer) -> bool"},
    {"crc32c_f32", crc32c_f32, METH_VARARGS, "crc32c_f32(fp32 buffer) -> int | None"},
    {"sum_f32", sum_f32, METH_VARARGS,
     "sum_f32(out, parts, own, divisor) -> (status, crc)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_wirecore", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__wirecore(void) {
    crc_init();
    return PyModule_Create(&module);
}
