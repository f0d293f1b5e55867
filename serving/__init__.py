"""specdec.serving."""
