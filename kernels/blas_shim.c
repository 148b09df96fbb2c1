/* Export the unprefixed CBLAS GEMMs that libmlx.so imports, forwarding to
 * scipy-openblas32's prefixed ones. The scipy_* symbols are resolved when this
 * shim is loaded, from the OpenBLAS that kernels/blas.py loaded RTLD_GLOBAL first. */
typedef int blasint;

#define FORWARD_GEMM(name, T)                                                                  \
  extern void scipy_##name(int, int, int, blasint, blasint, blasint, T, const T *, blasint,   \
                           const T *, blasint, T, T *, blasint);                               \
  void name(int order, int ta, int tb, blasint m, blasint n, blasint k, T alpha, const T *a,   \
            blasint lda, const T *b, blasint ldb, T beta, T *c, blasint ldc) {                 \
    scipy_##name(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);                 \
  }

FORWARD_GEMM(cblas_sgemm, float)
FORWARD_GEMM(cblas_dgemm, double)

/* Complex GEMM takes alpha/beta by pointer. */
extern void scipy_cblas_cgemm(int, int, int, blasint, blasint, blasint, const void *, const void *,
                              blasint, const void *, blasint, const void *, void *, blasint);
void cblas_cgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, const void *alpha,
                 const void *a, blasint lda, const void *b, blasint ldb, const void *beta, void *c,
                 blasint ldc) {
  scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
