/* A front for cblas_sgemm that streams the weights of skinny products (mlx_grpo/skinny.py).
 *
 * MLX computes a linear layer x W^T as cblas_sgemm(RowMajor, NoTrans, Trans, M, N, K, 1, x,
 * lda, W, ldb, 0, y, ldc). At decode's M (a few to 32 rows) every BLAS tried packs W before
 * it multiplies and reads it at about half the memory bandwidth. Here such a call is a set
 * of dot products instead: each W row is read once, straight from memory, against every
 * row of x (which stays in cache), the output columns shared between this thread and the
 * pool's. Any other call goes to the BLAS whose cblas_sgemm `skinny_init` was given.
 *
 * Small products of a few rows (N * K below `min_weight`, as decode's attention makes: a
 * [rows, 64] x [64, keys] score product and a [rows, keys] x [keys, 64] weighted sum per
 * batch row and key head) run on the calling thread alone, x W^T with the same kernel and
 * x W with `nn256`: OpenBLAS spends longer setting such a call up than computing it.
 *
 * Each y[r][o] is summed in one order, whatever M, the split between threads or the
 * blocking: a vector of partial sums over k in steps of the vector width, then the sum of
 * its lanes (x W: over k in order). A row's result therefore does not depend on which
 * other rows share its call.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

typedef struct {
    const float *x, *w;
    float *y;
    long lda, ldb, ldc;
    int m, k;
} product;

typedef void (*kernel_fn)(const product *, int o0, int o1);

static sgemm_fn fallback;
static kernel_fn kernel;
static int kernel_ob = 4; /* W rows per block of `kernel`: thread ranges are multiples of it */
static int max_rows = 32;
static long min_weight = 65536;  /* N * K below this: no pool (on the calling thread) */
static long max_direct = 1L << 20; /* M * N * K above this, without the pool: the BLAS */
static atomic_long fast_calls, forwarded_calls;

/* ---------------------------------------------------------------- kernels (x86-64) */
#if defined(__x86_64__)

#define RB 4 /* rows of x per block */
#define OB 4 /* rows of W per block */
/* Each block also prefetches, into L2, the W rows FAR blocks ahead (prefetches never fault,
 * past the end of W too). With only the next block's rows asked for, a thread's reads of W
 * and its arithmetic hardly overlapped: 16 rows of the embedded model's 211 decode products
 * took 37 ms on two Zen 4 cores, 32 ms with this; one row 22 ms, 18 ms. */
#define FAR 4

