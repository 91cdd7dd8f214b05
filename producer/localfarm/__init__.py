"""A whole farm on one machine as real processes, for the demo, the tests and the benches."""
