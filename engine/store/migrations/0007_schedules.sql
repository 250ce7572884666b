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