__attribute__((target("avx512f"), always_inline)) static inline void block512(
    const product *p, int r0, int rb, int o, int ob) {
    __m512 acc[RB][OB];
    for (int i = 0; i < rb; i++)
        for (int j = 0; j < ob; j++) acc[i][j] = _mm512_setzero_ps();
    const float *w = p->w + o * p->ldb, *x = p->x + r0 * p->lda;
    int k = 0;
    for (; k + 16 <= p->k; k += 16) {
        __m512 wv[OB];
        if (r0 == 0)  /* W rows ahead, a cache line at a time: the next block's, and FAR's */
            for (int j = 0; j < OB; j++) {
                _mm_prefetch((const char *)(w + (OB + j) * p->ldb + k), _MM_HINT_T0);
                _mm_prefetch((const char *)(w + (FAR * OB + j) * p->ldb + k), _MM_HINT_T2);
            }
        for (int j = 0; j < ob; j++) wv[j] = _mm512_loadu_ps(w + j * p->ldb + k);
        for (int i = 0; i < rb; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * p->lda + k);
            for (int j = 0; j < ob; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < p->k) {
        __mmask16 mask = (__mmask16)((1u << (p->k - k)) - 1);
        __m512 wv[OB];
        for (int j = 0; j < ob; j++) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * p->ldb + k);
        for (int i = 0; i < rb; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * p->lda + k);
            for (int j = 0; j < ob; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < rb; i++)
        for (int j = 0; j < ob; j++) p->y[(r0 + i) * p->ldc + o + j] = _mm512_reduce_add_ps(acc[i][j]);
}

__attribute__((target("avx512f"))) static void kernel512(const product *p, int o0, int o1) {
    int o = o0;
    for (; o + OB <= o1; o += OB) {
        int r = 0;
        for (; r + RB <= p->m; r += RB) block512(p, r, RB, o, OB);
        if (r < p->m) block512(p, r, p->m - r, o, OB);
    }
    for (; o < o1; o++) {
        int r = 0;
        for (; r + RB <= p->m; r += RB) block512(p, r, RB, o, 1);
        if (r < p->m) block512(p, r, p->m - r, o, 1);
    }
}

__attribute__((target("avx2,fma"), always_inline)) static inline float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* AVX2 has 16 vector registers: a 4 x 3 block (12 sums, 3 W rows, 1 x row) fits them, where
 * 4 x 4 spilled. 16 rows of the decode products on two Zen 3 cores: 46 ms 4 x 4, 36 ms 4 x 3. */
#define RB2 4
#define OB2 3

__attribute__((target("avx2,fma"), always_inline)) static inline void block256(
    const product *p, int r0, int rb, int o, int ob) {
    __m256 acc[RB2][OB2];
    for (int i = 0; i < rb; i++)
        for (int j = 0; j < ob; j++) acc[i][j] = _mm256_setzero_ps();
    const float *w = p->w + o * p->ldb, *x = p->x + r0 * p->lda;
    int k = 0;
    for (; k + 8 <= p->k; k += 8) {
        __m256 wv[OB2];
        if (r0 == 0 && !(k & 15))  /* as in block512 */
            for (int j = 0; j < OB2; j++) {
                _mm_prefetch((const char *)(w + (OB2 + j) * p->ldb + k), _MM_HINT_T0);
                _mm_prefetch((const char *)(w + (FAR * OB2 + j) * p->ldb + k), _MM_HINT_T2);
            }
        for (int j = 0; j < ob; j++) wv[j] = _mm256_loadu_ps(w + j * p->ldb + k);
        for (int i = 0; i < rb; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * p->lda + k);
            for (int j = 0; j < ob; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < p->k) {
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(p->k - k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 wv[OB2];
        for (int j = 0; j < ob; j++) wv[j] = _mm256_maskload_ps(w + j * p->ldb + k, mask);
        for (int i = 0; i < rb; i++) {
            __m256 xv = _mm256_maskload_ps(x + i * p->lda + k, mask);
            for (int j = 0; j < ob; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < rb; i++)
        for (int j = 0; j < ob; j++) p->y[(r0 + i) * p->ldc + o + j] = sum256(acc[i][j]);
}

__attribute__((target("avx2,fma"))) static void kernel256(const product *p, int o0, int o1) {
    int o = o0;
    for (; o + OB2 <= o1; o += OB2) {
        int r = 0;
        for (; r + RB2 <= p->m; r += RB2) block256(p, r, RB2, o, OB2);
        if (r < p->m) block256(p, r, p->m - r, o, OB2);
    }
    for (; o < o1; o++) {
        int r = 0;
        for (; r + RB2 <= p->m; r += RB2) block256(p, r, RB2, o, 1);
        if (r < p->m) block256(p, r, p->m - r, o, 1);
    }
}

/* y = x W, W row-major [k, n] (NoTrans x NoTrans), for small products on one thread: rows
 * in fours (a block of fewer repeats its first row, not stored), 16 columns at a time, the
 * last ones masked. Each y[r][o] is summed over k in order. */
__attribute__((target("avx2,fma"))) static void nn256(const product *p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r0 = 0; r0 < p->m; r0 += 4) {
        int rb = p->m - r0 < 4 ? p->m - r0 : 4;
        const float *xs[4];
        for (int r = 0; r < 4; r++) xs[r] = p->x + (r < rb ? r0 + r : r0) * p->lda;
        for (int o = 0; o < n; o += 16) {
            __m256 acc[4][2];
            for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - o), lanes);
            __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - o - 8), lanes);
            const float *w = p->w + o;
            if (o + 16 <= n)
                for (int k = 0; k < p->k; k++, w += p->ldb) {
                    __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
                    for (int r = 0; r < 4; r++) {
                        __m256 xv = _mm256_broadcast_ss(xs[r] + k);
                        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
                    }
                }
            else
                for (int k = 0; k < p->k; k++, w += p->ldb) {
                    __m256 w0 = _mm256_maskload_ps(w, m0), w1 = _mm256_maskload_ps(w + 8, m1);
                    for (int r = 0; r < 4; r++) {
                        __m256 xv = _mm256_broadcast_ss(xs[r] + k);
                        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
                    }
                }
            for (int r = 0; r < rb; r++) {
                _mm256_maskstore_ps(p->y + (r0 + r) * p->ldc + o, m0, acc[r][0]);
                _mm256_maskstore_ps(p->y + (r0 + r) * p->ldc + o + 8, m1, acc[r][1]);
            }
        }
    }
}

