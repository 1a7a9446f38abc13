"""The admin plane: runs, keys, episodes, metrics and workers for the admin API and dashboard."""
