"""Triggers: the contract (``triggers.base``) and the built-in triggers, by domain."""
