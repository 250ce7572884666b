"""The engine's version, in a module that imports nothing: every floor may read it.

``deferral --version`` prints it, each process registers with it, ``deferral_build_info`` shows
it; the root package re-exports it.
"""

__version__ = "0.1.0"
