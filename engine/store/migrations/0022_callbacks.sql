-- Callbacks and deadline alerts (issue 20).
--
-- A callback runs on a worker, exactly once per outcome, whoever wrote the outcome (a worker,
-- a triggerer's event or deferral timeout, the scheduler's zombie reaper, a refused claim, a
-- mark): the outcome's own transaction writes a callback request (a row below), by triggers
-- on the task instance and run rows, and workers claim the requests with a lease, run them
-- and delete them. Only the tasks and DAGs that declare callbacks pay for it: a task
-- instance's callbacks column names the kinds its task declares (null: none), and the
-- trigger's WHEN clause tests it before any function is called.

-- What the DAG declares beyond its tasks (null: nothing): {"callbacks": ["success",
-- "failure"], "deadlines": [{"reference": "logical_date" | "queued_at", "interval_s": 60.0}]}
ALTER TABLE deferral_dags ADD COLUMN alerts jsonb;

-- The callback kinds the task declares ('success', 'failure', 'retry', 'skipped'; null: none),
-- copied from the DAG's serialized tasks when the run's task instances are created.
ALTER TABLE deferral_task_instances ADD COLUMN callbacks text[];

-- Callbacks to run: one row per outcome that has one, deleted by the worker that ran it. A
-- worker holds a request it claimed until lease_until (its callback_timeout_s and a margin); a
-- request whose worker died (its row reaped: worker_id set null) or whose lease passed is
-- claimed again by another worker.
CREATE TABLE deferral_callback_requests (
    id           bigserial PRIMARY KEY,
    -- task callbacks: success, failure, retry, skipped; DAG callbacks: dag_success,
    -- dag_failure; a DAG's deadline alert: deadline
    kind         text NOT NULL CHECK (kind IN ('success', 'failure', 'retry', 'skipped',
                                               'dag_success', 'dag_failure', 'deadline')),
    dag_run_id   bigint NOT NULL REFERENCES deferral_dag_runs (id) ON DELETE CASCADE,
    dag_id       text NOT NULL,
    -- the task instance and the try whose outcome it is (null: a run's)
    ti_id        bigint REFERENCES deferral_task_instances (id) ON DELETE CASCADE,
    try_number   integer,
    -- the error of that outcome, as written with it (null: none)
    error        text,
    -- which deadline of the DAG (its index in the DAG's list) and when it was due
    deadline_index integer,
    deadline_at  timestamptz,
    -- the workers of this queue run it (the task's queue; null: any worker)
    queue        text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    worker_id    bigint REFERENCES deferral_workers (id) ON DELETE SET NULL,
    lease_until  timestamptz,
    -- claims so far: a request whose worker dies every time it runs it is given up after a few
    claims       integer NOT NULL DEFAULT 0
);
CREATE INDEX deferral_callback_requests_claimable ON deferral_callback_requests (id)
    WHERE worker_id IS NULL;

-- The deadline alerts of runs not ended yet: each one's timer is a DateTimeTrigger row
-- (trigger_id) run by a triggerer like any other. The trigger's firing (its row deleted by
-- fire_triggers) writes the alert's callback request; a run that ends first deletes these rows
-- and their triggers. A trigger a deadline waits on is not an orphan (the orphan statements
-- look here too).
CREATE TABLE deferral_deadline_alerts (
    trigger_id     bigint PRIMARY KEY,
    dag_run_id     bigint NOT NULL REFERENCES deferral_dag_runs (id) ON DELETE CASCADE,
    dag_id         text NOT NULL,
    deadline_index integer NOT NULL,
    deadline_at    timestamptz NOT NULL
);
CREATE INDEX deferral_deadline_alerts_run ON deferral_deadline_alerts (dag_run_id);

-- A task instance whose task declares callbacks reached an outcome: the request, in the same
-- transaction. Skips by a trigger rule (from pending) are not the task's outcome and have none.
CREATE FUNCTION deferral_task_callback() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    k text := CASE NEW.state WHEN 'success' THEN 'success' WHEN 'failed' THEN 'failure'
                             WHEN 'up_for_retry' THEN 'retry' WHEN 'skipped' THEN 'skipped' END;
BEGIN
    IF k = ANY (NEW.callbacks) THEN
        INSERT INTO deferral_callback_requests (kind, dag_run_id, dag_id, ti_id, try_number,
                                                error, queue)
        VALUES (k, NEW.dag_run_id, NEW.dag_id, NEW.id, NEW.try_number,
                CASE WHEN k IN ('failure', 'retry') THEN NEW.error END, NEW.queue);
        PERFORM pg_notify('deferral_tasks', '');
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER deferral_ti_callback AFTER UPDATE OF state ON deferral_task_instances
    FOR EACH ROW WHEN (NEW.callbacks IS NOT NULL AND NEW.state IS DISTINCT FROM OLD.state
                   AND NEW.state IN ('success', 'failed', 'up_for_retry', 'skipped')
                   AND OLD.state <> 'pending')
    EXECUTE FUNCTION deferral_task_callback();

-- A DateTimeTrigger's kwargs as MessagePack ({"end_from_trigger": false, "moment": ISO
-- 8601 text}, keys sorted as triggers.base.encode_value sorts them).
CREATE FUNCTION deferral_datetime_kwargs(moment timestamptz)
RETURNS bytea LANGUAGE sql IMMUTABLE AS $$
    SELECT '\x82b0'::bytea || convert_to('end_from_trigger', 'UTF8') || '\xc2a6'::bytea
           || convert_to('moment', 'UTF8') || '\xd9'::bytea
           || set_byte('\x00'::bytea, 0, octet_length(s)) || convert_to(s, 'UTF8')
    FROM (SELECT to_char(moment AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"') AS s) m
$$;

-- A run of a DAG with deadline alerts was created: one timer trigger per deadline.
CREATE FUNCTION deferral_run_deadlines() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    d record;
    tid bigint;
BEGIN
    FOR d IN
        SELECT (e.ordinality - 1)::integer AS idx,
               CASE WHEN e.value ->> 'reference' = 'queued_at' THEN NEW.created_at
                    ELSE NEW.logical_date END
               + make_interval(secs => (e.value ->> 'interval_s')::double precision) AS at
        FROM deferral_dags g
        CROSS JOIN LATERAL jsonb_array_elements(g.alerts -> 'deadlines') WITH ORDINALITY e
        WHERE g.dag_id = NEW.dag_id AND g.alerts ? 'deadlines'
    LOOP
        INSERT INTO deferral_triggers (classpath, kwargs, dedup_key)
        VALUES ('triggers.temporal.DateTimeTrigger', deferral_datetime_kwargs(d.at),
                format('deadline:%s:%s', NEW.id, d.idx))
        RETURNING id INTO tid;
        INSERT INTO deferral_deadline_alerts (trigger_id, dag_run_id, dag_id, deadline_index,
                                        deadline_at)
        VALUES (tid, NEW.id, NEW.dag_id, d.idx, d.at);
        PERFORM pg_notify('deferral_triggers', '');
    END LOOP;
    RETURN NULL;
END;
$$;
CREATE TRIGGER deferral_run_deadlines AFTER INSERT ON deferral_dag_runs
    FOR EACH ROW EXECUTE FUNCTION deferral_run_deadlines();

-- A run ended: its deadlines are over (their triggers go), and the DAG's callback of that
-- end, if it declares one, is requested.
CREATE FUNCTION deferral_run_ended() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    k text := CASE NEW.state WHEN 'success' THEN 'dag_success' ELSE 'dag_failure' END;
BEGIN
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
CREATE TRIGGER deferral_run_ended AFTER UPDATE OF state ON deferral_dag_runs
    FOR EACH ROW WHEN (NEW.state IN ('success', 'failed')
                   AND OLD.state NOT IN ('success', 'failed'))
    EXECUTE FUNCTION deferral_run_ended();

-- A deadline's timer fired (its trigger row deleted by fire_triggers while the deadline still
-- waits): the alert's request, in the same transaction.
CREATE FUNCTION deferral_deadline_fired() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    WITH fired AS (
        DELETE FROM deferral_deadline_alerts WHERE trigger_id = OLD.id RETURNING *
    )
    INSERT INTO deferral_callback_requests (kind, dag_run_id, dag_id, deadline_index,
                                            deadline_at)
    SELECT 'deadline', f.dag_run_id, f.dag_id, f.deadline_index, f.deadline_at FROM fired f;
    IF FOUND THEN
        PERFORM pg_notify('deferral_tasks', '');
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER deferral_deadline_fired AFTER DELETE ON deferral_triggers
    FOR EACH ROW WHEN (starts_with(OLD.dedup_key, 'deadline:'))
    EXECUTE FUNCTION deferral_deadline_fired();

-- The task rows carry the task's callbacks (deferral_task_rows gains a column).
DROP FUNCTION deferral_task_rows(jsonb, jsonb);
CREATE FUNCTION deferral_task_rows(tasks jsonb, tries_before jsonb)
RETURNS TABLE (
    task_id text, state text, try_number integer, retries integer,
    retry_delay_s double precision, retry_exponential_backoff boolean,
    max_retry_delay_s double precision, execution_timeout_s double precision, soft_fail boolean,
    trigger_rule text, upstream text[], is_leaf boolean, priority integer, pool text,
    no_retry_on_timeout boolean, pool_slots integer, queue text, trigger_queue text,
    max_active_tis_per_dag integer, callbacks text[]
) LANGUAGE sql STABLE AS $$
    SELECT t.task_id,
           CASE WHEN cardinality(t.upstream) = 0 OR t.trigger_rule = 'always'
                THEN 'scheduled' ELSE 'pending' END,
           COALESCE((tries_before ->> t.task_id)::integer, 0),
           t.retries + COALESCE((tries_before ->> t.task_id)::integer, 0), t.retry_delay_s,
           t.retry_exponential_backoff, t.max_retry_delay_s, t.execution_timeout_s, t.soft_fail,
           t.trigger_rule, t.upstream, t.is_leaf, t.priority, t.pool,
           COALESCE(t.no_retry_on_timeout, false), COALESCE(t.pool_slots, 1),
           COALESCE(t.queue, 'default'), COALESCE(t.trigger_queue, 'default'),
           t.max_active_tis_per_dag, NULLIF(t.callbacks, '{}')
    FROM jsonb_to_recordset(tasks) AS t(
        task_id text, upstream text[], trigger_rule text, retries integer,
        retry_delay_s double precision, retry_exponential_backoff boolean,
        max_retry_delay_s double precision, execution_timeout_s double precision,
        soft_fail boolean, is_leaf boolean, priority integer, pool text,
        no_retry_on_timeout boolean, pool_slots integer, queue text, trigger_queue text,
        max_active_tis_per_dag integer, callbacks text[])
$$;
