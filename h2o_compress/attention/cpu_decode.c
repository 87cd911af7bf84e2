/* The compressed decode step of one attention layer on the CPU, as one call (h2o_compress.kernels.cpu).
 *
 * Per (sequence b, KV head h), in place over the layer's fixed buffers (layout: docs/cache-layout.md):
 *   1. the new token (rotated into each format's basis) enters the ring window at slot seen % R; the token it
 *      replaces leaves the ring (no ring: the new token itself leaves at once);
 *   2. the leaving token is quantized once into the first empty slot of the store (its score moves with it);
 *   3. attention of the group's query heads over the valid store slots (dequantized in registers; the leaving
 *      token at full precision during this, its last step there) and the ring, one softmax per query head;
 *   4. the probabilities, summed over the group's query heads, are added to the scores (H2O, arXiv 2306.14048
 *      section 4), or replace them (`replace_scores`: TOVA); the output is rotated back out of the value basis.
 *   5. where the sequence and head hold more than `capacity` tokens, the store slot of lowest priority is
 *      emptied (the shared rules of EvictionPolicy.priority over the policy's own rank, passed in as a tensor,
 *      times `value_norms` where given: VATP, arXiv 2406.12335 section 3).
 * With `value_norms` ([rows, S] fp32), step 2 also writes the L1 norm of the leaving token's stored value, dequantized
 * and turned back out of the value basis (the model's basis), into its slot; with `prior_weights` ([Hkv, D + 4]
 * fp32: CalibratedPolicy, KVzap-style arXiv 2601.07891) it writes the token's prior instead (w . v + w_norm
 * log(|v|_2 + 1e-6) + bias), and step 5 ranks by w_score log(score + 1e-4) + w_age log(age) + that prior.
 * Then seen += 1, first_real = min(first_real, position), and the flags: finite &= every new key and value is
 * finite; consistent &= this layer now has seen what layer 0 has (`reference_seen`).
 *
 * Arithmetic follows the torch reference (h2o_compress.cache.layer, formats.integer): fp32 throughout,
 * scale = max((high - low) / qmax, 1e-6) and zero = low rounded to fp16, codes = round-half-even((x - zero) /
 * scale) clamped to [0, qmax], int4 packed low nibble first. Storage elements: 0 fp32, 1 fp16, 2 bf16.
 * Threads: with `threads` > 1, B >= 2 and B * Hkv * (S + R) * D >= PARALLEL_WORK, the sequences (never the heads
 * of one: a head-adaptive pool's heads share its store row) are split over min(threads, B) threads, the calling
 * thread one of them, each taking the next sequence from an atomic counter. Built with OpenMP (cpu.py's flags),
 * the threads are an OpenMP team: torch's own pool, since this library's libgomp is the one torch loaded (pthreads
 * of our own share the other cores with torch's pool threads, which spin after each op, and gained little where
 * the team halves the kernel's time); threshold 1 << 14. Built without OpenMP (a compiler without it): pthreads
 * started per call, joined before return; threshold 1 << 17.
 * Each sequence writes only its own rows, so the results are bitwise those of one thread; the finite flag is each
 * thread's own, ANDed after the join, and seen/consistent are written once after it. A thread the call does not
 * get (or that has no scratch) leaves its share to the others. Below the threshold the calling thread runs every
 * sequence in order, as before.
 * Scratch (logits of one KV head's query group, a few rows): each thread's own buffer, kept and grown when a
 * larger layer needs it, so steady-state decoding allocates nothing (the calling thread's, and the OpenMP pool's
 * threads', which live on); pthreads started per call get theirs allocated before and freed after the join; all
 * 64-byte aligned. Returns 0, or 1 for shapes it does not
 * take (D > 512, Hq % Hkv), 2 when the calling thread's scratch cannot be allocated.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef _Float16 half;

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, NaN kept NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float load_elem(const void *base, int64_t i, int elem) {
    if (elem == 1) return (float)((const half *)base)[i];
    if (elem == 2) return bf16_to_float(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

static inline void store_elem(void *base, int64_t i, int elem, float v) {
    if (elem == 1) ((half *)base)[i] = (half)v;
    else if (elem == 2) ((uint16_t *)base)[i] = float_to_bf16(v);
    else ((float *)base)[i] = v;
}

/* x (fp32 [D]) rotated into a basis: y = x @ basis ([D, D], row-major); no basis: a copy. */
static void rotate(const float *restrict x, const float *restrict basis, int D, float *restrict y) {
    if (!basis) {
        memcpy(y, x, sizeof(float) * D);
        return;
    }
    for (int j = 0; j < D; j++) y[j] = 0.0f;
    for (int i = 0; i < D; i++) {
        const float xi = x[i];
        const float *restrict row = basis + (int64_t)i * D;
        for (int j = 0; j < D; j++) y[j] += xi * row[j];
    }
}