static kernel_fn best_kernel(const char *isa) {
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f");
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa && isa[0] == '2') avx512 = 0; /* "256": the AVX2 kernel on an AVX-512 CPU */
    if (avx512) return kernel512;
    if (avx2) return kernel256;
    return 0;
}
#else
static kernel_fn best_kernel(const char *isa) {
    (void)isa;
    return 0;
}
#endif

/* ------------------------------------------------------------------------- the pool */
#define MAX_THREADS 64

static struct {
    pthread_mutex_t busy;            /* one product at a time; others run on their caller */
    pthread_mutex_t lock;            /* for sleeping workers */
    pthread_cond_t wake;
    _Atomic uint64_t ticket;         /* the product's number, and its chunks not yet claimed */
    atomic_int done, sleepers;       /* chunks finished; workers asleep */
    int workers, started;
    product job;
    int n, chunk, chunks;            /* W rows, W rows a chunk, chunks */
    long spin_ns;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Chunks of product `seq` until none is left, the caller's from the front and the pool
 * threads' from the back, so that each reads W in long runs. Each chunk is claimed by
 * one thread, and the product cannot end before its claimed chunks are done, so its
 * description is stable while a thread works on one. A thread that is descheduled holds
 * up at most the chunk it has claimed; the others take the rest. */
static void work(uint32_t seq, int front) {
    for (;;) {
        uint64_t t = atomic_load(&pool.ticket);
        uint32_t lo = (uint32_t)t & 0xffff, hi = ((uint32_t)t >> 16) & 0xffff;
        if ((uint32_t)(t >> 32) != seq || lo >= hi) return;
        uint32_t c = front ? lo : hi - 1;
        if (!atomic_compare_exchange_weak(&pool.ticket, &t, front ? t + 1 : t - 0x10000)) continue;
        int o0 = (int)c * pool.chunk, o1 = o0 + pool.chunk;
        kernel(&pool.job, o0, o1 < pool.n ? o1 : pool.n);
        atomic_fetch_add(&pool.done, 1);
    }
}

static inline uint32_t product_seq(void) { return (uint32_t)(atomic_load(&pool.ticket) >> 32); }

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = 0;
    for (;;) {
        /* Spin a while (decode calls come every few tens of microseconds), then sleep. */
        long until = now_ns() + pool.spin_ns;
        for (int n = 0; product_seq() == seen; n++) {
            PAUSE();
            if ((n & 255) == 255 && now_ns() > until) {
                pthread_mutex_lock(&pool.lock);
                atomic_fetch_add(&pool.sleepers, 1);
                while (product_seq() == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        seen = product_seq();
        work(seen, 0);
    }
    return 0;
}

/* Threads beyond the caller's, started on first use; never more than asked so far. */
static int ensure_workers(int n) {
    while (pool.started < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, worker, 0);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    return pool.started < n ? pool.started : n;
}

/* Chunks a thread: enough that one descheduled thread's claimed chunk is a small part. */
#define CHUNKS_PER_THREAD 8

static void run(const product *p, int n) {
    if (pool.workers < 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        kernel(p, 0, n);  /* one thread: no pool, or another stream's product holds it */
        return;
    }
    int parts = ensure_workers(pool.workers) + 1;
    int blocks = (n + kernel_ob - 1) / kernel_ob, per = blocks / (parts * CHUNKS_PER_THREAD);
    pool.job = *p;
    pool.n = n;
    pool.chunk = (per > 1 ? per : 1) * kernel_ob;
    pool.chunks = (n + pool.chunk - 1) / pool.chunk;
    atomic_store(&pool.done, 0);
    uint32_t seq = product_seq() + 1;
    atomic_store(&pool.ticket, (uint64_t)seq << 32 | (uint64_t)pool.chunks << 16);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    work(seq, 1);
    while (atomic_load(&pool.done) < pool.chunks) PAUSE();
    pthread_mutex_unlock(&pool.busy);
}

/* A child of fork() has none of the parent's threads: it starts its own when it needs them. */
static void forked(void) {
    pthread_mutex_init(&pool.busy, 0);
    pthread_mutex_init(&pool.lock, 0);
    pthread_cond_init(&pool.wake, 0);
    atomic_store(&pool.ticket, 0);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.sleepers, 0);
    pool.started = 0;
}

/* --------------------------------------------------------------------------- the API */

/* The BLAS to forward to, the threads to use, and which kernel ("" for the best this CPU
 * runs, "256" for AVX2 on a CPU with AVX-512). Returns the kernel's vector width in floats,
 * 0 where there is none (everything is then forwarded). */
int skinny_init(sgemm_fn blas, int threads, const char *isa, long spin_us) {
    static int once;
    if (!once++) pthread_atfork(0, 0, forked);
    fallback = blas;
    kernel = best_kernel(isa);
    pool.workers = threads > MAX_THREADS ? MAX_THREADS - 1 : threads - 1;
    pool.spin_ns = spin_us * 1000L;
#if defined(__x86_64__)
    kernel_ob = kernel == kernel256 ? OB2 : OB;
    if (kernel == kernel512) return 16;
    if (kernel == kernel256) return 8;
#endif
    return 0;
}

void skinny_set_threads(int threads) {
    pool.workers = threads > MAX_THREADS ? MAX_THREADS - 1 : threads - 1;
}

int skinny_threads(void) { return pool.workers + 1; }

/* The most rows it takes, the smallest N * K it runs on the pool, and the most M * N * K
 * it runs on the calling thread when N * K is smaller (0: those go to the BLAS). */
void skinny_set_limits(int rows, long weight, long direct) {
    max_rows = rows;
    min_weight = weight;
    max_direct = direct;
}

/* Calls streamed and calls forwarded so far. */
void skinny_counts(long *fast, long *forwarded) {
    *fast = atomic_load(&fast_calls);
    *forwarded = atomic_load(&forwarded_calls);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    if (kernel && fallback && order == ROW_MAJOR && trans_a == NO_TRANS && alpha == 1.0f && beta == 0.0f &&
        m >= 1 && m <= max_rows && n >= 1 && k >= 1) {
        product p = {a, b, c, lda, ldb, ldc, m, k};
        long weight = (long)n * k;
        int pooled = trans_b == TRANS && weight >= min_weight;
        int direct = (trans_b == TRANS || trans_b == NO_TRANS) && weight < min_weight && m * weight <= max_direct;
        if (pooled || direct) {
            atomic_fetch_add(&fast_calls, 1);
            if (pooled)
                run(&p, n);
#if defined(__x86_64__)
            else if (trans_b == NO_TRANS)
                nn256(&p, n);
#endif
            else
                kernel(&p, 0, n);
            return;
        }
    }
    atomic_fetch_add(&forwarded_calls, 1);
    if (!fallback) fallback = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm"); /* never started */
    fallback(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
