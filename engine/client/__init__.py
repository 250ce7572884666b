"""Asking the engine from outside: trigger a run and wait for it, why a task waits."""
