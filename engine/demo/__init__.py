"""The bundled demo: several hundred deferrable sensors on a few worker slots."""
