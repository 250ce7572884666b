-- deferral schema: the result of applying every migration in migrations/ in order.

-- The outcome kinds (engine/states.py TaskOutcomeKind, TriggerOutcomeKind): finish_tasks and
-- fire_triggers cast the kinds they receive to these, so an unknown kind is refused.
CREATE DOMAIN deferral_task_outcome AS text
    CHECK (VALUE IN ('success', 'skipped', 'failed'));
CREATE DOMAIN deferral_trigger_outcome AS text
    CHECK (VALUE IN ('event', 'success', 'skipped', 'failed'));

CREATE TABLE deferral_dags (
    dag_id      text PRIMARY KEY,
    fileloc     text NOT NULL,
    -- One object a task: task_id, upstream, trigger_rule, retries, ... (engine.dags.dag.DAG.serialize_tasks)
    tasks       jsonb NOT NULL,
    description text,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    -- The schedule (added by migration 0009). engine.dags.timetables: {"kind": "none"|"once"|
    -- "cron"|"delta", ...}; schedule: as written, for display (null: none).
    timetable   jsonb NOT NULL DEFAULT '{"kind": "none"}'::jsonb,
    schedule    text,
    start_date  timestamptz,
    end_date    timestamptz,
    catchup     boolean NOT NULL DEFAULT false,
    max_active_runs integer NOT NULL DEFAULT 16 CHECK (max_active_runs >= 1),
    is_paused   boolean NOT NULL DEFAULT false,
    params      jsonb NOT NULL DEFAULT '{}'::jsonb,
    tags        text[] NOT NULL DEFAULT '{}',
    -- the next scheduled run: its logical date and interval, and when it may be created
    -- (null: none). Set whenever the scheduler creates runs of the DAG or its schedule changes.
    next_dagrun timestamptz,
    next_dagrun_data_interval_start timestamptz,
    next_dagrun_data_interval_end timestamptz,
    next_dagrun_create_after timestamptz,
    -- false once a scan of its DAGs folder no longer finds it (no more scheduled runs; added
    -- by migration 0011)
    is_active   boolean NOT NULL DEFAULT true,
    -- running tasks of the DAG at once (null: no limit; added by 0012)
    max_active_tasks integer CHECK (max_active_tasks >= 1),
    -- a hash of what the columns above record of the DAG's file (engine.scheduler.dagrecord; null: none
    -- computed; added by 0013): a rescan writes only the DAGs whose hash differs
    fingerprint text
);
-- The scheduler's one look for due DAGs.
CREATE INDEX deferral_dags_due ON deferral_dags (next_dagrun_create_after)
    WHERE NOT is_paused AND next_dagrun_create_after IS NOT NULL;

CREATE TABLE deferral_dag_runs (
    id           bigserial PRIMARY KEY,
    dag_id       text NOT NULL,
    run_id       text NOT NULL,
    logical_date timestamptz NOT NULL,
    conf         jsonb NOT NULL DEFAULT '{}'::jsonb,
    state        text NOT NULL DEFAULT 'running'
                 CHECK (state IN ('queued', 'running', 'success', 'failed')),
    created_at   timestamptz NOT NULL DEFAULT now(),
    ended_at     timestamptz,
    -- added by migration 0009: how the run came to be, its data interval, and when it left
    -- 'queued' (its task instances were created then)
    run_type     text NOT NULL DEFAULT 'manual'
                 CHECK (run_type IN ('scheduled', 'manual', 'backfill', 'asset_triggered')),
    data_interval_start timestamptz,
    data_interval_end   timestamptz,
    started_at   timestamptz,
    -- added by 0013: the try numbers its task instances had reached when a backfill reprocessed
    -- it ({task_id: try_number}); the new task instances number their tries on from them, so
    -- each try's log lines stay its own. Null for a run never reprocessed.
    tries_before jsonb,
    UNIQUE (dag_id, run_id)
);
-- the latest successful run before a date (prev_data_interval_start_success); added by 0007
CREATE INDEX deferral_dag_runs_success ON deferral_dag_runs (dag_id, logical_date)
    WHERE state = 'success';
-- One scheduled or backfill run per interval, whatever number of schedulers or backfills.
CREATE UNIQUE INDEX deferral_dag_runs_interval ON deferral_dag_runs (dag_id, logical_date)
    WHERE run_type IN ('scheduled', 'backfill');
-- Runs not ended yet, per DAG, oldest first (admission behind max_active_runs).
CREATE INDEX deferral_dag_runs_active ON deferral_dag_runs (dag_id, logical_date)
    WHERE state IN ('queued', 'running');
-- The runs newest first (logical date, then id): a DAG's for its grid, and all of them (the
-- status page; added by 0016).
CREATE INDEX deferral_dag_runs_dag_date ON deferral_dag_runs (dag_id, logical_date, id);
CREATE INDEX deferral_dag_runs_date ON deferral_dag_runs (logical_date, id);

CREATE TABLE deferral_workers (
    id           bigserial PRIMARY KEY,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    slots        integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    -- the engine's version (added by 0008)
    version      text,
    -- the queues whose tasks it claims (added by 0012)
    queues       text[] NOT NULL DEFAULT '{default}'
);

CREATE TABLE deferral_triggerers (
    id               bigserial PRIMARY KEY,
    hostname         text NOT NULL,
    pid              integer NOT NULL,
    capacity         integer NOT NULL,
    started_at       timestamptz NOT NULL DEFAULT now(),
    heartbeat_at     timestamptz NOT NULL DEFAULT now(),
    lease_expires_at timestamptz NOT NULL,
    -- holds the session advisory lock (74657202, id): reaped as soon as nobody holds it
    session_locked   boolean NOT NULL DEFAULT false,
    -- added by 0008, written with the lease renewal: the engine's version, the p99 of the
    -- loop's lag over its recent watchdog ticks, the blocks seen and the longest one's trigger
    version          text,
    loop_lag_p99_ms  double precision,
    blocked_loops    integer NOT NULL DEFAULT 0,
    worst_blocker    text,
    worst_block_ms   double precision,
    -- the trigger queues whose triggers it claims (added by 0012)
    queues           text[] NOT NULL DEFAULT '{default}'
);

