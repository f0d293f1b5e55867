"""specdec.kernels."""
