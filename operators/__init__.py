"""Operators: the contract (``operators.base``), sensors and the built-in operators."""