-- The running schedulers (added by 0008): a row each, kept by its housekeeping pass.
CREATE TABLE deferral_schedulers (
    id           bigserial PRIMARY KEY,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    version      text,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

-- One row per action taken from the status page (added by 0008).
CREATE TABLE deferral_audit (
    id      bigserial PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    who     text NOT NULL,
    action  text NOT NULL,
    target  text NOT NULL,
    detail  jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX deferral_audit_at ON deferral_audit (at);

CREATE TABLE deferral_triggers (
    id           bigserial PRIMARY KEY,
    classpath    text NOT NULL,
    kwargs       bytea NOT NULL,
    -- sha256 of classpath and encoded kwargs: identical triggers share one row and one coroutine
    dedup_key    text NOT NULL UNIQUE,
    triggerer_id bigint,
    -- fencing token, raised at every claim: a triggerer writes an event only with the token it claimed
    fence        bigint NOT NULL DEFAULT 0,
    -- earliest deferral deadline among the tasks waiting on this trigger
    timeout_at   timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- the trigger queue whose triggerers run it (added by 0012)
    queue        text NOT NULL DEFAULT 'default'
);
CREATE INDEX deferral_triggers_unowned ON deferral_triggers (id) WHERE triggerer_id IS NULL;
CREATE INDEX deferral_triggers_owner ON deferral_triggers (triggerer_id) WHERE triggerer_id IS NOT NULL;

CREATE TABLE deferral_task_instances (
    id                        bigserial PRIMARY KEY,
    dag_run_id                bigint NOT NULL REFERENCES deferral_dag_runs (id) ON DELETE CASCADE,
    dag_id                    text NOT NULL,
    run_id                    text NOT NULL,
    task_id                   text NOT NULL,
    state                     text NOT NULL CHECK (state IN (
                                  'pending', 'scheduled', 'queued', 'running', 'deferred',
                                  'up_for_reschedule', 'up_for_retry', 'success', 'failed',
                                  'skipped', 'upstream_failed')),
    try_number                integer NOT NULL DEFAULT 0,
    retries                   integer NOT NULL DEFAULT 0,
    retry_delay_s             double precision NOT NULL DEFAULT 300,
    retry_exponential_backoff boolean NOT NULL DEFAULT false,
    max_retry_delay_s         double precision,
    execution_timeout_s       double precision,
    soft_fail                 boolean NOT NULL DEFAULT false,
    trigger_rule              text NOT NULL DEFAULT 'all_success',
    upstream                  text[] NOT NULL DEFAULT '{}',
    is_leaf                   boolean NOT NULL DEFAULT true,
    priority                  integer NOT NULL DEFAULT 1,
    pool                      text NOT NULL DEFAULT 'default_pool',
    run_after                 timestamptz NOT NULL DEFAULT now(),
    worker_id                 bigint,
    heartbeat_at              timestamptz,
    first_try_at              timestamptz,
    try_started_at            timestamptz,
    started_at                timestamptz,
    ended_at                  timestamptz,
    trigger_id                bigint,
    trigger_timeout_at        timestamptz,
    next_method               text,
    next_kwargs               bytea,
    next_event                bytea,
    result                    bytea,
    error                     text,
    -- a deferral timeout fails the task without retries (sensors); added by migration 0002
    no_retry_on_timeout       boolean NOT NULL DEFAULT false,
    -- which deadline trigger_timeout_at is (engine/states.py DeadlineKind); added by 0005
    deadline_kind             text
                              CHECK (deadline_kind IN (
                                  'trigger_timeout', 'execution_timeout', 'sensor_timeout')),
    -- the error of the try before the current one (a new try clears error); added by 0006
    previous_error            text,
    -- what the templated fields rendered to at the start of the latest try (field → value);
    -- null when nothing was rendered; added by 0007
    rendered_fields           jsonb,
    -- admission (added by 0012): slots of the pool held, the queue of its workers, the
    -- running tries of this task across runs at once, the queue of its triggers
    pool_slots                integer NOT NULL DEFAULT 1 CHECK (pool_slots >= 1),
    queue                     text NOT NULL DEFAULT 'default',
    max_active_tis_per_dag    integer CHECK (max_active_tis_per_dag >= 1),
    trigger_queue             text NOT NULL DEFAULT 'default',
    -- the spans of the current try (added by 0016, for the status page's Gantt view): when it
    -- became due (its run_after when claimed), when it last deferred, when its trigger last
    -- fired (the resume's run_after, copied by the claim that resumes it)
    try_queued_at             timestamptz,
    deferred_at               timestamptz,
    fired_at                  timestamptz,
    -- the callback kinds the task declares ('success', 'failure', 'retry', 'skipped'; null:
    -- none), copied from the DAG's serialized tasks when the run's task instances are
    -- created; added by 0022
    callbacks                 text[],
    -- a mapped task's instance number, 0..n-1; -1: not mapped (or not yet expanded); added by
    -- 0023. A mapped instance's tries and log lines are kept under its name (deferral_ti_name).
    map_index                 integer NOT NULL DEFAULT -1 CHECK (map_index >= -1),
    -- a mapped instance's own arguments as its expansion read them (encoded, encrypted):
    -- returned by its claims; added by 0023
    map_value                 bytea,
    UNIQUE (dag_run_id, task_id, map_index)
);
CREATE INDEX deferral_ti_runnable ON deferral_task_instances (priority DESC, run_after, id)
    WHERE state IN ('scheduled', 'up_for_retry', 'up_for_reschedule');
CREATE INDEX deferral_ti_trigger ON deferral_task_instances (trigger_id) WHERE state = 'deferred';
CREATE INDEX deferral_ti_deferral_deadline ON deferral_task_instances (trigger_timeout_at)
    WHERE state = 'deferred' AND trigger_timeout_at IS NOT NULL;
CREATE INDEX deferral_ti_running ON deferral_task_instances (worker_id) WHERE state = 'running';
CREATE INDEX deferral_ti_pending ON deferral_task_instances (dag_run_id) WHERE state = 'pending';
CREATE INDEX deferral_ti_run_state ON deferral_task_instances (dag_run_id, state);

-- Added by 0016.
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
-- The name of a task instance where rows are keyed by names (tries, log lines): its task id,
-- or TASK[i] for mapped instance i (added by 0023).
CREATE FUNCTION deferral_ti_name(task_id text, map_index integer) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN map_index < 0 THEN task_id ELSE task_id || '[' || map_index::text || ']' END
$$;

CREATE FUNCTION deferral_archive_try() RETURNS trigger LANGUAGE plpgsql AS $$
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
CREATE TRIGGER deferral_ti_new_try AFTER UPDATE OF try_number ON deferral_task_instances
    FOR EACH ROW WHEN (NEW.try_number > OLD.try_number AND OLD.try_number > 0
                   AND OLD.first_try_at IS NOT NULL)
    EXECUTE FUNCTION deferral_archive_try();

-- When a failed try may run again, and when: the retry policy lives here, in one place, because
-- workers, triggerers (trigger errors, deferral timeouts) and the scheduler (zombies) all fail tasks.
CREATE FUNCTION deferral_retry_at(
    try_number integer, retry_delay_s double precision, backoff boolean,
    max_retry_delay_s double precision
) RETURNS timestamptz LANGUAGE sql STABLE AS $$
    SELECT now() + make_interval(secs => LEAST(
        CASE WHEN backoff
             THEN retry_delay_s * power(2.0, LEAST(GREATEST(try_number - 1, 0), 40))
             ELSE retry_delay_s END,
        COALESCE(max_retry_delay_s, 31536000.0)))
$$;

-- Where a failed try goes: another try while retries remain, else failed.
CREATE FUNCTION deferral_fail_state(try_number integer, retries integer)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN try_number <= retries THEN 'up_for_retry' ELSE 'failed' END
$$;

-- The task instances of a run, from its DAG's serialized tasks (deferral_dags.tasks): one row a
-- task, its columns as deferral_task_instances names them. Tasks without upstreams (or whose
-- rule is 'always') start scheduled, the others pending. tries_before ({task_id: try number};
-- null: none) is what a run a backfill reprocessed had reached: its tries number on from there,
-- and its retries count past them (as a clear does). create_dag_run and start_queued_runs
-- insert these rows; a single SELECT in SQL, so the planner inlines it into their plans.
-- Added by migration 0020; callbacks (the task's callback kinds) by 0022.
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

-- A read-only view of the runs and the states of their tasks: the documented interface for
-- code outside the engine that reads its tables (triggers.external_task, dashboards), so the
-- tables underneath can change without breaking it. One row per DAG run; columns are listed
-- in docs/reference/triggers-and-sensors.md. task_states is computed only when selected.
-- Added by migration 0004; run_type and the data interval by 0009.
CREATE VIEW deferral_run_states AS
SELECT r.id AS run_seq, r.dag_id, r.run_id, r.logical_date, r.state, r.created_at, r.ended_at,
       (SELECT COALESCE(jsonb_object_agg(ti.task_id, ti.state), '{}'::jsonb)
        FROM deferral_task_instances ti
        WHERE ti.dag_run_id = r.id) AS task_states,
       r.run_type, r.data_interval_start, r.data_interval_end
FROM deferral_dag_runs r;
COMMENT ON VIEW deferral_run_states IS
    'One row per DAG run: run_seq (newer runs are higher), dag_id, run_id, logical_date, state, created_at, ended_at, task_states ({task_id: state}), run_type, data_interval_start, data_interval_end. Read only; the interface for readers outside the engine.';

-- Per-trigger and per-try logs; added by migration 0010. Lines are written in batches by the triggerer and
-- the worker (engine/usercode/logsink.py), never a file per trigger. seq orders the lines of a trigger
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

-- Admission (added by 0012).
-- Named slot counts. A task holds pool_slots of its pool while running (and, with
-- include_deferred, while deferred).
CREATE TABLE deferral_pools (
    name             text PRIMARY KEY CHECK (name <> ''),
    slots            integer NOT NULL CHECK (slots >= 0),
    include_deferred boolean NOT NULL DEFAULT false,
    description      text,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
INSERT INTO deferral_pools (name, slots, description)
VALUES ('default_pool', 128, 'the pool of every task that names none');

-- Variables and Connections (added by 0017): values a task reads at run time. A Variable's
-- value and a Connection's password and extra are encrypted with the store's keys.
CREATE TABLE deferral_variables (
    key         text PRIMARY KEY CHECK (key <> '' AND length(key) <= 250),
    value       bytea NOT NULL,
    description text,
    -- masked wherever the engine shows it, whatever its key is called
    is_secret   boolean NOT NULL DEFAULT false,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE deferral_connections (
    conn_id     text PRIMARY KEY CHECK (conn_id <> '' AND length(conn_id) <= 250),
    conn_type   text,
    host        text,
    schema      text,
    login       text,
    port        integer CHECK (port BETWEEN 0 AND 65535),
    -- {"password": ..., "extra": {...}} as JSON, encrypted (null: neither)
    secrets     bytea,
    description text,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- the deferred tasks of a pool, and those whose trigger fired until a worker claims them:
-- counted when the pool includes deferred tasks
CREATE INDEX deferral_ti_deferred_pool ON deferral_task_instances (pool)
    WHERE state = 'deferred' OR (state = 'scheduled' AND next_method IS NOT NULL);
-- the tasks holding slots (deferral_claim_tasks counts them on every claim)
CREATE INDEX deferral_ti_busy ON deferral_task_instances (pool)
    WHERE state IN ('running', 'queued');
-- the runnable tasks of a pool and queue in claim order (deferral_claim_tasks reads them pool
-- by pool and queue by queue: the tasks of a queue the worker does not serve are not read)
CREATE INDEX deferral_ti_runnable_pool
    ON deferral_task_instances (pool, queue, priority DESC, run_after, id)
    WHERE state IN ('scheduled', 'up_for_retry', 'up_for_reschedule');

-- When a queue last had a live worker or triggerer serving it (for "why is this task not
-- running"): written at registration, by each worker heartbeat and triggerer lease renewal.
CREATE TABLE deferral_queues_seen (
    kind         text NOT NULL CHECK (kind IN ('worker', 'triggerer')),
    queue        text NOT NULL,
    last_seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, queue)
);

-- Tries told to stop (added by 0013). A mark or a
-- clear of a running task ends or resets the task instance at once, and the try that was
-- running is recorded here until the worker running it reports it gone: its worker learns of
-- it through its heartbeat (woken by a notification on deferral_stop) and cancels it; until
-- then the try still counts in its pool, its DAG's and task's limits and the parallelism
-- (deferral_claim_tasks below), and no new try of the task instance is admitted. A worker's
-- row going (reaped after missed heartbeats, or unregistered) takes its rows with it.
CREATE TABLE deferral_stopping_tries (
    ti_id                  bigint NOT NULL,
    try_number             integer NOT NULL,
    worker_id              bigint NOT NULL REFERENCES deferral_workers (id) ON DELETE CASCADE,
    -- what the try holds while it stops (copied from its task instance)
    pool                   text NOT NULL,
    pool_slots             integer NOT NULL,
    dag_id                 text NOT NULL,
    task_id                text NOT NULL,
    max_active_tis_per_dag integer,
    -- who stopped it, and how (for the worker's log of the try)
    reason                 text NOT NULL,
    since                  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (ti_id, try_number)
);
CREATE INDEX deferral_stopping_tries_worker ON deferral_stopping_tries (worker_id);

-- XComs pushed under keys of their own (context["ti"].xcom_push; added by 0021); a task's
-- return value (key 'return_value') is its result column. A row belongs to the try that
-- pushed it: readers compare try_number with the task instance's. value is encrypted at rest.
CREATE TABLE deferral_xcom (
    ti_id      bigint NOT NULL REFERENCES deferral_task_instances (id) ON DELETE CASCADE,
    key        text NOT NULL CHECK (key <> ''),
    try_number integer NOT NULL,
    value      bytea NOT NULL,
    pushed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (ti_id, key)
);

-- Admit and claim up to p_limit runnable task instances of the queues p_queues for worker
-- p_worker, highest priority first (ties: oldest run_after, then id), within every limit:
-- the pool's slots (running tasks, tries told to stop that have not stopped yet, and deferred
-- ones where the pool includes them), the DAG's
-- max_active_tasks, the task's max_active_tis_per_dag and p_parallelism (running tasks across
-- all workers; 0: no limit). A task whose pool does not exist is claimed too, with
-- missing_pool set: the worker fails it at once naming the pool.
-- Admission is serial: a transaction-scoped advisory lock, then the counts, each statement of
-- this function with a snapshot taken after the lock, so two claims never both spend the same
-- free slot. The claim itself is the one UPDATE (scheduled/up_for_retry/up_for_reschedule ->
-- running); what a limit holds back stays where it is, never failed.
-- Candidates are read pool by pool (deferral_ti_runnable_pool), from the pools with room (or
-- missing) only, each up to what its room and the claim's limit can admit: one ordered read
-- of all runnable tasks, filtering out those of full pools, read every task of a full pool on
-- each claim, under the lock (27 ms at 10,000 waiting in full pools, and 2,400 admissions/s
-- in bench claims where 7,000 now). The pools that runnable tasks name are found with one
-- index descent each (a loose index scan). The query runs with a generic plan (planning it
-- on each call cost more than running it) and without bitmap or sequential scans: a LIMIT the
-- planner cannot read (it depends on each pool's room) is taken for a tenth of a pool's
-- rows, for which it chose to read them all and sort them (tests/test_admission_plan.py pins
-- the plan at 100,000 runnable rows).
-- (The check before the lock: migration 0028. Each limit counted once per claim: 0032. The
-- cap of a worker that takes resumes: 0033.)
CREATE FUNCTION deferral_claim_tasks(
    p_worker bigint, p_limit integer, p_queues text[], p_parallelism integer
) RETURNS TABLE (id bigint, missing_pool boolean) LANGUAGE plpgsql ROWS 16
SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off
SET enable_seqscan = off AS $$
DECLARE
    v_room bigint;
BEGIN
    -- Nothing of these queues runnable now: an empty answer, without the lock or the counts.
    -- (Several workers wake for one notification and the first claims what there is; a
    -- slot that frees wakes its own worker. The check is a superset of what the admission
    -- reads: whatever it finds, the admission below decides.) Once more after the lock, in
    -- a snapshot taken after it: the claim that held the lock may have taken everything.
    IF NOT EXISTS (SELECT 1 FROM deferral_task_instances r
                   WHERE r.state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
                     AND r.run_after <= now() AND r.queue = ANY (p_queues)) THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(74657203);
    IF NOT EXISTS (SELECT 1 FROM deferral_task_instances r
                   WHERE r.state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
                     AND r.run_after <= now() AND r.queue = ANY (p_queues)) THEN
        RETURN;
    END IF;
    -- A worker that takes resumes (0033) counted its limit before the lock; a fire may have
    -- handed it resumes since. It claims no more than its slots hold now: its running tries
    -- (handed ones included) and those told to stop that have not yet.
    SELECT w.slots - (SELECT count(*) FROM deferral_task_instances r
                      WHERE r.worker_id = w.id AND r.state = 'running')
                   - (SELECT count(*) FROM deferral_stopping_tries s WHERE s.worker_id = w.id)
    INTO v_room
    FROM deferral_workers w WHERE w.id = p_worker AND w.takes_resumes;
    IF v_room IS NOT NULL THEN
        IF v_room <= 0 THEN
            RETURN;
        END IF;
        p_limit := LEAST(p_limit, v_room);
    END IF;
    RETURN QUERY
    WITH RECURSIVE busy AS MATERIALIZED (
        SELECT b.pool, b.dag_id, b.task_id, b.pool_slots, b.max_active_tis_per_dag
        FROM deferral_task_instances b WHERE b.state IN ('running', 'queued')
        UNION ALL
        -- the tries told to stop (a mark or a clear) that their worker has not seen end yet
        SELECT s.pool, s.dag_id, s.task_id, s.pool_slots, s.max_active_tis_per_dag
        FROM deferral_stopping_tries s
    ), task_full AS MATERIALIZED (
        -- the tasks at their max_active_tis_per_dag (one set, not a count per row read)
        SELECT b.dag_id, b.task_id FROM busy b
        WHERE b.max_active_tis_per_dag IS NOT NULL
        GROUP BY b.dag_id, b.task_id HAVING count(*) >= min(b.max_active_tis_per_dag)
    ), waiting_pool (pool) AS (
        (SELECT w.pool FROM deferral_task_instances w
         WHERE w.state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
         ORDER BY w.pool LIMIT 1)
        UNION ALL
        SELECT (SELECT w.pool FROM deferral_task_instances w
                WHERE w.state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
                  AND w.pool > wp.pool
                ORDER BY w.pool LIMIT 1)
        FROM waiting_pool wp WHERE wp.pool IS NOT NULL
    ), pool_room AS MATERIALIZED (
        -- room is null for a pool that does not exist
        SELECT wp.pool AS name, p.name IS NULL AS missing, p.include_deferred, p.slots
             - COALESCE((SELECT sum(b.pool_slots) FROM busy b WHERE b.pool = wp.pool), 0)
             - CASE WHEN p.include_deferred
                    -- (a deferred task whose trigger fired keeps its slot until a
                    -- worker claims it: it is the same sensor, resuming)
                    THEN COALESCE((SELECT sum(d.pool_slots) FROM deferral_task_instances d
                                   WHERE (d.state = 'deferred'
                                          OR (d.state = 'scheduled'
                                              AND d.next_method IS NOT NULL))
                                     AND d.pool = wp.pool), 0)
                    ELSE 0 END AS room
        FROM waiting_pool wp LEFT JOIN deferral_pools p ON p.name = wp.pool
        WHERE wp.pool IS NOT NULL
    ), dag_full AS MATERIALIZED (
        -- the DAGs at their max_active_tasks
        SELECT b.dag_id FROM busy b JOIN deferral_dags d ON d.dag_id = b.dag_id
        WHERE d.max_active_tasks IS NOT NULL
        GROUP BY b.dag_id, d.max_active_tasks HAVING count(*) >= d.max_active_tasks
    ), candidate AS MATERIALIZED (
        -- Per pool, at most what its room (and the claim's limit) can admit. No join in the
        -- read: the rows come in the index's order and the read stops at the limit (joined to
        -- the counts, the planner hashed a pool's every runnable row and sorted them).
        SELECT c.* FROM pool_room pr
        CROSS JOIN unnest(p_queues) AS q (queue)
        CROSS JOIN LATERAL (
            SELECT ti.id, ti.pool, ti.pool_slots, ti.dag_id, ti.task_id, ti.priority,
                   ti.run_after, ti.max_active_tis_per_dag, pr.missing, pr.room AS pool_room,
                   false AS reserved
            FROM deferral_task_instances ti
            WHERE ti.pool = pr.name AND ti.queue = q.queue
              AND ti.state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
              AND ti.run_after <= now()
              -- (the resumes of a pool that counts deferred tasks hold their slot: below)
              AND (pr.include_deferred IS NOT TRUE OR ti.next_method IS NULL)
              -- what a full limit holds back is not even looked at
              AND (pr.missing OR ti.pool_slots <= pr.room)
              -- no new try while an earlier try of the task is still stopping
              AND ti.id <> ALL (ARRAY(SELECT s.ti_id FROM deferral_stopping_tries s))
              AND ti.dag_id <> ALL (ARRAY(SELECT f.dag_id FROM dag_full f))
              AND (ti.max_active_tis_per_dag IS NULL
                   OR (ti.dag_id, ti.task_id) NOT IN (SELECT f.dag_id, f.task_id
                                                      FROM task_full f))
            ORDER BY ti.priority DESC, ti.run_after, ti.id
            LIMIT CASE WHEN pr.missing THEN p_limit ELSE LEAST(p_limit, GREATEST(pr.room, 0)) END
            FOR UPDATE OF ti SKIP LOCKED
        ) c
        WHERE pr.missing OR pr.room > 0
        UNION ALL
        -- The resumes of the pools that count deferred tasks: their slots are theirs already
        -- (counted above), so they need no room, whatever new tasks wait in the pool.
        SELECT c.* FROM pool_room pr
        CROSS JOIN unnest(p_queues) AS q (queue)
        CROSS JOIN LATERAL (
            SELECT rs.id, rs.pool, rs.pool_slots, rs.dag_id, rs.task_id, rs.priority,
                   rs.run_after, rs.max_active_tis_per_dag, pr.missing, pr.room AS pool_room,
                   true AS reserved
            FROM deferral_task_instances rs
            WHERE rs.pool = pr.name AND rs.queue = q.queue
              AND rs.state = 'scheduled' AND rs.next_method IS NOT NULL
              AND rs.run_after <= now()
              AND rs.id <> ALL (ARRAY(SELECT s.ti_id FROM deferral_stopping_tries s))
              AND rs.dag_id <> ALL (ARRAY(SELECT f.dag_id FROM dag_full f))
              AND (rs.max_active_tis_per_dag IS NULL
                   OR (rs.dag_id, rs.task_id) NOT IN (SELECT f.dag_id, f.task_id
                                                      FROM task_full f))
            ORDER BY rs.priority DESC, rs.run_after, rs.id
            LIMIT p_limit
            FOR UPDATE OF rs SKIP LOCKED
        ) c
        WHERE pr.include_deferred
    ), dag_busy AS MATERIALIZED (
        -- what runs of the candidates' DAGs that have a max_active_tasks (one pass over busy;
        -- a DAG without the limit is not counted at all)
        SELECT b.dag_id, count(*) AS n FROM busy b
        WHERE b.dag_id IN (SELECT c.dag_id FROM candidate c
                           JOIN deferral_dags d ON d.dag_id = c.dag_id
                           WHERE d.max_active_tasks IS NOT NULL)
        GROUP BY b.dag_id
    ), task_busy AS MATERIALIZED (
        -- what runs of the candidates' tasks that have a max_active_tis_per_dag (likewise)
        SELECT b.dag_id, b.task_id, count(*) AS n FROM busy b
        WHERE (b.dag_id, b.task_id) IN (SELECT c.dag_id, c.task_id FROM candidate c
                                        WHERE c.max_active_tis_per_dag IS NOT NULL)
        GROUP BY b.dag_id, b.task_id
    ), roomy AS (
        -- the room each candidate's DAG and task have left (null: no limit)
        SELECT c.*,
               d.max_active_tasks - COALESCE(db.n, 0) AS dag_room,
               c.max_active_tis_per_dag - COALESCE(tb.n, 0) AS task_room
        FROM candidate c LEFT JOIN deferral_dags d ON d.dag_id = c.dag_id
        LEFT JOIN dag_busy db ON db.dag_id = c.dag_id
        LEFT JOIN task_busy tb ON tb.dag_id = c.dag_id AND tb.task_id = c.task_id
    ), ranked AS (
        -- what the candidates before each one (in claim order) would take of each limit
        SELECT c.*,
               sum(CASE WHEN c.reserved THEN 0 ELSE c.pool_slots END)
                   OVER (PARTITION BY c.pool ORDER BY c.priority DESC, c.run_after, c.id)
                   AS pool_take,
               row_number() OVER (PARTITION BY c.dag_id ORDER BY c.priority DESC, c.run_after,
                                  c.id) AS dag_take,
               row_number() OVER (PARTITION BY c.dag_id, c.task_id ORDER BY c.priority DESC,
                                  c.run_after, c.id) AS task_take,
               row_number() OVER (ORDER BY c.priority DESC, c.run_after, c.id) AS all_take
        FROM roomy c
    )
    SELECT r.id, r.missing FROM ranked r
    WHERE (r.missing OR r.reserved OR r.pool_take <= r.pool_room)
      AND (r.dag_room IS NULL OR r.dag_take <= r.dag_room)
      AND (r.task_room IS NULL OR r.task_take <= r.task_room)
      AND (p_parallelism <= 0 OR r.all_take <= p_parallelism - (SELECT count(*) FROM busy))
    ORDER BY r.priority DESC, r.run_after, r.id
    LIMIT p_limit;
END;
$$;

-- The DAG files that failed to import, as the latest scan of their folder found them (added by
-- 0018): `deferral dags list` and the status page's banner show them until the file is fixed.
CREATE TABLE deferral_import_errors (
    fileloc text PRIMARY KEY,
    -- the DAGs folder the file was found in (a path ending in '/')
    folder  text NOT NULL,
    error   text NOT NULL,
    -- when this error (this text) was first recorded
    since   timestamptz NOT NULL DEFAULT now()
);

-- Where the engine's processes listen (their metrics server; a webserver's status page), for
-- `deferral status` (added by 0019): kept by a heartbeat, removed when the process stops.
CREATE TABLE deferral_endpoints (
    id           bigserial PRIMARY KEY,
    kind         text NOT NULL CHECK (kind IN ('metrics', 'webserver')),
    process      text NOT NULL,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    version      text,
    url          text NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX deferral_endpoints_process ON deferral_endpoints (hostname, pid);

-- Callbacks and deadline alerts (added by 0022).
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
-- transaction. Skips by a trigger rule (from pending) are not the task's outcome and have none,
-- nor do a user's marks (a transaction that sets deferral.override: engine/store/overrides.py).
CREATE FUNCTION deferral_task_callback() RETURNS trigger LANGUAGE plpgsql AS $$
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
-- end, if it declares one, is requested (naming the task instance its context shows: for a
-- failure the failed one that ended last, for a success the last by task id; none for a run a
-- user marked). The triggers are locked first (in id order): a firing trigger locks its row
-- before its deadline alert, and so does this.
CREATE FUNCTION deferral_run_ended() RETURNS trigger LANGUAGE plpgsql AS $$
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
        PERFORM pg_notify('deferral_tasks', 'callbacks');
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER deferral_deadline_fired AFTER DELETE ON deferral_triggers
    FOR EACH ROW WHEN (starts_with(OLD.dedup_key, 'deadline:'))
    EXECUTE FUNCTION deferral_deadline_fired();

-- Assets and asset-triggered runs (added by 0024; 'asset_triggered' runs: the run_type CHECK
-- above).

-- The assets the DAG files declare (recorded by the DAG scan with the DAGs that use them,
-- record_dag_assets). A row stays when no DAG uses it any more (its events keep their
-- asset); deferral_dag_assets says which DAGs use it now.
CREATE TABLE deferral_assets (
    name        text PRIMARY KEY,
    uri         text NOT NULL,
    asset_group text NOT NULL DEFAULT 'asset',
    extra       jsonb NOT NULL DEFAULT '{}'::jsonb,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Which DAG uses which asset, and how: 'schedule' (the DAG's runs are triggered by its
-- events) or 'outlet' (a task of the DAG records events of it). Replaced whole for a DAG each
-- time the DAG is recorded.
CREATE TABLE deferral_dag_assets (
    dag_id  text NOT NULL REFERENCES deferral_dags (dag_id) ON DELETE CASCADE,
    asset   text NOT NULL REFERENCES deferral_assets (name),
    role    text NOT NULL CHECK (role IN ('schedule', 'outlet')),
    PRIMARY KEY (asset, role, dag_id),
    -- a digest of the group, extra and watchers the DAG declares (null: a bare declaration:
    -- default group, no extra, no watchers; migration 0027)
    declared text
);
CREATE INDEX deferral_dag_assets_dag ON deferral_dag_assets (dag_id);

-- The watchers the assets declare (AssetWatcher: a name, unique per asset, and an event
-- trigger, stored as triggers are: classpath and encrypted, encoded kwargs). Replaced with
-- their asset's record. The triggerer's runtime of watchers adds its own columns or table.
CREATE TABLE deferral_asset_watchers (
    asset     text NOT NULL REFERENCES deferral_assets (name) ON DELETE CASCADE,
    name      text NOT NULL,
    classpath text NOT NULL,
    kwargs    bytea NOT NULL,
    PRIMARY KEY (asset, name)
);

-- One row per asset event. extra: JSON data set by whoever recorded it; source_kind: who did,
-- with its details (a task: dag/run/task/map index; a watcher: source_name is its name; the
-- webhook and the CLI: source_name says who, when known).
CREATE TABLE deferral_asset_events (
    id               bigserial PRIMARY KEY,
    asset            text NOT NULL REFERENCES deferral_assets (name),
    extra            jsonb NOT NULL DEFAULT '{}'::jsonb,
    source_kind      text NOT NULL CHECK (source_kind IN ('task', 'watcher', 'webhook', 'cli')),
    source_dag_id    text,
    source_run_id    text,
    source_task_id   text,
    source_map_index integer,
    source_name      text,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX deferral_asset_events_asset ON deferral_asset_events (asset, id);

-- Events not yet consumed by a run of a DAG scheduled on their asset: one row per (DAG,
-- event). The scheduler consumes all of a DAG's rows into one run once its condition holds
-- (queued events collapse into one run).
-- (No foreign keys here and in deferral_run_asset_events: their rows are written by the
-- trigger and by create_asset_runs from rows that exist, and a check per row cost more than
-- the insert, thousands of them per event burst.)
CREATE TABLE deferral_asset_queue (
    dag_id   text NOT NULL,
    event_id bigint NOT NULL,
    asset    text NOT NULL,
    PRIMARY KEY (dag_id, event_id)
);
-- (which assets a DAG has events of queued: one probe per (DAG, asset), however many events
-- are queued: create_asset_runs)
CREATE INDEX deferral_asset_queue_asset ON deferral_asset_queue (dag_id, asset);

-- The events that triggered each asset-triggered run.
CREATE TABLE deferral_run_asset_events (
    dag_run_id bigint NOT NULL,
    event_id   bigint NOT NULL,
    PRIMARY KEY (dag_run_id, event_id)
);
CREATE INDEX deferral_run_asset_events_event ON deferral_run_asset_events (event_id);

-- Every inserted event is queued for the active, unpaused DAGs scheduled on its asset, in the
-- inserting statement's transaction (an event of a task is queued with its success, or not at
-- all), and the schedulers are woken (NOTIFY deferral_assets, a signal only) when one was.
-- (A row trigger: a statement that inserts no event, finish_tasks for tasks without outlets,
-- runs nothing; a statement trigger ran its function for each of them, some 20-70 us.)
CREATE FUNCTION deferral_queue_asset_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferral_asset_queue (dag_id, event_id, asset)
    SELECT s.dag_id, NEW.id, NEW.asset
    FROM deferral_dag_assets s
    JOIN deferral_dags d ON d.dag_id = s.dag_id
    WHERE s.asset = NEW.asset AND s.role = 'schedule' AND d.is_active AND NOT d.is_paused
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        PERFORM pg_notify('deferral_assets', '');
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER deferral_asset_events_queue AFTER INSERT ON deferral_asset_events
    FOR EACH ROW EXECUTE FUNCTION deferral_queue_asset_event();

-- Whether an asset condition holds when the assets named in $2 have queued events: a
-- condition is {"asset": name}, {"all": [conditions]} or {"any": [conditions]} (engine's
-- AssetAll, AssetAny; a schedule list is "all").
CREATE FUNCTION deferral_asset_condition(cond jsonb, present text[]) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    part jsonb;
BEGIN
    IF cond ? 'asset' THEN
        RETURN (cond->>'asset') = ANY (present);
    ELSIF cond ? 'all' THEN
        FOR part IN SELECT jsonb_array_elements(cond->'all') LOOP
            IF NOT deferral_asset_condition(part, present) THEN
                RETURN false;
            END IF;
        END LOOP;
        RETURN true;
    ELSIF cond ? 'any' THEN
        FOR part IN SELECT jsonb_array_elements(cond->'any') LOOP
            IF deferral_asset_condition(part, present) THEN
                RETURN true;
            END IF;
        END LOOP;
        RETURN false;
    END IF;
    RETURN false;
END;
$$;
-- Asset watchers on the triggerer (issue 22). Each watcher of an asset an active DAG uses runs
-- as a row of deferral_triggers (claimed with leases, adopted on failover, fenced, like every
-- trigger) that no task waits on and that never fires: its events are written as asset events
-- with its cursor (record_watcher_events). The watcher's row keeps what must outlive a trigger
-- row: the cursor, and the faults that are shown by `deferral assets list`.
ALTER TABLE deferral_asset_watchers
    -- the trigger row that runs it now (null: none, e.g. no active DAG uses its asset)
    ADD COLUMN trigger_id    bigint REFERENCES deferral_triggers (id) ON DELETE SET NULL,
    -- digest of the trigger that row runs (classpath and kwargs as declared): a watcher whose
    -- trigger changed starts again without a cursor
    ADD COLUMN trigger_key   text,
    -- the event trigger's cursor after the last event recorded (MessagePack; null: none yet)
    ADD COLUMN cursor        bytea,
    ADD COLUMN events        bigint NOT NULL DEFAULT 0,
    -- the (fence, sequence number) of the last item written: a batch written again after its
    -- reply was lost writes nothing twice
    ADD COLUMN written_fence bigint NOT NULL DEFAULT 0,
    ADD COLUMN written_seq   bigint NOT NULL DEFAULT 0,
    ADD COLUMN restarts      integer NOT NULL DEFAULT 0,
    ADD COLUMN last_error    text,
    ADD COLUMN last_error_at timestamptz,
    -- when a watcher whose trigger raised starts again (its backoff)
    ADD COLUMN retry_at      timestamptz;
CREATE UNIQUE INDEX deferral_asset_watchers_trigger ON deferral_asset_watchers (trigger_id)
    WHERE trigger_id IS NOT NULL;

-- Write a batch of trigger outcomes of triggerer p_triggerer (fire_triggers in queries.sql
-- calls it: what it guarantees is said there): lock the triggers, then fire them. (Planned
-- with enable_nestloop off since 0031: hash joins of the batch, linear whatever the
-- statistics.)
CREATE FUNCTION deferral_fire_triggers(
    p_triggerer bigint, p_ids bigint[], p_fences bigint[], p_kinds text[], p_payloads bytea[],
    p_errors text[], p_shown text[]
) RETURNS TABLE (fired_id bigint, id bigint, dag_run_id bigint, task_id text, state text,
                 is_leaf boolean, woke bigint)
LANGUAGE plpgsql ROWS 100 SET plan_cache_mode = force_generic_plan SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    v_worker bigint;
    v_free bigint;
    v_queues text[];
    v_host text;
    v_pid integer;
    v_handed bigint[] := '{}';
BEGIN
    -- lock_owned_triggers: a task joining a trigger holds its row until it commits; the fire
    -- below, a statement of its own, then sees that task waiting.
    PERFORM 1 FROM deferral_triggers
    WHERE deferral_triggers.id = ANY (p_ids)
      AND deferral_triggers.triggerer_id IS NOT DISTINCT FROM p_triggerer
    ORDER BY deferral_triggers.id
    FOR UPDATE;
    -- The worker that takes the resumes of this fire, if one may (0033): the live worker
    -- that takes resumes with the most free slots, while no live worker counts a global
    -- parallelism (the fire could not keep it). Chosen under the admission's lock, as a claim
    -- admits: the resumes handed below are admitted against what runs, in a snapshot taken
    -- after the lock, and a worker that stopped taking resumes (stop_taking_resumes takes the
    -- lock too) is seen stopped.
    IF EXISTS (SELECT 1 FROM unnest(p_kinds) AS k WHERE k = 'event')
       AND EXISTS (SELECT 1 FROM deferral_workers w WHERE w.takes_resumes) THEN
        PERFORM pg_advisory_xact_lock(74657203);
        SELECT w.id, w.queues, w.hostname, w.pid,
               w.slots - (SELECT count(*) FROM deferral_task_instances r
                          WHERE r.worker_id = w.id AND r.state = 'running')
                       - (SELECT count(*) FROM deferral_stopping_tries s
                          WHERE s.worker_id = w.id)
        INTO v_worker, v_queues, v_host, v_pid, v_free
        FROM deferral_workers w
        WHERE w.takes_resumes
          AND w.heartbeat_at > now() - make_interval(secs => 2 * w.heartbeat_s + 1)
        ORDER BY 5 DESC, w.id
        LIMIT 1;
        IF v_free IS NULL OR v_free <= 0
           OR EXISTS (SELECT 1 FROM deferral_workers w
                      WHERE w.parallelism > 0
                        AND w.heartbeat_at > now() - interval '1 hour') THEN
            v_worker := NULL;
        END IF;
    END IF;
    IF v_worker IS NOT NULL THEN
        -- The resumes handed to it: of a queue it serves, in a pool that exists, of a DAG
        -- without max_active_tasks and a task without max_active_tis_per_dag, no earlier try
        -- still stopping (whatever else a claim checks cannot bind them), in claim order, at
        -- most its free slots and what each pool's room holds, counted as a claim counts it (a
        -- pool that counts deferred tasks holds the resume's slot already: it needs none).
        -- Read from the triggers this fire locked and will delete (same conditions as the
        -- delete below); every other resume is made runnable, for a claim to admit.
        v_handed := ARRAY(
            WITH candidate AS MATERIALIZED (
                SELECT ti.id, ti.pool, p.slots, p.include_deferred,
                       sum(ti.pool_slots) OVER (PARTITION BY ti.pool
                                                ORDER BY ti.priority DESC, ti.id) AS pool_take,
                       row_number() OVER (ORDER BY ti.priority DESC, ti.id) AS n
                FROM unnest(p_ids, p_fences, p_kinds) AS o(trigger_id, fence, kind)
                JOIN deferral_triggers t
                  ON t.id = o.trigger_id AND t.id = ANY (p_ids)
                 AND t.triggerer_id IS NOT DISTINCT FROM p_triggerer AND t.fence = o.fence
                JOIN deferral_task_instances ti
                  ON ti.trigger_id = t.id AND ti.trigger_id = ANY (p_ids)
                 AND ti.state = 'deferred'
                JOIN deferral_pools p ON p.name = ti.pool
                WHERE o.kind = 'event' AND ti.queue = ANY (v_queues)
                  -- (a subplan, one index probe per resume: a join, with nested loops off,
                  -- read every DAG for each batch)
                  AND (SELECT d.max_active_tasks FROM deferral_dags d
                       WHERE d.dag_id = ti.dag_id) IS NULL
                  AND ti.max_active_tis_per_dag IS NULL
                  AND ti.id <> ALL (ARRAY(SELECT s.ti_id FROM deferral_stopping_tries s))
            ), room AS MATERIALIZED (
                SELECT c.pool, min(c.slots)
                       - COALESCE((SELECT sum(b.pool_slots) FROM deferral_task_instances b
                                   WHERE b.pool = c.pool AND b.state IN ('running', 'queued')),
                                  0)
                       - COALESCE((SELECT sum(s.pool_slots) FROM deferral_stopping_tries s
                                   WHERE s.pool = c.pool), 0) AS room
                FROM candidate c WHERE NOT c.include_deferred GROUP BY c.pool
            )
            SELECT c.id FROM candidate c LEFT JOIN room r ON r.pool = c.pool
            WHERE c.n <= v_free AND (c.include_deferred OR c.pool_take <= r.room)
        );
    END IF;
    RETURN QUERY
    WITH outcome AS (
        SELECT * FROM unnest(p_ids, p_fences, p_kinds::deferral_trigger_outcome[],
                             p_payloads, p_errors, p_shown)
            AS o(trigger_id, fence, kind, payload, error, shown)
    ), fired AS (
        DELETE FROM deferral_triggers t
        USING outcome o
        -- (IS NOT DISTINCT FROM, not =: no index on the owner can serve it, so every plan reaches
        -- each row by its id. Without statistics, a generic plan otherwise read every trigger the
        -- triggerer owns through the owner index, for each batch.)
        -- (t.id = ANY (p_ids): without statistics a custom plan hashed the outcomes against a
        -- sequential scan of every trigger; the array gives every plan the primary key.)
        WHERE t.id = o.trigger_id AND t.id = ANY (p_ids)
          AND t.triggerer_id IS NOT DISTINCT FROM p_triggerer AND t.fence = o.fence
        RETURNING t.id, t.classpath, o.kind, o.payload, o.error, o.shown
    ), moved AS (
        UPDATE deferral_task_instances ti
        SET state = CASE f.kind WHEN 'event' THEN CASE WHEN ti.id = ANY (v_handed)
                                                       THEN 'running' ELSE 'scheduled' END
                                WHEN 'success' THEN 'success'
                                WHEN 'skipped' THEN 'skipped'
                                WHEN 'failed' THEN deferral_fail_state(ti.try_number, ti.retries)
                    END,
            next_event = CASE WHEN f.kind = 'event' THEN f.payload END,
            next_method = CASE WHEN f.kind = 'event' THEN ti.next_method END,
            next_kwargs = CASE WHEN f.kind = 'event' THEN ti.next_kwargs END,
            result = CASE WHEN f.kind = 'success' THEN f.payload ELSE ti.result END,
            error = CASE WHEN f.kind = 'failed' THEN f.error END,
            run_after = CASE WHEN f.kind = 'failed'
                             THEN deferral_retry_at(ti.try_number, ti.retry_delay_s,
                                                    ti.retry_exponential_backoff,
                                                    ti.max_retry_delay_s)
                             ELSE now() END,
            ended_at = CASE WHEN f.kind = 'event' THEN NULL ELSE now() END,
            trigger_id = NULL, trigger_timeout_at = NULL, deadline_kind = NULL,
            -- a handed resume is claimed here, as claim_tasks claims a resume
            worker_id = CASE WHEN ti.id = ANY (v_handed) THEN v_worker
                             ELSE ti.worker_id END,
            heartbeat_at = CASE WHEN ti.id = ANY (v_handed) THEN now()
                                ELSE ti.heartbeat_at END,
            started_at = CASE WHEN ti.id = ANY (v_handed) THEN now()
                              ELSE ti.started_at END,
            first_try_at = CASE WHEN ti.id = ANY (v_handed)
                                THEN COALESCE(ti.first_try_at, now()) ELSE ti.first_try_at END,
            try_started_at = CASE WHEN ti.id = ANY (v_handed)
                                  THEN COALESCE(ti.try_started_at, now())
                                  ELSE ti.try_started_at END,
            fired_at = CASE WHEN ti.id = ANY (v_handed) THEN now()
                            ELSE ti.fired_at END,
            -- unread until the worker reads it (take_handed); one it never reads is given
            -- back by the scheduler (reap_zombie_tasks) or its unregistration
            handed = ti.id = ANY (v_handed)
        FROM fired f
        -- (ti.trigger_id = ANY (p_ids): the same rows, by the waiting tasks' index; with
        -- enable_nestloop off the join is a hash of the fired triggers, and without it the
        -- tasks would be read by a scan of every waiting one. See 0031.)
        WHERE ti.trigger_id = f.id AND ti.trigger_id = ANY (p_ids) AND ti.state = 'deferred'
        RETURNING ti.id, ti.dag_run_id, ti.task_id, ti.state, ti.is_leaf, f.id AS trigger_id,
                  ti.dag_id, ti.run_id, ti.try_number, ti.next_method, f.classpath, f.kind,
                  f.error, f.shown, ti.map_index
    ), logged AS (
        INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                        logger, message)
        SELECT m.dag_id, m.run_id, deferral_ti_name(m.task_id, m.map_index), m.try_number, now(),
               CASE WHEN m.kind = 'failed' THEN 'ERROR' ELSE 'INFO' END, 'log', 'engine.triggerer',
               CASE m.kind
                   WHEN 'event' THEN format('trigger %s (%s) fired with event %s; the try resumes '
                                            'at %s %s', m.trigger_id, m.classpath,
                                            COALESCE(m.shown, 'null'), m.next_method,
                                            CASE WHEN m.state = 'running'
                                                 THEN 'on worker ' || v_worker
                                                 ELSE 'when a worker claims it' END)
                   WHEN 'failed' THEN format('trigger %s (%s) failed the try: %s', m.trigger_id,
                                             m.classpath, left(m.error, 4000))
                   WHEN 'success' THEN format('trigger %s (%s) ended the task: success%s',
                                              m.trigger_id, m.classpath,
                                              COALESCE(' with ' || m.shown, ''))
                   WHEN 'skipped' THEN format('trigger %s (%s) ended the task: skipped%s',
                                              m.trigger_id, m.classpath,
                                              COALESCE(' with ' || m.shown, ''))
               END
        FROM moved m
        UNION ALL
        -- a handed resume's line, as a claim writes it (claimed as its trigger fired)
        SELECT m.dag_id, m.run_id, deferral_ti_name(m.task_id, m.map_index), m.try_number, now(),
               'INFO', 'log', 'engine.worker',
               format('resuming at %s on worker %s (%s, pid %s), claimed %ss after its trigger '
                      'fired', m.next_method, v_worker, v_host, v_pid, '0.000')
        FROM moved m
        WHERE m.state = 'running'
    ), woke AS (
        SELECT pg_notify('deferral_tasks', '') FROM moved WHERE state = 'scheduled' LIMIT 1
    ), handed_to AS (
        -- the worker is told to take what it was handed (the others ignore it)
        SELECT pg_notify('deferral_tasks', 'handed ' || v_worker) FROM moved
        WHERE state = 'running' LIMIT 1
    )
    SELECT f.id AS fired_id, NULL::bigint AS id, NULL::bigint AS dag_run_id, NULL::text AS task_id,
           NULL::text AS state, NULL::boolean AS is_leaf,
           (SELECT count(*) FROM woke) + 0 * (SELECT count(*) FROM handed_to) AS woke
    FROM fired f
    UNION ALL
    SELECT m.trigger_id, m.id, m.dag_run_id, m.task_id, m.state, m.is_leaf, NULL FROM moved m;
END;
$$;

-- Added by 0033: workers that take the resumes triggerers hand them.
ALTER TABLE deferral_workers
    -- it takes the resumes triggerers hand it (0033); false once it stops
    ADD COLUMN takes_resumes boolean NOT NULL DEFAULT false,
    -- its setting parallelism (0: no limit; a fire hands nothing while a live worker has one)
    ADD COLUMN parallelism   integer NOT NULL DEFAULT 0,
    -- its heartbeat interval: a fire hands only to a worker heard from within two of them
    ADD COLUMN heartbeat_s   double precision NOT NULL DEFAULT 5;

ALTER TABLE deferral_task_instances
    -- handed to its worker by a fire and not read by it yet (a running try no worker runs
    -- yet): read, it is the worker's; a worker that dies or leaves first, or does not read it
    -- within a few seconds, has it given back ('scheduled', the same try) for any worker
    ADD COLUMN handed boolean NOT NULL DEFAULT false;
