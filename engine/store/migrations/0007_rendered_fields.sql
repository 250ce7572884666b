-- What a task's templated fields rendered to at the start of its latest try (field name →
-- rendered value, as JSON), so a user can see what ran (`deferral tasks list --json`, key
-- `rendered`). Null when nothing was rendered: the task has no template in its fields.
ALTER TABLE deferral_task_instances ADD COLUMN rendered_fields jsonb;

-- The latest successful run of a DAG before a date (template variable
-- prev_data_interval_start_success), found without reading the DAG's other runs.
CREATE INDEX deferral_dag_runs_success ON deferral_dag_runs (dag_id, logical_date)
    WHERE state = 'success';
