-- Schedules (issue 11): DAGs carry their schedule and the next run it asks for; runs carry
-- their type and data interval, may wait as 'queued' behind max_active_runs, and an interval
-- gets at most one scheduled or backfill run, whatever number of schedulers run.

ALTER TABLE deferral_dags
    -- engine.timetables: {"kind": "none"|"once"|"cron"|"delta", ...}
    ADD COLUMN timetable jsonb NOT NULL DEFAULT '{"kind": "none"}'::jsonb,
    -- the schedule as written (cron, preset or timedelta), for display; null: none
    ADD COLUMN schedule text,
    ADD COLUMN start_date timestamptz,
    ADD COLUMN end_date timestamptz,
    ADD COLUMN catchup boolean NOT NULL DEFAULT false,
    ADD COLUMN max_active_runs integer NOT NULL DEFAULT 16 CHECK (max_active_runs >= 1),
    ADD COLUMN is_paused boolean NOT NULL DEFAULT false,
    ADD COLUMN params jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN tags text[] NOT NULL DEFAULT '{}',
    -- the next scheduled run: its logical date and interval, and when it may be created
    -- (null: none, e.g. no schedule or past end_date). Set whenever the scheduler creates
    -- runs of the DAG or its schedule changes.
    ADD COLUMN next_dagrun timestamptz,
    ADD COLUMN next_dagrun_data_interval_start timestamptz,
    ADD COLUMN next_dagrun_data_interval_end timestamptz,
    ADD COLUMN next_dagrun_create_after timestamptz;
-- The scheduler's one look for due DAGs.
CREATE INDEX deferral_dags_due ON deferral_dags (next_dagrun_create_after)
    WHERE NOT is_paused AND next_dagrun_create_after IS NOT NULL;

ALTER TABLE deferral_dag_runs
    DROP CONSTRAINT deferral_dag_runs_state_check,
    ADD CONSTRAINT deferral_dag_runs_state_check
        CHECK (state IN ('queued', 'running', 'success', 'failed')),
    ADD COLUMN run_type text NOT NULL DEFAULT 'manual'
        CHECK (run_type IN ('scheduled', 'manual', 'backfill')),
    ADD COLUMN data_interval_start timestamptz,
    ADD COLUMN data_interval_end timestamptz,
    -- when the run left 'queued' (its tasks were created then)
    ADD COLUMN started_at timestamptz;
UPDATE deferral_dag_runs
SET data_interval_start = logical_date, data_interval_end = logical_date, started_at = created_at;
-- One scheduled or backfill run per interval, whatever number of schedulers or backfills.
CREATE UNIQUE INDEX deferral_dag_runs_interval ON deferral_dag_runs (dag_id, logical_date)
    WHERE run_type IN ('scheduled', 'backfill');
-- Runs not ended yet, per DAG, oldest first (admission behind max_active_runs).
CREATE INDEX deferral_dag_runs_active ON deferral_dag_runs (dag_id, logical_date)
    WHERE state IN ('queued', 'running');

-- The view for readers outside the engine gains the run's type and data interval (appended:
-- its other columns keep their order).
CREATE OR REPLACE VIEW deferral_run_states AS
SELECT r.id AS run_seq, r.dag_id, r.run_id, r.logical_date, r.state, r.created_at, r.ended_at,
       (SELECT COALESCE(jsonb_object_agg(ti.task_id, ti.state), '{}'::jsonb)
        FROM deferral_task_instances ti
        WHERE ti.dag_run_id = r.id) AS task_states,
       r.run_type, r.data_interval_start, r.data_interval_end
FROM deferral_dag_runs r;
COMMENT ON VIEW deferral_run_states IS
    'One row per DAG run: run_seq (newer runs are higher), dag_id, run_id, logical_date, state, created_at, ended_at, task_states ({task_id: state}), run_type, data_interval_start, data_interval_end. Read only; the interface for readers outside the engine.';