/* One stored format: bits 4 or 8 (data uint8 [.., S, D * bits / 8], scale_zero fp16 [.., S, D / group, 2]),
 * or 16 (raw elements of type `elem`, [.., S, D]). */
typedef struct {
    int bits, group, elem;
    void *data;
    half *scale_zero;
} format_t;

static void quantize_into(const format_t *f, int64_t token, const float *restrict x, int D) {
    if (f->bits == 16) {
        for (int i = 0; i < D; i++) store_elem(f->data, token * D + i, f->elem, x[i]);
        return;
    }
    const int groups = D / f->group;
    const float qmax = (float)((1 << f->bits) - 1);
    uint8_t *restrict out = (uint8_t *)f->data + token * (int64_t)(D * f->bits / 8);
    half *restrict sz = f->scale_zero + token * groups * 2;
    uint8_t codes[512];
    for (int g = 0; g < groups; g++) {
        const float *restrict v = x + g * f->group;
        float low = v[0], high = v[0];
        for (int i = 1; i < f->group; i++) {
            low = v[i] < low ? v[i] : low; /* NaN handling as amin/amax is irrelevant: the finite flag fails */
            high = v[i] > high ? v[i] : high;
        }
        float scale = (high - low) / qmax;
        scale = scale < 1e-6f ? 1e-6f : scale;
        sz[2 * g] = (half)scale;
        sz[2 * g + 1] = (half)low;
        const float s = (float)sz[2 * g], z = (float)sz[2 * g + 1];
        for (int i = 0; i < f->group; i++) {
            float q = nearbyintf((v[i] - z) / s);
            q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
            codes[g * f->group + i] = (uint8_t)q;
        }
    }
    if (f->bits == 8) {
        memcpy(out, codes, D);
    } else {
        for (int i = 0; i < D / 2; i++) out[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
    }
}

/* Element order a format reads in (`order[j]` = the element at position j): int4 groups read their low nibbles,
 * then their high nibbles, so unpacking is two contiguous, vectorizable passes; other formats read in order.
 * Queries are permuted into the key order and outputs accumulate in the value order, then are permuted back. */
static void read_order(const format_t *f, int D, int *order) {
    for (int j = 0; j < D; j++) order[j] = j;
    if (f->bits != 4) return;
    const int G = f->group;
    for (int g = 0; g < D / G; g++)
        for (int i = 0; i < G / 2; i++) {
            order[g * G + i] = g * G + 2 * i;
            order[g * G + G / 2 + i] = g * G + 2 * i + 1;
        }
}

/* Stored token `token` as fp32 in the format's read order: zero + code * scale per element (the torch
 * reference's addcmul), or the 16-bit element itself. */
static void dequantize(const format_t *f, int64_t token, int D, float *restrict y) {
    if (f->bits == 16) {
        if (f->elem == 0) memcpy(y, (const float *)f->data + token * D, sizeof(float) * D);
        else if (f->elem == 1) {
            const half *restrict x = (const half *)f->data + token * D;
            for (int i = 0; i < D; i++) y[i] = (float)x[i];
        } else {
            for (int i = 0; i < D; i++) y[i] = load_elem(f->data, token * D + i, 2);
        }
        return;
    }
    const int groups = D / f->group, G = f->group;
    const half *restrict sz = f->scale_zero + token * groups * 2;
    if (f->bits == 8) {
        const uint8_t *restrict d = (const uint8_t *)f->data + token * D;
        for (int g = 0; g < groups; g++) {
            const float s = (float)sz[2 * g], z = (float)sz[2 * g + 1];
            for (int i = 0; i < G; i++) y[g * G + i] = z + (float)d[g * G + i] * s;
        }
    } else {
        const uint8_t *restrict d = (const uint8_t *)f->data + token * (D / 2);
        for (int g = 0; g < groups; g++) {
            const float s = (float)sz[2 * g], z = (float)sz[2 * g + 1];
            const uint8_t *restrict dg = d + g * G / 2;
            float *restrict lo = y + g * G, *restrict hi = lo + G / 2;
            for (int i = 0; i < G / 2; i++) lo[i] = z + (float)(dg[i] & 15) * s;
            for (int i = 0; i < G / 2; i++) hi[i] = z + (float)(dg[i] >> 4) * s;
        }
    }
}

static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < D; i++) total += a[i] * b[i];
    return total;
}

