-- Per-trigger and per-try logs (issue 13). Lines are written in batches by the triggerer and
-- the worker (engine/logsink.py), never a file per trigger. seq orders the lines of a trigger
-- or a try and pages through them (after_seq); it also orders the retention's deletes (the
-- oldest first). Trigger lines outlive their trigger row, which is deleted when it fires.
CREATE TABLE deferral_trigger_logs (
    seq        bigserial PRIMARY KEY,
    trigger_id bigint NOT NULL,
    at         timestamptz NOT NULL,
    level      text NOT NULL,
    logger     text NOT NULL,
    message    text NOT NULL
);
CREATE INDEX deferral_trigger_logs_trigger ON deferral_trigger_logs (trigger_id, seq);

-- stream: 'log' (a logging record), 'stdout' or 'stderr' (what the task printed)
CREATE TABLE deferral_task_logs (
    seq         bigserial PRIMARY KEY,
    dag_id      text NOT NULL,
    run_id      text NOT NULL,
    task_id     text NOT NULL,
    try_number  integer NOT NULL,
    at          timestamptz NOT NULL,
    level       text NOT NULL,
    stream      text NOT NULL CHECK (stream IN ('log', 'stdout', 'stderr')),
    logger      text NOT NULL,
    message     text NOT NULL
);
CREATE INDEX deferral_task_logs_try ON deferral_task_logs (dag_id, run_id, task_id, try_number, seq);

-- Which task tries waited on a trigger that logged: recorded with the trigger's lines, so the
-- page of a try shows its triggers' lines after they fired (the trigger row is gone by then).
CREATE TABLE deferral_trigger_log_tasks (
    dag_id     text NOT NULL,
    run_id     text NOT NULL,
    task_id    text NOT NULL,
    try_number integer NOT NULL,
    trigger_id bigint NOT NULL,
    at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (dag_id, run_id, task_id, try_number, trigger_id)
);
CREATE INDEX deferral_trigger_log_tasks_trigger ON deferral_trigger_log_tasks (trigger_id);
CREATE INDEX deferral_trigger_log_tasks_at ON deferral_trigger_log_tasks (at);
