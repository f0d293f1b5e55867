"""specdec.eval."""
