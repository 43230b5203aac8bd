"""Matrix products whose every row has the bits it has alone, so a prompt position's K/V do not
depend on how the prompt was cut into calls (NOTE(exact-prefix))."""

# NOTE(exact-prefix): BLAS picks other kernels for products of few rows; from 32 rows up (measured on
# OpenBLAS 0.3.31 for every product shape of SmolLM2's forward pass) each row of the result has the
# same bits whatever rows stand beside it. Exact prefill products are padded to this many rows.
ROW_FLOOR = 32


def rows_matmul(x, w, xp):
    """x `[..., m, k]` @ w `[..., k, n]` (w may be a quantized QLinear), computed so that each row's
    result does not depend on the rows beside it: a QLinear computes every row on its own (its
    `matmul_rows`); for BLAS, fewer than ROW_FLOOR rows are padded with zeros. Used by prefill."""
    if hasattr(w, "matmul_rows"):
        return w.matmul_rows(x)
    m = x.shape[-2]
    if m < ROW_FLOOR:
        pad = xp.zeros(x.shape[:-2] + (ROW_FLOOR - m, x.shape[-1]), dtype=x.dtype)
        x = xp.concatenate([x, pad], axis=-2)
    return (x @ w)[..., :m, :]


def plain_matmul(x, w, xp):
    return x @ w