/* 5. Eviction (the rule of EvictionPolicy.priority and SlotStore.evict_lowest): where a sequence and head hold
 * more than `capacity` tokens, empty the store slot of lowest priority; priority is +inf for empty slots, the
 * recent window (positions >= recent_start) and the sinks (the first `sinks` positions from first_real), else
 * the policy's rank (`rank`, or all equal when NULL); ties evict the newer token. */
static void evict_lowest(int32_t *pos, const float *rank, const float *weights, const float *predict,
                         int64_t now, const int32_t *rpos, int S, int R,
                         int capacity, int64_t recent_start, int64_t first, int sinks) {
    int held = 0;
    for (int n = 0; n < S; n++) held += pos[n] >= 0;
    for (int t = 0; t < R; t++) held += rpos[t] >= 0;
    if (held <= capacity) return;
    float lowest = INFINITY;
    int victim = -1;
    int32_t victim_pos = -1;
    for (int n = 0; n < S; n++) {
        const int64_t p = pos[n];
        float priority = rank ? rank[n] : 0.0f;
        if (predict) { /* CalibratedPolicy: w_score log(score + floor) + w_age log(age) + the slot's prior */
            const float age = p >= 0 && now - p > 1 ? (float)(now - p) : 1.0f;
            priority = predict[0] * logf(priority + 1e-4f) + predict[1] * logf(age) + weights[n];
        } else if (weights) priority *= weights[n];
        if (p < 0 || p >= recent_start || (p >= first && p < first + sinks)) priority = INFINITY;
        if (victim < 0 || priority < lowest || (priority == lowest && p > victim_pos)) {
            lowest = priority;
            victim = n;
            victim_pos = (int32_t)p;
        }
    }
    pos[victim] = -1;
}

/* Sequences x KV heads x (slots + ring) x head dim from which a call splits its sequences over threads, where
 * timing one layer's call at growing work, threads 1 against 2, found a second thread to start paying. An OpenMP
 * team is torch's own pool, whose threads wait spinning after each torch op, so a region costs little: a low
 * threshold. Pthreads started per call cost a thread start and join each, and share the core with torch's
 * spinning pool threads: a threshold 8 times higher. */
#ifdef _OPENMP
#define PARALLEL_WORK (1 << 14)
#else
#define PARALLEL_WORK (1 << 17)
#endif
#define MAX_THREADS 64

/* One call's arguments and what follows from them, shared by its threads: read-only but for `next`; each sequence
 * writes only its own rows (store row, ring row, scores, output, first_real[b]). */
typedef struct {
    int B, Hkv, D, S, R, group, N, r, elem, capacity, recent, sinks, evict, replace_scores;
    float scale;
    int64_t position;
    const float *q, *k_new, *v_new, *k_basis, *v_basis, *rank, *prior_weights;
    float *out, *store_scores, *ring_scores, *value_norms;
    format_t kf, vf;
    int32_t *store_pos, *ring_pos;
    void *ring_k, *ring_v;
    int64_t *first_real;
    int8_t *owner;
    int korder[512], vorder[512];
    int next; /* the next sequence to decode (atomic) */
} layer_t;

/* One thread's scratch, carved from one buffer of `scratch_floats` floats. */
typedef struct {
    float *logits;               /* [group, N] */
    float *qread;                /* [group, D]: the group's queries, rotated, in key read order */
    float *acc;                  /* [group, D]: outputs in value read order */
    float *kin, *vin;            /* [D] each: incoming key/value rotated, */
    float *leaving_k, *leaving_v; /* the leaving key/value, */
    float *kbuf, *row;           /* a token read, a scratch row, */
    float *leaving_kr, *leaving_vr; /* the leaving key/value in read order */
} scratch_t;

/* One sequence and KV head of a call: its store row (`srow`: this head's slots, or a head-adaptive layer's pool
 * of the sequence, slots tagged by `owner`, a slot valid for head h where it holds a token and owner == h), its
 * ring row, and the store slot its leaving token went to (`j`). */
