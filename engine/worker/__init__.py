"""The worker process: runs task instances in a fixed number of slots."""
