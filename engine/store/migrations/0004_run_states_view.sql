-- A read-only view of the runs and the states of their tasks: the documented interface for
-- code outside the engine that reads its tables (triggers.external_task, dashboards), so the
-- tables underneath can change without breaking it. One row per DAG run; columns are listed
-- in docs/reference/triggers-and-sensors.md. task_states is computed only when selected.
CREATE VIEW deferral_run_states AS
SELECT r.id AS run_seq, r.dag_id, r.run_id, r.logical_date, r.state, r.created_at, r.ended_at,
       (SELECT COALESCE(jsonb_object_agg(ti.task_id, ti.state), '{}'::jsonb)
        FROM deferral_task_instances ti
        WHERE ti.dag_run_id = r.id) AS task_states
FROM deferral_dag_runs r;
COMMENT ON VIEW deferral_run_states IS
    'One row per DAG run: run_seq (newer runs are higher), dag_id, run_id, logical_date, state, created_at, ended_at, task_states ({task_id: state}). Read only; the interface for readers outside the engine.';
