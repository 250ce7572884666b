-- Named queries of triggers.external_task. They read the engine's state through the view
-- deferral_run_states only (engine/store/migrations/0004_run_states_view.sql, documented in
-- docs/reference/triggers-and-sensors.md), never its tables: read only, and stable while the
-- tables change (tests/test_run_states_view.py checks both).

-- name: external_state
-- The newest run of DAG $1 at logical date $2, with the state of its task $3 (null task_id:
-- the run's own state). No row: no such run.
SELECT run_id, state AS run_state, task_states ->> $3::text AS task_state,
       COALESCE(task_states ? $3::text, false) AS has_task
FROM deferral_run_states
WHERE dag_id = $1 AND logical_date = $2
ORDER BY run_seq DESC
LIMIT 1;

-- name: nearest_runs
-- The logical dates of DAG $1's runs nearest to $2, to explain a date that does not line up.
SELECT logical_date
FROM deferral_run_states
WHERE dag_id = $1
ORDER BY abs(EXTRACT(EPOCH FROM logical_date - $2)), run_seq DESC
LIMIT 3;

-- name: run_state
-- Run $2 of DAG $1, with the state of its task $3 (null task_id: the run's own state). No
-- row: no such run.
SELECT run_id, state AS run_state, task_states ->> $3::text AS task_state,
       COALESCE(task_states ? $3::text, false) AS has_task
FROM deferral_run_states
WHERE dag_id = $1 AND run_id = $2;
