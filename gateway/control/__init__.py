"""The control plane: when runs train, hot swaps, the scheduler's leader, admission, backends."""