typedef struct {
    int b, h, j;
    int64_t bh, srow;
    int32_t *pos;
    const int32_t *rpos;
    const int8_t *tags;
} head_t;

static size_t scratch_floats(int group, int N, int D) {
    return (size_t)group * (N + 2 * (size_t)D) + 8 * (size_t)D;
}

/* 64-byte aligned (every thread's scratch alike, so vectorized loops split the same way on each), or NULL. */
static float *aligned_floats(size_t n) {
    void *p = 0;
    return posix_memalign(&p, 64, n * sizeof(float)) ? 0 : p;
}

/* This thread's scratch of at least `needed` floats, kept between calls and grown when a larger layer needs it
 * (the calling thread's, and each thread of torch's OpenMP pool, which live on), or NULL. */
static float *thread_scratch(size_t needed) {
    static __thread float *scratch = 0;
    static __thread size_t size = 0;
    if (needed > size) {
        free(scratch);
        scratch = aligned_floats(needed);
        size = scratch ? needed : 0;
    }
    return scratch;
}

static scratch_t carve(const layer_t *L, float *base) {
    scratch_t s;
    s.logits = base;
    s.qread = s.logits + (int64_t)L->group * L->N;
    s.acc = s.qread + (int64_t)L->group * L->D;
    s.kin = s.acc + (int64_t)L->group * L->D;
    s.vin = s.kin + L->D;
    s.leaving_k = s.vin + L->D;
    s.leaving_v = s.leaving_k + L->D;
    s.kbuf = s.leaving_v + L->D;
    s.row = s.kbuf + L->D;
    s.leaving_kr = s.row + L->D;
    s.leaving_vr = s.leaving_kr + L->D;
    return s;
}

/* 1. The new token (kin, vin) into the ring at slot r, the token it replaces out into leaving_k/v (held at the
 * ring's precision either way: no ring, the new token itself leaves at once); returns the leaving token's score. */
static float ring_in(const layer_t *L, int64_t bh, const scratch_t *s) {
    const int D = L->D, elem = L->elem;
    if (!L->R) {
        for (int i = 0; i < D; i++) {
            float kq = s->kin[i], vq = s->vin[i];
            if (elem == 1) { kq = (float)(half)kq; vq = (float)(half)vq; }
            else if (elem == 2) { kq = bf16_to_float(float_to_bf16(kq)); vq = bf16_to_float(float_to_bf16(vq)); }
            s->leaving_k[i] = kq;
            s->leaving_v[i] = vq;
        }
        return 0.0f;
    }
    const int64_t slot = bh * L->R + L->r;
    for (int i = 0; i < D; i++) {
        s->leaving_k[i] = load_elem(L->ring_k, slot * D + i, elem);
        s->leaving_v[i] = load_elem(L->ring_v, slot * D + i, elem);
        store_elem(L->ring_k, slot * D + i, elem, s->kin[i]);
        store_elem(L->ring_v, slot * D + i, elem, s->vin[i]);
    }
    float leaving_score = 0.0f;
    if (L->ring_scores) {
        leaving_score = L->ring_scores[slot];
        L->ring_scores[slot] = 0.0f;
    }
    return leaving_score;
}

/* The L1 norm of the value stored at `token` (or, with prior_weights, CalibratedPolicy's token prior: w . v +
 * w_norm log(|v|_2 + 1e-6) + bias), as attention reads it, in the model's basis (acc: free until step 3). */
static float value_norm(const layer_t *L, int h, int64_t token, const scratch_t *s) {
    const int D = L->D;
    dequantize(&L->vf, token, D, s->kbuf);
    for (int i = 0; i < D; i++) s->row[L->vorder[i]] = s->kbuf[i];
    rotate(s->row, L->v_basis, D, s->acc);
    float total = 0.0f;
    if (L->prior_weights) {
        const float *w = L->prior_weights + (int64_t)h * (D + 4);
        float square = 0.0f;
        for (int i = 0; i < D; i++) { total += w[2 + i] * s->acc[i]; square += s->acc[i] * s->acc[i]; }
        total += w[2 + D] * logf(sqrtf(square) + 1e-6f) + w[3 + D];
    } else {
        for (int i = 0; i < D; i++) total += fabsf(s->acc[i]);
    }
    return total;
}

/* 2. The leaving token into the first empty slot of the store row, quantized once (its score and norm with it);
 * returns the slot. */
