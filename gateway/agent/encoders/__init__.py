"""Each API family's wire format, encoded from the sampling core's typed events."""
