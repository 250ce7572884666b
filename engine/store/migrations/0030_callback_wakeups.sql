-- A callback request wakes the workers' callback runners alone: its notification on
-- deferral_tasks says 'callbacks' (the payload was empty, as for a task that became runnable,
-- so every notification of the busiest channel sent each worker's callback runner to the
-- database for requests that were almost never there). Nothing else changes in these
-- functions; the runners still poll as a backstop.

CREATE OR REPLACE FUNCTION deferral_task_callback() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    k text := CASE NEW.state WHEN 'success' THEN 'success' WHEN 'failed' THEN 'failure'
                             WHEN 'up_for_retry' THEN 'retry' WHEN 'skipped' THEN 'skipped' END;
BEGIN
    -- (a mark is the user's override, not the task's outcome: no callback, as in Airflow)
    IF k = ANY (NEW.callbacks)
       AND current_setting('deferral.override', true) IS DISTINCT FROM 'on' THEN
        INSERT INTO deferral_callback_requests (kind, dag_run_id, dag_id, ti_id, try_number,
                                                error, queue)
        VALUES (k, NEW.dag_run_id, NEW.dag_id, NEW.id, NEW.try_number,
                CASE WHEN k IN ('failure', 'retry') THEN NEW.error END, NEW.queue);
        PERFORM pg_notify('deferral_tasks', 'callbacks');
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION deferral_run_ended() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    k text := CASE NEW.state WHEN 'success' THEN 'dag_success' ELSE 'dag_failure' END;
    named record;
BEGIN
    PERFORM 1 FROM deferral_triggers t
    WHERE t.id IN (SELECT dl.trigger_id FROM deferral_deadline_alerts dl
                   WHERE dl.dag_run_id = NEW.id)
    ORDER BY t.id
    FOR UPDATE OF t;
    WITH gone AS (
        DELETE FROM deferral_deadline_alerts WHERE dag_run_id = NEW.id RETURNING trigger_id
    )
    DELETE FROM deferral_triggers t USING gone WHERE t.id = gone.trigger_id;
    IF current_setting('deferral.override', true) IS DISTINCT FROM 'on'
       AND EXISTS (SELECT 1 FROM deferral_dags g WHERE g.dag_id = NEW.dag_id
                   AND g.alerts -> 'callbacks' ? substr(k, 5)) THEN
        SELECT ti.id, ti.try_number INTO named FROM deferral_task_instances ti
        WHERE ti.dag_run_id = NEW.id
        ORDER BY CASE WHEN k = 'dag_failure' THEN ti.state = 'failed' END DESC NULLS LAST,
                 CASE WHEN k = 'dag_failure' THEN ti.ended_at END DESC NULLS LAST,
                 ti.task_id DESC, ti.map_index DESC
        LIMIT 1;
        INSERT INTO deferral_callback_requests (kind, dag_run_id, dag_id, ti_id, try_number)
        VALUES (k, NEW.id, NEW.dag_id, named.id, named.try_number);
        PERFORM pg_notify('deferral_tasks', 'callbacks');
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION deferral_deadline_fired() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    WITH fired AS (
        DELETE FROM deferral_deadline_alerts WHERE trigger_id = OLD.id RETURNING *
    )
    INSERT INTO deferral_callback_requests (kind, dag_run_id, dag_id, deadline_index,
                                            deadline_at)
    SELECT 'deadline', f.dag_run_id, f.dag_id, f.deadline_index, f.deadline_at FROM fired f;
    IF FOUND THEN
        PERFORM pg_notify('deferral_tasks', 'callbacks');
    END IF;
    RETURN NULL;
END;
$$;