static int store_leaving(const layer_t *L, const head_t *t, int32_t leaving_pos, float leaving_score,
                         const scratch_t *s) {
    const int S = L->S, D = L->D;
    int j = 0;
    while (j < S && t->pos[j] >= 0) j++;
    if (j == S) j = 0;
    const int64_t token = t->srow * S + j;
    quantize_into(&L->kf, token, s->leaving_k, D);
    quantize_into(&L->vf, token, s->leaving_v, D);
    t->pos[j] = leaving_pos;
    if (L->owner) L->owner[token] = (int8_t)t->h;
    if (L->store_scores) L->store_scores[token] = leaving_score;
    if (L->value_norms) L->value_norms[token] = value_norm(L, t->h, token, s);
    for (int i = 0; i < D; i++) { /* the leaving token at full precision, in read order */
        s->leaving_kr[i] = s->leaving_k[L->korder[i]];
        s->leaving_vr[i] = s->leaving_v[L->vorder[i]];
    }
    return j;
}

/* Whether slot n (the store's, then the ring's) holds a token this head reads. */
static inline int readable(const head_t *t, int S, int n) {
    return n < S ? t->pos[n] >= 0 && (!t->tags || t->tags[n] == t->h) : t->rpos[n - S] >= 0;
}

/* Ring slot `slot`'s row (of ring_k or ring_v) as fp32 in a format's read order (`order`). */
static inline void ring_read(const layer_t *L, const void *ring, int64_t slot, const int *order, float *restrict y) {
    for (int i = 0; i < L->D; i++) y[i] = load_elem(ring, slot * L->D + order[i], L->elem);
}

/* 3. Attention: logits of every query head of the group, one key dequantized at a time, then one softmax per query
 * head, in place (logits: the probabilities). */
static void attention_weights(const layer_t *L, const head_t *t, const scratch_t *s) {
    const int S = L->S, N = L->N, D = L->D, group = L->group;
    float *logits = s->logits;
    if (D > 512) __builtin_unreachable();
    for (int g = 0; g < group; g++) {
        rotate(L->q + (t->bh * group + g) * D, L->k_basis, D, s->row);
        for (int i = 0; i < D; i++) s->qread[g * D + i] = s->row[L->korder[i]];
    }
    for (int n = 0; n < N; n++) {
        if (!readable(t, S, n)) {
            for (int g = 0; g < group; g++) logits[g * N + n] = -INFINITY;
            continue;
        }
        const float *key = s->kbuf; /* the leaving token at full precision, a store slot, or a ring slot */
        if (n == t->j) key = s->leaving_kr;
        else if (n < S) dequantize(&L->kf, t->srow * S + n, D, s->kbuf);
        else ring_read(L, L->ring_k, t->bh * L->R + n - S, L->korder, s->kbuf);
        for (int g = 0; g < group; g++) logits[g * N + n] = dot(s->qread + g * D, key, D) * L->scale;
    }
    for (int g = 0; g < group; g++) {
        float *l = logits + g * N, top = -INFINITY, total = 0.0f;
        for (int n = 0; n < N; n++) top = l[n] > top ? l[n] : top;
        for (int n = 0; n < N; n++) {
            l[n] = l[n] == -INFINITY ? 0.0f : expf(l[n] - top);
            total += l[n];
        }
        const float inv = 1.0f / total;
        for (int n = 0; n < N; n++) l[n] *= inv;
    }
}

/* 3 (cont.) and 4. The output, one value dequantized at a time, rotated back out of the value basis; the H2O
 * scores: what each token received, summed over the group's query heads, added (or, replace_scores, replacing:
 * slots nobody attends get 0, as the torch form's copy gives). */
