-- Logs of reprocessed runs (issue 24): a backfill that runs an ended run again makes new tries,
-- numbered on from the old ones, so each try's log lines stay its own.

-- The try numbers a run's task instances had reached when a backfill reprocessed it
-- ({task_id: try_number}); start_queued_runs numbers the new task instances' tries on from
-- them. Null for a run never reprocessed.
ALTER TABLE deferral_dag_runs ADD COLUMN tries_before jsonb;
