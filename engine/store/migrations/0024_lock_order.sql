-- One lock order for a trigger firing and a run ending: triggers, then task instances, then
-- runs. A firing trigger (lock_owned_triggers, fire_triggers) locks its trigger rows, then
-- the deadline alert a deadline's timer belongs to (deferral_deadline_fired), then shares its
-- run's key (the callback request's foreign key). A run that ended deleted its deadline
-- alerts before their triggers: with a deadline firing at that moment, each waited for the
-- other. It now locks the triggers first (in id order, as every trigger lock is taken).
CREATE OR REPLACE FUNCTION deferral_run_ended() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    k text := CASE NEW.state WHEN 'success' THEN 'dag_success' ELSE 'dag_failure' END;
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
    IF EXISTS (SELECT 1 FROM deferral_dags g WHERE g.dag_id = NEW.dag_id
               AND g.alerts -> 'callbacks' ? substr(k, 5)) THEN
        INSERT INTO deferral_callback_requests (kind, dag_run_id, dag_id)
        VALUES (k, NEW.id, NEW.dag_id);
        PERFORM pg_notify('deferral_tasks', '');
    END IF;
    RETURN NULL;
END;
$$;
