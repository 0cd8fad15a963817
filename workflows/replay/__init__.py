"""The domain-shift replay: one workload served under five modes, with reports and plots (docs/replay.md)."""
