/* A scored multi-token attention step (prefill, a chunk) on the CPU, as one call (h2o_compress.attention.prefill).
 *
 * The attention output of n queries over `total` keys and the H2O column sums (each key's softmax probability
 * summed over the queries and the query heads of its KV head: Zhang et al. 2023, arXiv 2306.14048 section 4) from
 * one fp32 softmax, with no [n, total] matrix in memory: work items are (sequence, KV head, block of queries);
 * the block's G * Bq rows (query, query head of the group) go through
 *   1. logits against keys [0, cut) (cut: the last key any of the block's queries sees; causal: held + block end),
 *      tile by tile with a register-blocked microkernel (MR rows x KT keys, keys pre-transposed to [D, total]);
 *   2. per row: mask (causal bottom-right, or the bool `visible`), max, exp, sum, in place;
 *   3. the column sums += p / rowsum (each thread its own, added up at the end: no atomics);
 *   4. output = (p @ V) / rowsum, MR rows x the value width at a time, keys in L1-sized blocks.
 * The rows of a block and the KT-wide key tiles are padded (zero query rows, zero keys and values past `total`),
 * so the microkernels have no remainders. Vector width from the build (-march=native): 16 floats with AVX-512 (key
 * tiles of 64), 8 with AVX (16), else 4 (8: SSE, NEON); W, NV and MR may be set with -D to try other shapes. Threads (pthreads) take work items from an atomic counter, the costliest
 * (latest query blocks) first.
 *
 * Layouts (fp32, contiguous): q [B, Hkv, n * G, D] (row = query * G + head of the group, already scaled);
 * kt [B, Hkv, D, total_pad]; v [B, Hkv, total_pad, Dv_pad] (Dv_pad a multiple of the vector tile, padding zero);
 * visible (optional) bool bytes, element (b, h, i, j) at b * vb + h * vh + i * vi + j (strides in bytes, 0 for a
 * broadcast dimension); out [B, n, Hkv * G, Dv] fp32; sums [B, Hkv, total] fp32 (overwritten).
 * Returns 0, 1 for a bad argument, 2 when scratch cannot be allocated, 3 when a thread cannot start.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef W
#if defined(__AVX512F__)
#define W 16 /* floats per vector */
#define NV 4 /* vectors per microkernel row */
#elif defined(__AVX__)
#define W 8
#define NV 2
#else /* 128-bit vectors (SSE, NEON) */
#define W 4
#define NV 2
#endif
#endif
#define KT (W * NV) /* keys per logits tile, value columns per output tile */
#ifndef MR
#define MR 6        /* rows per microkernel */
#endif
#define VB 128      /* keys per value block of step 4 (L1-sized) */

typedef float vec __attribute__((vector_size(W * 4)));
typedef float vec_u __attribute__((vector_size(W * 4), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(W * 4)));

static inline vec load(const float *p) { return *(const vec_u *)p; }
static inline void store(float *p, vec x) { *(vec_u *)p = x; }
static inline vec splat(float x) { return (vec){0} + x; }
static inline vec vmax(vec a, vec b) { const ivec m = a > b; return (vec)(((ivec)a & m) | ((ivec)b & ~m)); }

/* exp(x) for x <= 0 (a logit minus its row max), to ~2 ulp; x below -87 gives exactly 0 (a masked key is -inf). */
static inline vec vexp(vec x) {
    const ivec keep = x >= splat(-87.0f);
    x = (vec)((ivec)x & keep); /* masked lanes compute exp(0) and are zeroed below: no inf/NaN arithmetic */
    const vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    vec r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return (vec)((ivec)(p * (vec)bits) & keep);
}

/* c[MR, KT] (row stride ldc) = (accumulate ? c : 0) + a[MR, inner] (row stride lda) @ b[inner, KT] (row stride ldb):
 * the one register-blocked microkernel, for the logits (q @ k^T, keys pre-transposed) and the output (p @ v). */
static inline void tile_product(const float *restrict a, int64_t lda, int inner, const float *restrict b, int64_t ldb,
                                float *restrict c, int64_t ldc, int accumulate) {
    vec acc[MR][NV];
    for (int i = 0; i < MR; i++)
        for (int n = 0; n < NV; n++) acc[i][n] = accumulate ? load(c + i * ldc + n * W) : splat(0.0f);
    for (int k = 0; k < inner; k++) {
        const float *row = b + k * ldb;
        vec x[NV];
        for (int n = 0; n < NV; n++) x[n] = load(row + n * W);
        for (int i = 0; i < MR; i++) {
            const vec y = splat(a[i * lda + k]);
            for (int n = 0; n < NV; n++) acc[i][n] += y * x[n];
        }
    }
    for (int i = 0; i < MR; i++)
        for (int n = 0; n < NV; n++) store(c + i * ldc + n * W, acc[i][n]);
}

