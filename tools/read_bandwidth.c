// Memory read bandwidth: T threads each stream a contiguous, disjoint 1/T of one buffer and sum it
// with wide vector loads; the best of several passes, in GB/s (1e9 bytes a second).
//
//     cc -O3 -fopenmp -march=native tools/read_bandwidth.c -o read_bandwidth
//     ./read_bandwidth [MiB (1024)] [passes (7)] [threads ...]    -> "threads T: X.XX GB/s" a line
//
// The buffer is written in parallel before the first pass (every page mapped, first touched by the
// threads of the widest run), and the sums reach stderr, so the compiler cannot drop the loads.
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t vec __attribute__((vector_size(64)));     // 512 bits: one or two loads a step

// sum of the n vecs at p, in 4 independent chains so the loads, not the adds, set the pace
static vec sum_range(const vec *p, size_t n) {
    vec a = {0}, b = {0}, c = {0}, d = {0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
    }
    for (; i < n; i++)
        a += p[i];
    return a + b + c + d;
}

// the best seconds of `passes` passes of `threads` threads over the n vecs at buf; *check gets a sum
static double best_pass(const vec *buf, size_t n, int threads, int passes, uint64_t *check) {
    double best = 1e30;
    for (int pass = 0; pass < passes; pass++) {
        double t0 = 0, t1 = 0;
        uint64_t total = 0;
        #pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            size_t lo = n * t / nt, hi = n * (t + 1) / nt;
            #pragma omp barrier
            #pragma omp master
            t0 = omp_get_wtime();
            vec s = sum_range(buf + lo, hi - lo);
            for (int k = 0; k < (int)(sizeof(vec) / sizeof(uint64_t)); k++)
                total += s[k];
            #pragma omp barrier
            #pragma omp master
            t1 = omp_get_wtime();
        }
        *check += total;
        if (t1 - t0 < best)
            best = t1 - t0;
    }
    return best;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 1024;
    int passes = argc > 2 ? atoi(argv[2]) : 7;
    size_t bytes = mib << 20, n = bytes / sizeof(vec);
    if (n == 0 || passes < 1) {
        fprintf(stderr, "usage: %s [MiB >= 1] [passes >= 1] [threads ...]\n", argv[0]);
        return 2;
    }
    vec *buf = aligned_alloc(sizeof(vec), n * sizeof(vec));
    if (!buf) {
        fprintf(stderr, "cannot allocate %zu MiB\n", mib);
        return 1;
    }
    int most = omp_get_max_threads();
    #pragma omp parallel num_threads(most)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        size_t lo = n * t / nt, hi = n * (t + 1) / nt;
        memset(buf + lo, t + 1, (hi - lo) * sizeof(vec));
    }
    uint64_t check = 0;
    int runs = argc > 3 ? argc - 3 : 1;
    for (int r = 0; r < runs; r++) {
        int threads = argc > 3 ? atoi(argv[3 + r]) : 1;
        if (threads < 1)
            threads = 1;
        best_pass(buf, n, threads, 1, &check);                // warm-up: page tables, clocks
        double s = best_pass(buf, n, threads, passes, &check);
        printf("threads %d: %.2f GB/s\n", threads, bytes / s / 1e9);
    }
    fprintf(stderr, "checksum %llu\n", (unsigned long long)check);
    free(buf);
    return 0;
}
