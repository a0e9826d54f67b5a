/* The CBLAS products MLX's CPU backend calls (cblas_sgemm, cblas_dgemm, cblas_cgemm),
 * forwarded to the OpenBLAS that numpy's Linux wheel bundles. That library names its
 * functions with a prefix and a 64-bit-integer suffix (scipy_cblas_sgemm64_), so it cannot
 * stand in for MLX's bundled reference BLAS by itself; preloaded, this file's three
 * functions do (transport/blas.py builds it: the daemon's `blas = numpy`). */
#include <stdint.h>

typedef int64_t i64;

extern void scipy_cblas_sgemm64_(int, int, int, i64, i64, i64, float, const float *, i64,
                                 const float *, i64, float, float *, i64);
extern void scipy_cblas_dgemm64_(int, int, int, i64, i64, i64, double, const double *, i64,
                                 const double *, i64, double, double *, i64);
extern void scipy_cblas_cgemm64_(int, int, int, i64, i64, i64, const void *, const void *, i64,
                                 const void *, i64, const void *, void *, i64);

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    scipy_cblas_sgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a,
                 int lda, const double *b, int ldb, double beta, double *c, int ldc) {
    scipy_cblas_dgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb, const void *beta, void *c,
                 int ldc) {
    scipy_cblas_cgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
