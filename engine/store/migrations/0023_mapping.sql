-- Dynamic task mapping (expand): a mapped task's instances share its task id and differ by
-- map_index, 0..n-1; an unmapped task instance (and a mapped task before its expansion) has
-- -1. A mapped instance's tries and log lines are kept under its name, TASK[3]
-- (deferral_ti_name), the way the CLI and the status page address it.
ALTER TABLE deferral_task_instances ADD COLUMN map_index integer NOT NULL DEFAULT -1
    CHECK (map_index >= -1);
-- A mapped instance's own arguments, as the expansion read them (encoded, encrypted as
-- results are): its claims return them, so an instance does not read its task's upstream
-- values again.
ALTER TABLE deferral_task_instances ADD COLUMN map_value bytea;
ALTER TABLE deferral_task_instances
    DROP CONSTRAINT deferral_task_instances_dag_run_id_task_id_key,
    ADD CONSTRAINT deferral_task_instances_dag_run_id_task_id_map_index_key
        UNIQUE (dag_run_id, task_id, map_index);

-- The name of a task instance where rows are keyed by names (tries, log lines): its task id,
-- or TASK[i] for mapped instance i.
CREATE FUNCTION deferral_ti_name(task_id text, map_index integer) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN map_index < 0 THEN task_id ELSE task_id || '[' || map_index || ']' END
$$;

CREATE OR REPLACE FUNCTION deferral_archive_try() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferral_task_tries (dag_id, run_id, task_id, try_number, state, queued_at,
                                     started_at, resumed_at, deferred_at, fired_at, ended_at,
                                     error, rendered_fields)
    VALUES (OLD.dag_id, OLD.run_id, deferral_ti_name(OLD.task_id, OLD.map_index),
            OLD.try_number, OLD.state, OLD.try_queued_at, OLD.try_started_at, OLD.started_at,
            OLD.deferred_at, OLD.fired_at, OLD.ended_at, OLD.error, OLD.rendered_fields)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END;
$$;
