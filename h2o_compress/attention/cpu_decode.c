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
 * Scratch (logits of one KV head's query group) is a per-thread buffer grown when a larger layer needs it, so
 * steady-state decoding allocates nothing. Returns 0, or 1 for shapes it does not take (D > 512, Hq % Hkv),
 * 2 when scratch cannot be allocated.
 */
#include <math.h>
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
    const float *prior_weights)
{
    static __thread float *scratch = 0;
    static __thread size_t scratch_size = 0;
    if (D > 512 || Hq % Hkv) return 1;
    const int group = Hq / Hkv, N = S + R;
    const size_t needed = (size_t)group * (N + 2 * (size_t)D) + 8 * (size_t)D;
    if (needed > scratch_size) {
        float *grown = realloc(scratch, needed * sizeof(float));
        if (!grown) return 2;
        scratch = grown;
        scratch_size = needed;
    }
    const int64_t position = *seen;
    const int r = R ? (int)(position % R) : 0;
    float *logits = scratch;                   /* [group, N] */
    float *qread = logits + (int64_t)group * N; /* [group, D]: the group's queries, rotated, in key read order */
    float *acc = qread + (int64_t)group * D;   /* [group, D]: outputs in value read order */
    float *kin = acc + (int64_t)group * D;     /* [D] each: incoming key/value rotated, leaving key/value, */
    float *vin = kin + D, *leaving_k = vin + D, *leaving_v = leaving_k + D; /* a token read, a scratch row */
    float *kbuf = leaving_v + D, *row = kbuf + D, *leaving_kr = row + D, *leaving_vr = leaving_kr + D;
    int korder[512], vorder[512];
    int all_finite = 1;
    format_t kf = {k_bits, k_group, elem, k_data, k_sz}, vf = {v_bits, v_group, elem, v_data, v_sz};
    read_order(&kf, D, korder);
    read_order(&vf, D, vorder);

    for (int b = 0; b < B; b++) {
        const int32_t leaving_pos = R ? ring_pos[(int64_t)b * R + r] : (int32_t)position;
        if (R) ring_pos[(int64_t)b * R + r] = (int32_t)position;
        const int32_t *rpos = R ? ring_pos + (int64_t)b * R : 0;
        for (int h = 0; h < Hkv; h++) {
            const int64_t bh = (int64_t)b * Hkv + h;
            /* the store row: this head's slots, or a head-adaptive layer's pool of the sequence (slots tagged by
             * `owner`, a slot valid for head h where it holds a token and owner == h) */
            const int64_t srow = owner ? (int64_t)b : bh;
            int8_t *tags = owner ? owner + srow * S : 0;
            const float *kx = k_new + bh * D, *vx = v_new + bh * D;
            for (int i = 0; i < D; i++) all_finite &= isfinite(kx[i]) && isfinite(vx[i]);
            rotate(kx, k_basis, D, kin);
            rotate(vx, v_basis, D, vin);
            /* 1. ring in, leaving token out (held at the ring's precision either way) */
            float leaving_score = 0.0f;
            if (R) {
                const int64_t slot = bh * R + r;
                for (int i = 0; i < D; i++) {
                    leaving_k[i] = load_elem(ring_k, slot * D + i, elem);
                    leaving_v[i] = load_elem(ring_v, slot * D + i, elem);
                    store_elem(ring_k, slot * D + i, elem, kin[i]);
                    store_elem(ring_v, slot * D + i, elem, vin[i]);
                }
                if (ring_scores) {
                    leaving_score = ring_scores[slot];
                    ring_scores[slot] = 0.0f;
                }
            } else {
                for (int i = 0; i < D; i++) {
                    float kq = kin[i], vq = vin[i];
                    if (elem == 1) { kq = (float)(half)kq; vq = (float)(half)vq; }
                    else if (elem == 2) { kq = bf16_to_float(float_to_bf16(kq)); vq = bf16_to_float(float_to_bf16(vq)); }
                    leaving_k[i] = kq;
                    leaving_v[i] = vq;
                }
            }
            /* 2. the leaving token into the first empty slot, quantized once */
            int32_t *pos = store_pos + srow * S;
            int j = 0;
            while (j < S && pos[j] >= 0) j++;
            if (j == S) j = 0;
            quantize_into(&kf, srow * S + j, leaving_k, D);
            quantize_into(&vf, srow * S + j, leaving_v, D);
            pos[j] = leaving_pos;
            if (tags) tags[j] = (int8_t)h;
            float *scores = store_scores ? store_scores + srow * S : 0;
            if (scores) scores[j] = leaving_score;
            float *norms = value_norms ? value_norms + srow * S : 0;
            if (norms) { /* the stored value as attention reads it, in the model's basis (acc: free until step 3) */
                dequantize(&vf, srow * S + j, D, kbuf);
                for (int i = 0; i < D; i++) row[vorder[i]] = kbuf[i];
                rotate(row, v_basis, D, acc);
                float total = 0.0f;
                if (prior_weights) { /* CalibratedPolicy's token prior: w . v + w_norm log(|v|_2 + 1e-6) + bias */
                    const float *w = prior_weights + (int64_t)h * (D + 4);
                    float square = 0.0f;
                    for (int i = 0; i < D; i++) { total += w[2 + i] * acc[i]; square += acc[i] * acc[i]; }
                    total += w[2 + D] * logf(sqrtf(square) + 1e-6f) + w[3 + D];
                } else {
                    for (int i = 0; i < D; i++) total += fabsf(acc[i]);
                }
                norms[j] = total;
            }
            for (int i = 0; i < D; i++) { /* the leaving token at full precision, in read order */
                leaving_kr[i] = leaving_k[korder[i]];
                leaving_vr[i] = leaving_v[vorder[i]];
            }
            /* 3. attention: logits of every query head of the group, one key dequantized at a time */
            for (int g = 0; g < group; g++) {
                rotate(q + (bh * group + g) * D, k_basis, D, row);
                for (int i = 0; i < D; i++) qread[g * D + i] = row[korder[i]];
            }
            for (int n = 0; n < N; n++) {
                const int valid = n < S ? pos[n] >= 0 && (!tags || tags[n] == h) : rpos[n - S] >= 0;
                if (!valid) {
                    for (int g = 0; g < group; g++) logits[g * N + n] = -INFINITY;
                    continue;
                }
                const float *key = kbuf;
                if (n == j) key = leaving_kr;
                else if (n < S) dequantize(&kf, srow * S + n, D, kbuf);
                else for (int i = 0; i < D; i++) kbuf[i] = load_elem(ring_k, (bh * R + n - S) * D + korder[i], elem);
                for (int g = 0; g < group; g++) logits[g * N + n] = dot(qread + g * D, key, D) * scale;
            }
            for (int g = 0; g < group; g++) { /* softmax in place */
                float *l = logits + g * N, top = -INFINITY, total = 0.0f;
                for (int n = 0; n < N; n++) top = l[n] > top ? l[n] : top;
                for (int n = 0; n < N; n++) {
                    l[n] = l[n] == -INFINITY ? 0.0f : expf(l[n] - top);
                    total += l[n];
                }
                const float inv = 1.0f / total;
                for (int n = 0; n < N; n++) l[n] *= inv;
            }
            memset(acc, 0, sizeof(float) * group * D);
            for (int n = 0; n < N; n++) { /* output: one value dequantized at a time */
                const int valid = n < S ? pos[n] >= 0 && (!tags || tags[n] == h) : rpos[n - S] >= 0;
                if (!valid) continue;
                const float *value = kbuf;
                if (n == j) value = leaving_vr;
                else if (n < S) dequantize(&vf, srow * S + n, D, kbuf);
                else for (int i = 0; i < D; i++) kbuf[i] = load_elem(ring_v, (bh * R + n - S) * D + vorder[i], elem);
                float received = 0.0f;
                for (int g = 0; g < group; g++) {
                    const float p = logits[g * N + n];
                    float *restrict o = acc + g * D;
#pragma omp simd
                    for (int i = 0; i < D; i++) o[i] += p * value[i];
                    received += p;
                }
                /* 4. H2O scores: what each token received, summed over the group's query heads */
                if (n < S) {
                    if (scores) scores[n] = replace_scores ? received : scores[n] + received;
                } else if (ring_scores) {
                    float *held = ring_scores + bh * R + n - S;
                    *held = replace_scores ? received : *held + received;
                }
            }
            if (replace_scores) { /* slots nobody attends (empty) get 0, as the torch form's copy gives */
                if (scores) for (int n = 0; n < S; n++) if (pos[n] < 0) scores[n] = 0.0f;
                if (ring_scores) for (int t = 0; t < R; t++) if (rpos[t] < 0) ring_scores[bh * R + t] = 0.0f;
            }
            for (int g = 0; g < group; g++) { /* back to element order, then out of the value basis */
                for (int i = 0; i < D; i++) row[vorder[i]] = acc[g * D + i];
                rotate(row, v_basis, D, out + (bh * group + g) * D);
            }
            if (first_real[b] > position) first_real[b] = position;
            if (evict && !owner)
                evict_lowest(pos, rank ? rank + bh * S : 0, norms,
                             prior_weights ? prior_weights + (int64_t)h * (D + 4) : 0, position + 1, rpos, S, R,
                             capacity, position + 1 - recent, first_real[b], sinks);
        }
    }
    if (reference_seen && *reference_seen != position + 1) *consistent = 0;
    *seen = position + 1;
    if (!all_finite) *finite = 0;
    return 0;
}
