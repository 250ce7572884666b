"""DAGs: the model, DAG files loaded from a folder, schedules as data intervals."""