typedef struct {
    int batch, kv_heads, group, n, total, total_pad, D, Dv, Dv_pad, block, items;
    const float *q, *kt, *v;
    const uint8_t *visible;
    int64_t vb, vh, vi;
    float *out, *sums;
    int next;              /* the next work item (atomic) */
    int done;              /* work items finished (atomic): fewer than `items` when no thread had scratch */
    pthread_mutex_t lock;  /* guards sums */
} job_t;

/* One past the last key query `i` of (b, h) sees. */
static int extent(const job_t *job, int b, int h, int i) {
    if (!job->visible) return job->total - job->n + i + 1;
    const uint8_t *row = job->visible + b * job->vb + h * job->vh + (int64_t)i * job->vi;
    int j = job->total;
    while (j > 0 && !row[j - 1]) j--;
    return j;
}

/* Scratch of one thread: the block's padded query rows, logits/probabilities, output rows, 1 / row sums and the
 * block's column sums. */
typedef struct {
    float *q, *s, *o, *inv, *col;
} scratch_t;

static void work_item(job_t *job, int item, const scratch_t *buf) {
    const int blocks = (job->n + job->block - 1) / job->block;
    const int per_seq = job->kv_heads * blocks;
    const int b = item / per_seq, h = (item % per_seq) / blocks;
    const int blk = blocks - 1 - item % blocks; /* latest (costliest) blocks first */
    const int a = blk * job->block, z = a + job->block < job->n ? a + job->block : job->n;
    const int G = job->group, D = job->D, Dv_pad = job->Dv_pad, rows = (z - a) * G;
    const int rows_pad = (rows + MR - 1) / MR * MR;
    const int held = job->total - job->n;
    int cut = 0;
    for (int i = a; i < z; i++) {
        const int e = extent(job, b, h, i);
        cut = e > cut ? e : cut;
    }
    const int cut_pad = (cut + KT - 1) / KT * KT;
    const int64_t lds = cut_pad, bh = (int64_t)b * job->kv_heads + h;
    float *restrict sbuf = buf->s, *restrict obuf = buf->o, *restrict inv = buf->inv, *restrict col = buf->col;
    memcpy(buf->q, job->q + (bh * job->n + a) * G * D, sizeof(float) * rows * D);
    memset(buf->q + rows * D, 0, sizeof(float) * (rows_pad - rows) * D);
    /* 1. logits */
    const float *kt = job->kt + bh * D * job->total_pad;
    for (int j0 = 0; j0 < cut_pad; j0 += KT)
        for (int r0 = 0; r0 < rows_pad; r0 += MR)
            tile_product(buf->q + r0 * D, D, D, kt + j0, job->total_pad, sbuf + r0 * lds + j0, lds, 0);
    /* 2. mask, softmax numerator, row sums; 3. the block's column sums */
    memset(col, 0, sizeof(float) * cut_pad);
    for (int r = 0; r < rows; r++) {
        const int i = a + r / G;
        float *restrict s = sbuf + r * lds;
        if (job->visible) {
            const uint8_t *row = job->visible + b * job->vb + h * job->vh + (int64_t)i * job->vi;
            for (int j = 0; j < cut; j++) s[j] = row[j] ? s[j] : -INFINITY;
            for (int j = cut; j < cut_pad; j++) s[j] = -INFINITY;
        } else {
            for (int j = held + i + 1; j < cut_pad; j++) s[j] = -INFINITY;
        }
        vec top = splat(-INFINITY);
        for (int j = 0; j < cut_pad; j += W) top = vmax(top, load(s + j));
        float m = -INFINITY;
        for (int c = 0; c < W; c++) m = top[c] > m ? top[c] : m;
        vec total = splat(0.0f);
        for (int j = 0; j < cut_pad; j += W) {
            const vec p = vexp(load(s + j) - m);
            store(s + j, p);
            total += p;
        }
        float l = 0.0f;
        for (int c = 0; c < W; c++) l += total[c];
        inv[r] = 1.0f / l;
        const vec w = splat(inv[r]);
        for (int j = 0; j < cut_pad; j += W) store(col + j, load(col + j) + load(s + j) * w);
    }
    for (int r = rows; r < rows_pad; r++) memset(sbuf + r * lds, 0, sizeof(float) * cut_pad);
    pthread_mutex_lock(&job->lock);
    float *restrict sums = job->sums + bh * job->total;
    for (int j = 0; j < cut; j++) sums[j] += col[j];
    pthread_mutex_unlock(&job->lock);
    /* 4. output = p @ v / row sum */
    memset(obuf, 0, sizeof(float) * rows_pad * Dv_pad);
    const float *v = job->v + bh * job->total_pad * Dv_pad;
    for (int j0 = 0; j0 < cut_pad; j0 += VB) {
        const int keys = cut_pad - j0 < VB ? cut_pad - j0 : VB;
        for (int c0 = 0; c0 < Dv_pad; c0 += KT)
            for (int r0 = 0; r0 < rows_pad; r0 += MR)
                tile_product(sbuf + r0 * lds + j0, lds, keys, v + (int64_t)j0 * Dv_pad + c0, Dv_pad,
                             obuf + r0 * Dv_pad + c0, Dv_pad, 1);
    }
    const int q_heads = job->kv_heads * G;
    for (int r = 0; r < rows; r++) {
        const int i = a + r / G, head = h * G + r % G;
        float *restrict o = job->out + (((int64_t)b * job->n + i) * q_heads + head) * job->Dv;
        for (int c = 0; c < job->Dv; c++) o[c] = obuf[r * Dv_pad + c] * inv[r];
    }
}

