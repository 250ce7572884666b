"""Starting the engine's processes from settings, one or all three (standalone)."""
