-- Named queries of triggers.external_task: read the engine's own tables (read only).

-- name: external_state
-- The newest run of DAG $1 at logical date $2, with the state of its task $3 (null task_id:
-- the run's own state). No row: no such run.
SELECT r.run_id, r.state AS run_state, ti.state AS task_state, (ti.id IS NOT NULL) AS has_task
FROM deferral_dag_runs r
LEFT JOIN deferral_task_instances ti ON ti.dag_run_id = r.id AND ti.task_id = $3
WHERE r.dag_id = $1 AND r.logical_date = $2
ORDER BY r.id DESC
LIMIT 1;

-- name: nearest_runs
-- The logical dates of DAG $1's runs nearest to $2, to explain a date that does not line up.
SELECT logical_date
FROM deferral_dag_runs
WHERE dag_id = $1
ORDER BY abs(EXTRACT(EPOCH FROM logical_date - $2)), id DESC
LIMIT 3;
