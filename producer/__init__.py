"""hsfarm producer: reads the data file and publishes one small, idempotent task per sample."""