static void attention_output(const layer_t *L, const head_t *t, const scratch_t *s) {
    const int S = L->S, N = L->N, D = L->D, group = L->group, replace = L->replace_scores;
    float *scores = L->store_scores ? L->store_scores + t->srow * S : 0;
    float *ring_scores = L->ring_scores && L->R ? L->ring_scores + t->bh * L->R : 0;
    memset(s->acc, 0, sizeof(float) * group * D);
    for (int n = 0; n < N; n++) {
        if (!readable(t, S, n)) continue;
        const float *value = s->kbuf;
        if (n == t->j) value = s->leaving_vr;
        else if (n < S) dequantize(&L->vf, t->srow * S + n, D, s->kbuf);
        else ring_read(L, L->ring_v, t->bh * L->R + n - S, L->vorder, s->kbuf);
        float received = 0.0f;
        for (int g = 0; g < group; g++) {
            const float p = s->logits[g * N + n];
            float *restrict o = s->acc + g * D;
#pragma omp simd
            for (int i = 0; i < D; i++) o[i] += p * value[i];
            received += p;
        }
        if (n < S) {
            if (scores) scores[n] = replace ? received : scores[n] + received;
        } else if (ring_scores) {
            float *held = ring_scores + n - S;
            *held = replace ? received : *held + received;
        }
    }
    if (replace) {
        if (scores) for (int n = 0; n < S; n++) if (t->pos[n] < 0) scores[n] = 0.0f;
        if (ring_scores) for (int u = 0; u < L->R; u++) if (t->rpos[u] < 0) ring_scores[u] = 0.0f;
    }
    for (int g = 0; g < group; g++) { /* back to element order, then out of the value basis */
        for (int i = 0; i < D; i++) s->row[L->vorder[i]] = s->acc[g * D + i];
        rotate(s->row, L->v_basis, D, L->out + (t->bh * group + g) * D);
    }
}

/* Steps 1-5 for sequence b and KV head h; returns whether the head's new key and value are finite. */
static int decode_head(const layer_t *L, int b, int h, int32_t leaving_pos, const scratch_t *s) {
    const int D = L->D, S = L->S;
    head_t t = {.b = b, .h = h, .bh = (int64_t)b * L->Hkv + h};
    t.srow = L->owner ? (int64_t)b : t.bh;
    t.pos = L->store_pos + t.srow * S;
    t.tags = L->owner ? L->owner + t.srow * S : 0;
    t.rpos = L->R ? L->ring_pos + (int64_t)b * L->R : 0;
    const float *kx = L->k_new + t.bh * D, *vx = L->v_new + t.bh * D;
    int finite = 1;
    for (int i = 0; i < D; i++) finite &= isfinite(kx[i]) && isfinite(vx[i]);
    rotate(kx, L->k_basis, D, s->kin);
    rotate(vx, L->v_basis, D, s->vin);
    const float leaving_score = ring_in(L, t.bh, s);
    t.j = store_leaving(L, &t, leaving_pos, leaving_score, s);
    attention_weights(L, &t, s);
    attention_output(L, &t, s);
    if (L->first_real[b] > L->position) L->first_real[b] = L->position;
    if (L->evict && !L->owner)
        evict_lowest(t.pos, L->rank ? L->rank + t.bh * S : 0, L->value_norms ? L->value_norms + t.srow * S : 0,
                     L->prior_weights ? L->prior_weights + (int64_t)h * (D + 4) : 0, L->position + 1, t.rpos, S,
                     L->R, L->capacity, L->position + 1 - L->recent, L->first_real[b], L->sinks);
    return finite;
}

/* Sequences taken from the shared counter (in order, one at a time) until none is left, on scratch `base`;
 * returns whether all their new keys and values were finite. */
static int decode_sequences(layer_t *L, float *base) {
    const scratch_t s = carve(L, base);
    int finite = 1;
    for (int b; (b = __atomic_fetch_add(&L->next, 1, __ATOMIC_RELAXED)) < L->B;) {
        const int64_t at = (int64_t)b * L->R + L->r;
        const int32_t leaving_pos = L->R ? L->ring_pos[at] : (int32_t)L->position;
        if (L->R) L->ring_pos[at] = (int32_t)L->position;
        for (int h = 0; h < L->Hkv; h++) finite &= decode_head(L, b, h, leaving_pos, &s);
    }
    return finite;
}

#ifdef _OPENMP
/* The sequences split over an OpenMP team of up to `threads` (torch's own pool, where torch loaded the libgomp this
 * library links: one runtime, no second set of threads), the calling thread (thread 0) one of them; each thread
 * decodes on its own kept scratch (`thread_scratch`: nothing allocated per step once grown; a thread without
 * scratch, or one the team does not get, leaves its share to the others). Returns whether all new keys and values
 * were finite: each thread's flag, ANDed after the region. */
