-- One lock order for a trigger firing and a run ending: triggers, then task instances, then
-- runs. A firing trigger (lock_owned_triggers, fire_triggers) locks its trigger rows, then
-- the deadline alert a deadline's timer belongs to (deferral_deadline_fired), then shares its
-- run's key (the callback request's foreign key). A run that ended deleted its deadline
-- alerts before their triggers: with a deadline firing at that moment, each waited for the
-- other. It now locks the triggers first (in id order, as every trigger lock is taken).
--
-- Marks are the user's override, not outcomes: a transaction that marks (or clears) task
-- instances or a run sets deferral.override (engine/store/overrides.py), and neither a task's
-- callbacks nor the DAG's are requested for what it changes, as in Airflow (marking sets the
-- state; no callback runs).
--
-- A DAG callback's request names a task instance for its context (ti): for a failure, the
-- failed task instance that ended last; for a success, the last by task id (Airflow's pick).
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
        PERFORM pg_notify('deferral_tasks', '');
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
        PERFORM pg_notify('deferral_tasks', '');
    END IF;
    RETURN NULL;
END;
$$;
