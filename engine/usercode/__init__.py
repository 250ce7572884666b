"""User code in the engine's processes: its errors, tracebacks and captured logs."""