static void *worker_main(void *arg) {
    job_t *job = arg;
    const int rows_pad = (job->block * job->group + MR - 1) / MR * MR;
    scratch_t buf = {
        malloc(sizeof(float) * rows_pad * job->D), malloc(sizeof(float) * rows_pad * (int64_t)job->total_pad),
        malloc(sizeof(float) * rows_pad * job->Dv_pad), malloc(sizeof(float) * rows_pad),
        malloc(sizeof(float) * job->total_pad),
    };
    if (buf.q && buf.s && buf.o && buf.inv && buf.col) {
        for (int item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->items;)
        {
            work_item(job, item, &buf);
            __atomic_fetch_add(&job->done, 1, __ATOMIC_RELAXED);
        }
    }
    free(buf.q);
    free(buf.s);
    free(buf.o);
    free(buf.inv);
    free(buf.col);
    return NULL;
}

/* The entry point (see the top of this file). A thread that cannot start or allocate leaves its share to the others. */
int h2o_cpu_prefill_attention(int batch, int kv_heads, int group, int n, int total, int total_pad, int D, int Dv,
                              int Dv_pad, int block, int threads, const float *q, const float *kt, const float *v,
                              const uint8_t *visible, int64_t vb, int64_t vh, int64_t vi, float *out, float *sums) {
    if (batch < 1 || kv_heads < 1 || group < 1 || n < 1 || total < n || total_pad < total || total_pad % KT ||
        D < 1 || Dv < 1 || Dv_pad < Dv || Dv_pad % KT || block < 1 || threads < 1)
        return 1;
    job_t job = {.batch = batch, .kv_heads = kv_heads, .group = group, .n = n, .total = total,
                 .total_pad = total_pad, .D = D, .Dv = Dv, .Dv_pad = Dv_pad, .block = block,
                 .items = batch * kv_heads * ((n + block - 1) / block), .q = q, .kt = kt, .v = v,
                 .visible = visible, .vb = vb, .vh = vh, .vi = vi, .out = out, .sums = sums};
    pthread_mutex_init(&job.lock, NULL);
    memset(sums, 0, sizeof(float) * (int64_t)batch * kv_heads * total);
    threads = threads < job.items ? threads : job.items;
    pthread_t ids[256];
    threads = threads < 256 ? threads : 256;
    int started = 1;
    while (started < threads && !pthread_create(&ids[started], NULL, worker_main, &job)) started++;
    worker_main(&job);
    for (int t = 1; t < started; t++) pthread_join(ids[t], NULL);
    pthread_mutex_destroy(&job.lock);
    return job.done < job.items ? 2 : 0;
}

/* Keys per logits tile (the padding unit of `total_pad` and `Dv_pad`) of this build: 64 with AVX-512, else 16. */
int h2o_cpu_prefill_tile(void) { return KT; }
