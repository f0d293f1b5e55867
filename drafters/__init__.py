"""specdec.drafters."""
