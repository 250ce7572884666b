-- The status page's views (issue 23): each try of a task instance kept once the next one
-- starts, the times of a try's spans (queued, running, deferred) for the Gantt view, and the
-- runs read newest first by logical date, a DAG's or all of them.

-- When the current try became due (its run_after when a worker claimed it: the queued span's
-- start), when it last deferred, and when its trigger last fired (the resume's run_after,
-- copied by the claim that resumes it). Set by claim_tasks and defer_task, in the statements
-- that make those moves: no statement of its own.
ALTER TABLE deferral_task_instances
    ADD COLUMN try_queued_at timestamptz,
    ADD COLUMN deferred_at   timestamptz,
    ADD COLUMN fired_at      timestamptz;

-- The tries of task instances that were followed by another try (a retry, a clear) or whose
-- task instance went (a backfill reprocessed its run): the try as it stood then, its state
-- the one it ended in (up_for_retry for a failed try that was retried). The current try of
-- a task instance is its row in deferral_task_instances. Keyed by names, as the logs are:
-- a reprocessed run's new task instances number their tries on from the old ones.
CREATE TABLE deferral_task_tries (
    dag_id          text NOT NULL,
    run_id          text NOT NULL,
    task_id         text NOT NULL,
    try_number      integer NOT NULL,
    state           text NOT NULL,
    queued_at       timestamptz,
    started_at      timestamptz,
    -- its latest claim (a resume or a reschedule continues a try), its latest deferral and
    -- when that deferral's trigger fired
    resumed_at      timestamptz,
    deferred_at     timestamptz,
    fired_at        timestamptz,
    ended_at        timestamptz,
    error           text,
    rendered_fields jsonb,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (dag_id, run_id, task_id, try_number)
);

-- A try is archived when the next one starts: the claim that counts try_number up. By a
-- trigger, not in claim_tasks: that statement's snapshot predates the admission's lock, so the
-- row it would read may be older than the try being ended (a try that failed and was retried
-- while the claim waited), where a trigger sees the row as it was updated. Only a claim sets
-- try_number, and only a new try raises it: the trigger fires for nothing else. A cleared try
-- was archived by clear_tasks before it was reset (a clear empties first_try_at, which a
-- claim sets again): the cleared row holds nothing of that try any more, and is not kept.
CREATE FUNCTION deferral_archive_try() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferral_task_tries (dag_id, run_id, task_id, try_number, state, queued_at,
                                     started_at, resumed_at, deferred_at, fired_at, ended_at,
                                     error, rendered_fields)
    VALUES (OLD.dag_id, OLD.run_id, OLD.task_id, OLD.try_number, OLD.state, OLD.try_queued_at,
            OLD.try_started_at, OLD.started_at, OLD.deferred_at, OLD.fired_at, OLD.ended_at,
            OLD.error, OLD.rendered_fields)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END;
$$;
CREATE TRIGGER deferral_ti_new_try AFTER UPDATE OF try_number ON deferral_task_instances
    FOR EACH ROW WHEN (NEW.try_number > OLD.try_number AND OLD.try_number > 0
                   AND OLD.first_try_at IS NOT NULL)
    EXECUTE FUNCTION deferral_archive_try();

-- The runs newest first (logical date, then id): a DAG's for its grid, and all of them.
CREATE INDEX deferral_dag_runs_dag_date ON deferral_dag_runs (dag_id, logical_date, id);
CREATE INDEX deferral_dag_runs_date ON deferral_dag_runs (logical_date, id);