static int decode_threaded(layer_t *L, float *scratch, int threads) {
    int flags[MAX_THREADS];
    const size_t floats = scratch_floats(L->group, L->N, L->D);
    for (int t = 0; t < threads; t++) flags[t] = 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        float *mine = t == 0 ? scratch : thread_scratch(floats);
        if (mine) flags[t] = decode_sequences(L, mine);
    }
    int finite = 1;
    for (int t = 0; t < threads; t++) finite &= flags[t];
    return finite;
}
#else
typedef struct {
    layer_t *L;
    float *scratch; /* its own, from the spawner */
    int finite;
} worker_t;

static void *worker_main(void *arg) {
    worker_t *w = arg;
    w->finite = decode_sequences(w->L, w->scratch);
    return NULL;
}

/* Built without OpenMP: the sequences split over the calling thread (its scratch) and up to threads - 1 pthreads
 * started for the call, each with scratch allocated here and freed after the join; a worker whose scratch or
 * thread cannot be had leaves its share to the others. Returns whether all new keys and values were finite (each
 * thread's flag, ANDed after the join). */
static int decode_threaded(layer_t *L, float *scratch, int threads) {
    worker_t workers[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    const size_t floats = scratch_floats(L->group, L->N, L->D);
    int started = 0;
    while (started < threads - 1) {
        workers[started] = (worker_t){L, aligned_floats(floats), 1};
        if (!workers[started].scratch || pthread_create(&ids[started], NULL, worker_main, &workers[started])) {
            free(workers[started].scratch);
            break;
        }
        started++;
    }
    int finite = decode_sequences(L, scratch);
    for (int t = 0; t < started; t++) {
        pthread_join(ids[t], NULL);
        finite &= workers[t].finite;
        free(workers[t].scratch);
    }
    return finite;
}
#endif

int h2o_cpu_decode_layer(
    int B, int Hq, int Hkv, int D, int S, int R, float scale,
    const float *q, const float *k_new, const float *v_new, float *out,
    int k_bits, int k_group, void *k_data, half *k_sz, const float *k_basis,
    int v_bits, int v_group, void *v_data, half *v_sz, const float *v_basis,
    int elem, int32_t *store_pos, float *store_scores,
    void *ring_k, void *ring_v, int32_t *ring_pos, float *ring_scores,
    int64_t *seen, int64_t *first_real, uint8_t *finite,
    int capacity, int recent, int sinks, const float *rank, int evict,
    const int64_t *reference_seen, uint8_t *consistent, int replace_scores, int8_t *owner, float *value_norms,
    const float *prior_weights, int threads)
{
    if (D > 512 || Hq % Hkv) return 1;
    const int group = Hq / Hkv, N = S + R;
    float *scratch = thread_scratch(scratch_floats(group, N, D)); /* the calling thread's, kept between calls */
    if (!scratch) return 2;
    const int64_t position = *seen;
    layer_t L = {
        .B = B, .Hkv = Hkv, .D = D, .S = S, .R = R, .group = group, .N = N, .r = R ? (int)(position % R) : 0,
        .elem = elem, .capacity = capacity, .recent = recent, .sinks = sinks, .evict = evict,
        .replace_scores = replace_scores, .scale = scale, .position = position, .q = q, .k_new = k_new,
        .v_new = v_new, .k_basis = k_basis, .v_basis = v_basis, .rank = rank, .prior_weights = prior_weights,
        .out = out, .store_scores = store_scores, .ring_scores = ring_scores, .value_norms = value_norms,
        .kf = {k_bits, k_group, elem, k_data, k_sz}, .vf = {v_bits, v_group, elem, v_data, v_sz},
        .store_pos = store_pos, .ring_pos = ring_pos, .ring_k = ring_k, .ring_v = ring_v, .first_real = first_real,
        .owner = owner, .next = 0,
    };
    read_order(&L.kf, D, L.korder);
    read_order(&L.vf, D, L.vorder);
    threads = threads < B ? threads : B;
    threads = threads < MAX_THREADS ? threads : MAX_THREADS;
    const int64_t work = (int64_t)B * Hkv * N * D;
    const int all_finite = threads > 1 && work >= PARALLEL_WORK ? decode_threaded(&L, scratch, threads)
                                                                 : decode_sequences(&L, scratch);
    if (reference_seen && *reference_seen != position + 1) *consistent = 0;
    *seen = position + 1;
    if (!all_finite) *finite = 0;
    return 0;
}

/* The work (sequences x KV heads x (slots + ring) x head dim) from which a call runs on more than one thread. */
int h2o_cpu_decode_parallel_work(void) { return PARALLEL_WORK; }
