-- Named queries of the deferral store. Each block starts with "-- name: <name>", then comment
-- lines that say what it does, then one statement. engine/store/queries.py parses this file;
-- no SQL lives anywhere else. The plans of the hot statements (claim_tasks, claim_triggers,
-- lock_owned_triggers, fire_triggers, finish_tasks, defer_tasks, timeout_deferrals) are pinned
-- at 100,000 waiting rows, with and without statistics, custom and generic, by
-- tests/test_query_plans.py: a comment below about a plan is an assertion there.

-- name: ensure_migrations_table
-- The ledger of applied migrations.
CREATE TABLE IF NOT EXISTS deferral_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: lock_migrations
-- Serialize concurrent migrators (several processes start at once) for this transaction.
SELECT pg_advisory_xact_lock(74657201);

-- name: applied_migrations
-- Versions already applied.
SELECT version FROM deferral_migrations ORDER BY version;

-- name: record_migration
-- Mark one migration applied.
INSERT INTO deferral_migrations (version, name) VALUES ($1, $2);

-- name: db_now
-- The database clock: every lease and deadline is compared against it.
SELECT now() AS now;

-- name: notify
-- Wake the listeners of a channel; a signal, never the data.
SELECT pg_notify($1, $2);

-- name: upsert_dag
-- Record a DAG's structure and schedule as parsed from its file ($11: whether a new DAG starts
-- paused; a known DAG keeps its paused flag; $14: max_active_tasks, null: no limit; $15: the
-- hash of it all, engine.scheduler.dagrecord; $16: its callbacks and deadline alerts, null:
-- none). Returns whether anything changed and whether the next
-- scheduled run must be computed again (a new DAG, or a changed schedule).
-- A DAG recorded as it is now is not written at all (the INSERT has no row): an upsert that
-- changes nothing still locks the row, which took a transaction id and a WAL flush per DAG,
-- and the scheduler's rescan of a thousand unchanged DAGs held its loop (and the runs due
-- meanwhile) for half a second every dag_rescan_interval_s.
WITH old AS (
    SELECT timetable, start_date, end_date, catchup, is_active,
           (fileloc, tasks, description, timetable, schedule, start_date, end_date, catchup,
            max_active_runs, params, tags, is_active, max_active_tasks, fingerprint, alerts)
           IS NOT DISTINCT FROM ($2::text, $3::jsonb, $4::text, $5::jsonb, $6::text,
                                 $7::timestamptz, $8::timestamptz, $9::boolean, $10::integer,
                                 $12::jsonb, $13::text[], true, $14::integer, $15::text,
                                 $16::jsonb) AS same
    FROM deferral_dags
    WHERE dag_id = $1
), up AS (
    INSERT INTO deferral_dags (dag_id, fileloc, tasks, description, updated_at, timetable,
                               schedule, start_date, end_date, catchup, max_active_runs,
                               is_paused, params, tags, max_active_tasks, fingerprint, alerts)
    SELECT $1, $2, $3, $4, now(), $5, $6, $7, $8, $9, $10, $11::boolean, $12, $13, $14, $15,
           $16
    WHERE NOT EXISTS (SELECT 1 FROM old WHERE old.same)
    ON CONFLICT (dag_id) DO UPDATE
    SET fileloc = EXCLUDED.fileloc, tasks = EXCLUDED.tasks, description = EXCLUDED.description,
        timetable = EXCLUDED.timetable, schedule = EXCLUDED.schedule,
        start_date = EXCLUDED.start_date, end_date = EXCLUDED.end_date,
        catchup = EXCLUDED.catchup, max_active_runs = EXCLUDED.max_active_runs,
        params = EXCLUDED.params, tags = EXCLUDED.tags, updated_at = now(), is_active = true,
        max_active_tasks = EXCLUDED.max_active_tasks, fingerprint = EXCLUDED.fingerprint,
        alerts = EXCLUDED.alerts
    WHERE (deferral_dags.fileloc, deferral_dags.tasks, deferral_dags.description,
           deferral_dags.timetable, deferral_dags.schedule, deferral_dags.start_date,
           deferral_dags.end_date, deferral_dags.catchup, deferral_dags.max_active_runs,
           deferral_dags.params, deferral_dags.tags, deferral_dags.is_active,
           deferral_dags.max_active_tasks, deferral_dags.fingerprint, deferral_dags.alerts)
          IS DISTINCT FROM (EXCLUDED.fileloc, EXCLUDED.tasks, EXCLUDED.description,
                            EXCLUDED.timetable, EXCLUDED.schedule, EXCLUDED.start_date,
                            EXCLUDED.end_date, EXCLUDED.catchup, EXCLUDED.max_active_runs,
                            EXCLUDED.params, EXCLUDED.tags, true, EXCLUDED.max_active_tasks,
                            EXCLUDED.fingerprint, EXCLUDED.alerts)
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM up) AS changed,
       NOT EXISTS (SELECT 1 FROM old)
       OR EXISTS (SELECT 1 FROM old
                  WHERE NOT old.is_active
                     OR (old.timetable, old.start_date, old.end_date, old.catchup)
                        IS DISTINCT FROM ($5::jsonb, $7::timestamptz, $8::timestamptz,
                                          $9::boolean)) AS reschedule;

-- name: dags_to_record
-- Of the given DAGs ($1: ids, $2: the hash of what a scan found of each), those whose row is
-- missing, inactive or records something else (another hash, or none): the only ones a rescan
-- writes.
SELECT u.dag_id
FROM unnest($1::text[], $2::text[]) AS u(dag_id, fingerprint)
WHERE NOT EXISTS (SELECT 1 FROM deferral_dags d
                  WHERE d.dag_id = u.dag_id AND d.is_active AND d.fingerprint = u.fingerprint);

-- name: deactivate_missing_dags
-- The active DAGs recorded from files under the DAGs folder $1 (a path ending in '/') that its
-- latest scan did not find ($2: the DAG ids it found), except those of files that failed to
-- import ($3: their DAGs stay as they were until the file is fixed or removed): they get no
-- more scheduled runs. Their runs and history stay. Returns their ids.
UPDATE deferral_dags
SET is_active = false, next_dagrun_create_after = NULL, updated_at = now()
WHERE is_active AND starts_with(fileloc, $1)
  AND dag_id <> ALL ($2::text[]) AND fileloc <> ALL ($3::text[])
RETURNING dag_id;

-- name: last_scheduled_interval
-- The data interval of a DAG's latest scheduled run (the next one follows it).
SELECT data_interval_start AS start, data_interval_end AS "end"
FROM deferral_dag_runs
WHERE dag_id = $1 AND run_type = 'scheduled'
ORDER BY logical_date DESC LIMIT 1;

-- name: set_next_dagruns
-- Store the next scheduled run of each given DAG: logical date, interval, when it may be
-- created (nulls: none).
UPDATE deferral_dags d
SET next_dagrun = u.logical_date, next_dagrun_data_interval_start = u.logical_date,
    next_dagrun_data_interval_end = u.interval_end, next_dagrun_create_after = u.create_after
FROM unnest($1::text[], $2::timestamptz[], $3::timestamptz[], $4::timestamptz[])
    AS u(dag_id, logical_date, interval_end, create_after)
WHERE d.dag_id = u.dag_id;

-- name: due_dags
-- Lock up to $1 unpaused DAGs whose next scheduled run may be created now (by the partial
-- index deferral_dags_due: the DAGs not due are not read). SKIP LOCKED: another scheduler
-- creating runs of a DAG is not waited for; it does that DAG. A @continuous DAG is due only
-- once none of its runs is queued or running (its next run starts when the last ended).
SELECT dag_id, timetable, start_date, end_date, catchup,
       next_dagrun_data_interval_start, next_dagrun_data_interval_end, next_dagrun_create_after,
       now() AS db_now
FROM deferral_dags d
WHERE NOT is_paused AND next_dagrun_create_after IS NOT NULL
  AND next_dagrun_create_after <= now()
  AND NOT (d.timetable->>'kind' = 'continuous' AND EXISTS (
      SELECT 1 FROM deferral_dag_runs r
      WHERE r.dag_id = d.dag_id AND r.state IN ('queued', 'running')))
ORDER BY next_dagrun_create_after
LIMIT $1
FOR UPDATE SKIP LOCKED;

-- name: next_due
-- Seconds until the earliest unpaused DAG's next scheduled run may be created (database
-- clock; null: none). A @continuous DAG with a run not ended counts only once it ended.
SELECT EXTRACT(EPOCH FROM min(next_dagrun_create_after) - now())::double precision AS next_in
FROM deferral_dags d
WHERE NOT is_paused AND next_dagrun_create_after IS NOT NULL
  AND NOT (d.timetable->>'kind' = 'continuous' AND EXISTS (
      SELECT 1 FROM deferral_dag_runs r
      WHERE r.dag_id = d.dag_id AND r.state IN ('queued', 'running')));

-- name: insert_runs
-- Create runs as 'queued' (no task instances yet: start_queued_runs creates them), at most one
-- scheduled or backfill run per (dag_id, logical_date) and one run per (dag_id, run_id): a
-- run that exists already is not created again (no error). created_at is the clock at the
-- insert (the scheduling delay is measured from it). Returns the runs created.
INSERT INTO deferral_dag_runs (dag_id, run_id, logical_date, data_interval_start,
                               data_interval_end, run_type, conf, state, created_at)
SELECT u.dag_id, u.run_id, u.logical_date, u.interval_start, u.interval_end, u.run_type,
       u.conf, 'queued', clock_timestamp()
FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::timestamptz[], $5::timestamptz[],
            $6::text[], $7::jsonb[])
    AS u(dag_id, run_id, logical_date, interval_start, interval_end, run_type, conf)
ON CONFLICT DO NOTHING
RETURNING id, dag_id, run_id, logical_date;

-- name: lock_dags
-- Lock DAG rows (in a fixed order) before admitting their queued runs: run creation and
-- admission of one DAG take turns, so max_active_runs holds. Returns the DAGs that exist.
SELECT dag_id FROM deferral_dags WHERE dag_id = ANY ($1::text[]) ORDER BY dag_id FOR UPDATE;

-- name: dags_with_queued_runs
-- DAGs that have runs waiting to start (the scheduler's backstop admits them).
SELECT DISTINCT dag_id FROM deferral_dag_runs WHERE state = 'queued';

-- name: start_queued_runs
-- Start the queued runs of the given DAGs (after lock_dags in the same transaction) that
-- max_active_runs lets run, oldest logical date first, creating their task instances as
-- create_dag_run does. Scheduled and manual runs count against max_active_runs; backfill runs
-- start at once (the backfill throttles itself). Returns the runs started.
-- (The runs to start by an array of ids, not a join with picked: statistics taken while no
-- run was queued estimate one queued run, and the join was planned as a nested loop that
-- picked again for each queued run, quadratic in the runs started: 1 to 2 s for 500 due DAGs
-- in bench schedule. tests/test_query_plans.py pins this.)
WITH free AS (
    SELECT d.dag_id,
           GREATEST(d.max_active_runs - (
               SELECT count(*) FROM deferral_dag_runs r
               WHERE r.dag_id = d.dag_id AND r.state = 'running' AND r.run_type <> 'backfill'
           ), 0) AS slots
    FROM deferral_dags d WHERE d.dag_id = ANY ($1::text[])
), picked AS (
    SELECT q.id FROM free f
    CROSS JOIN LATERAL (
        SELECT r.id FROM deferral_dag_runs r
        WHERE r.dag_id = f.dag_id AND r.state = 'queued' AND r.run_type <> 'backfill'
        ORDER BY r.logical_date, r.id
        LIMIT f.slots
    ) q
    UNION ALL
    SELECT r.id FROM deferral_dag_runs r
    WHERE r.dag_id = ANY ($1::text[]) AND r.state = 'queued' AND r.run_type = 'backfill'
), run AS (
    UPDATE deferral_dag_runs r SET state = 'running', started_at = now()
    WHERE r.id = ANY (ARRAY(SELECT p.id FROM picked p)) AND r.state = 'queued'
    RETURNING r.id, r.dag_id, r.run_id, r.tries_before
), tis AS (
    -- (A run a backfill reprocessed numbers its tries on from tries_before, as a clear does:
    -- the retries count past the tries made.)
    INSERT INTO deferral_task_instances (
        dag_run_id, dag_id, run_id, task_id, state, try_number, retries, retry_delay_s,
        retry_exponential_backoff, max_retry_delay_s, execution_timeout_s, soft_fail,
        trigger_rule, upstream, is_leaf, priority, pool, no_retry_on_timeout, pool_slots, queue,
        trigger_queue, max_active_tis_per_dag, callbacks)
    SELECT run.id, run.dag_id, run.run_id, t.*
    FROM run
    JOIN deferral_dags d ON d.dag_id = run.dag_id
    CROSS JOIN LATERAL deferral_task_rows(d.tasks, run.tries_before) t
    RETURNING 1
)
SELECT run.id, run.dag_id, run.run_id, (SELECT count(*) FROM tis) AS task_count FROM run;

-- name: reset_dag_runs
-- Run ended runs again (a backfill reprocessing them): their task instances go and they wait
-- as 'queued' again, to be started by start_queued_runs. The try numbers the task instances
-- had reached are kept in tries_before (over those kept by an earlier reprocessing), so that
-- the new ones number their tries on: a try's log lines, stored by try number, stay its own.
-- Runs not ended are left alone.
WITH reset AS (
    UPDATE deferral_dag_runs r
    SET state = 'queued', ended_at = NULL, started_at = NULL,
        tries_before = COALESCE(r.tries_before, '{}'::jsonb) || COALESCE(
            (SELECT jsonb_object_agg(t.task_id, t.tries)
             FROM (SELECT ti.task_id, max(ti.try_number) AS tries
                   FROM deferral_task_instances ti
                   WHERE ti.dag_run_id = r.id AND ti.try_number > 0
                   GROUP BY ti.task_id) t),
            '{}'::jsonb)
    WHERE r.id = ANY ($1::bigint[]) AND r.state IN ('success', 'failed')
    RETURNING r.id
), archived AS (
    -- the tries the task instances reached, kept for the tries' pages
    INSERT INTO deferral_task_tries (dag_id, run_id, task_id, try_number, state, queued_at,
                                     started_at, resumed_at, deferred_at, fired_at, ended_at,
                                     error, rendered_fields)
    SELECT ti.dag_id, ti.run_id, deferral_ti_name(ti.task_id, ti.map_index), ti.try_number,
           ti.state, ti.try_queued_at, ti.try_started_at, ti.started_at, ti.deferred_at,
           ti.fired_at, ti.ended_at, ti.error, ti.rendered_fields
    FROM deferral_task_instances ti JOIN reset ON ti.dag_run_id = reset.id
    WHERE ti.try_number > 0 AND ti.first_try_at IS NOT NULL  -- (see clear_tasks)
    ON CONFLICT DO NOTHING
), cleared AS (
    DELETE FROM deferral_task_instances ti USING reset WHERE ti.dag_run_id = reset.id
)
SELECT id FROM reset;

-- name: set_dag_paused
-- Pause or unpause a DAG (paused: the scheduler creates no runs of it). Returns it if known.
UPDATE deferral_dags SET is_paused = $2 WHERE dag_id = $1 RETURNING dag_id;

-- name: runs_at
-- The runs of a DAG at the given logical dates (a backfill's look at what exists).
SELECT id, dag_id, run_id, run_type, logical_date, data_interval_start, data_interval_end,
       state, conf, created_at, started_at, ended_at
FROM deferral_dag_runs
WHERE dag_id = $1 AND logical_date = ANY ($2::timestamptz[])
ORDER BY logical_date, id;

-- name: list_runs
-- Runs, newest first, optionally of one DAG and in one state.
SELECT id, dag_id, run_id, run_type, logical_date, data_interval_start, data_interval_end,
       state, conf, created_at, started_at, ended_at
FROM deferral_dag_runs
WHERE ($1::text IS NULL OR dag_id = $1) AND ($2::text IS NULL OR state = $2)
ORDER BY logical_date DESC, id DESC
LIMIT $3;

-- name: list_dags
-- Every known DAG with its task count and latest run.
SELECT d.dag_id, d.fileloc, jsonb_array_length(d.tasks) AS tasks, d.description, d.updated_at,
       r.run_id AS last_run_id, r.state AS last_run_state, d.is_paused, d.schedule,
       d.next_dagrun, d.next_dagrun_create_after, d.tags, d.is_active
FROM deferral_dags d
LEFT JOIN LATERAL (
    SELECT run_id, state FROM deferral_dag_runs
    WHERE dag_id = d.dag_id ORDER BY id DESC LIMIT 1
) r ON true
ORDER BY d.dag_id;

-- name: get_dag
-- One DAG's stored structure and schedule.
SELECT dag_id, fileloc, tasks, description, timetable, schedule, start_date, end_date, catchup,
       max_active_runs, is_paused, params, tags, next_dagrun, next_dagrun_create_after, is_active
FROM deferral_dags WHERE dag_id = $1;

-- name: create_dag_run
-- Create a run of a stored DAG and all its task instances in one statement (their rows:
-- deferral_task_rows, schema.sql; the ones start_queued_runs inserts too). Returns nothing
-- if the DAG is unknown. (Not held back by max_active_runs: the engine's API for tests and
-- benchmarks; insert_runs and start_queued_runs admit runs.)
WITH run AS (
    INSERT INTO deferral_dag_runs (dag_id, run_id, logical_date, conf, run_type,
                                   data_interval_start, data_interval_end, started_at)
    SELECT dag_id, $2, $3::timestamptz, $4, $5, COALESCE($6::timestamptz, $3::timestamptz),
           COALESCE($7::timestamptz, $3::timestamptz), now()
    FROM deferral_dags WHERE dag_id = $1
    RETURNING id, dag_id, run_id
), tis AS (
    INSERT INTO deferral_task_instances (
        dag_run_id, dag_id, run_id, task_id, state, try_number, retries, retry_delay_s,
        retry_exponential_backoff, max_retry_delay_s, execution_timeout_s, soft_fail,
        trigger_rule, upstream, is_leaf, priority, pool, no_retry_on_timeout, pool_slots, queue,
        trigger_queue, max_active_tis_per_dag, callbacks)
    SELECT run.id, run.dag_id, run.run_id, t.*
    FROM run
    JOIN deferral_dags d ON d.dag_id = run.dag_id
    CROSS JOIN LATERAL deferral_task_rows(d.tasks, NULL) t
    RETURNING 1
)
SELECT run.id, (SELECT count(*) FROM tis) AS task_count FROM run;

-- name: get_dag_run
-- One run by its DAG and run id.
SELECT id, dag_id, run_id, logical_date, conf, state, created_at, ended_at, run_type,
       data_interval_start, data_interval_end, started_at
FROM deferral_dag_runs WHERE dag_id = $1 AND run_id = $2;

-- name: register_worker
-- A worker announces itself ($4: the engine's version, $5: the queues it serves, $6: its
-- setting parallelism, $7: its heartbeat interval, $8: whether it takes the resumes
-- triggerers hand it, migration 0033) and marks its queues as served now.
WITH w AS (
    INSERT INTO deferral_workers (hostname, pid, slots, version, queues, parallelism,
                                  heartbeat_s, takes_resumes)
    VALUES ($1, $2, $3, $4, $5::text[], $6, $7, $8) RETURNING id
), seen AS (
    INSERT INTO deferral_queues_seen (kind, queue, last_seen_at)
    SELECT 'worker', q, now() FROM unnest($5::text[]) AS q
    ON CONFLICT (kind, queue) DO UPDATE SET last_seen_at = EXCLUDED.last_seen_at
)
SELECT id FROM w;

-- name: stop_taking_resumes
-- A stopping worker $1 takes no more resumes from triggerers. Under the admission's lock, which
-- a fire that hands resumes holds until it commits: once this returns, every resume handed to
-- the worker is committed (it reads and runs them), and no fire hands it another.
WITH locked AS (SELECT pg_advisory_xact_lock(74657203))
UPDATE deferral_workers SET takes_resumes = false
WHERE id = $1 AND EXISTS (SELECT 1 FROM locked);

-- name: unregister_worker
-- A worker leaves after a graceful stop. Resumes handed to it that it never read (it stopped
-- taking them first and read what it held, so only when that read failed) are given back, the
-- same try, for any worker to claim; the workers are woken for them.
WITH back AS (
    UPDATE deferral_task_instances
    SET state = 'scheduled', worker_id = NULL, handed = false
    WHERE worker_id = $1 AND state = 'running' AND handed
    RETURNING id, dag_id, run_id, task_id, map_index, try_number
), logged AS (
    INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                    logger, message)
    SELECT b.dag_id, b.run_id, deferral_ti_name(b.task_id, b.map_index), b.try_number, now(),
           'WARNING', 'log', 'engine.worker',
           format('worker %s left without reading this resume handed to it; it is runnable '
                  'again for any worker', $1::bigint)
    FROM back b
), woke AS (
    SELECT pg_notify('deferral_tasks', '') FROM (SELECT 1 FROM back LIMIT 1) one
)
DELETE FROM deferral_workers
WHERE id = $1 AND (SELECT count(*) FROM woke) >= 0;

-- name: heartbeat_worker
-- One statement keeps a worker and the tries it runs alive ($2: their task instance ids, $3:
-- their try numbers; tries it was told to stop that have not ended yet included), and settles
-- the tries it was told to stop (deferral_stopping_tries, written by mark_tasks and
-- clear_tasks): those it no longer runs have ended, and their rows go (their slots are free:
-- the workers are woken to claim); those it still runs come back (stop_ids, stop_tries,
-- stop_reasons) for it to stop. A try the database says the worker holds but that it does not
-- run stops being kept alive, so the scheduler reaps it; a try of a task instance that has
-- moved on to a later try is not kept alive by an earlier one. alive is false if the worker's
-- row is gone (it was declared dead and its tasks reaped).
WITH w AS (
    UPDATE deferral_workers SET heartbeat_at = now() WHERE id = $1 RETURNING id, queues
), seen AS (
    -- its queues are marked as served now (for `deferral tasks why` once it is gone)
    UPDATE deferral_queues_seen s SET last_seen_at = now()
    FROM w WHERE s.kind = 'worker' AND s.queue = ANY (w.queues)
), mine AS (
    SELECT m.id, m.try_number FROM unnest($2::bigint[], $3::integer[]) AS m(id, try_number)
), alive AS (
    -- (SKIP LOCKED: a try whose row another statement holds is being written (its outcome,
    -- a mark): it needs no heartbeat now. Waiting for it deadlocked with an outcome batch
    -- that locked the same rows in another order, and held both for deadlock_timeout.)
    SELECT ti.id FROM deferral_task_instances ti
    WHERE ti.worker_id = $1 AND ti.state = 'running' AND ti.id = ANY ($2::bigint[])
      AND (ti.id, ti.try_number) IN (SELECT m.id, m.try_number FROM mine m)
    FOR UPDATE SKIP LOCKED
), t AS (
    UPDATE deferral_task_instances ti SET heartbeat_at = now()
    WHERE ti.id IN (SELECT a.id FROM alive a)
      AND EXISTS (SELECT 1 FROM w)
    RETURNING 1
), stopped AS (
    DELETE FROM deferral_stopping_tries s
    WHERE s.worker_id = $1
      AND (s.ti_id, s.try_number) NOT IN (SELECT m.id, m.try_number FROM mine m)
    RETURNING 1
), woke AS (
    SELECT pg_notify('deferral_tasks', '') FROM (SELECT 1 FROM stopped LIMIT 1) one
), stop AS (
    SELECT s.ti_id, s.try_number, s.reason FROM deferral_stopping_tries s
    WHERE s.worker_id = $1 AND (s.ti_id, s.try_number) IN (SELECT m.id, m.try_number FROM mine m)
)
SELECT EXISTS (SELECT 1 FROM w) AS alive, (SELECT count(*) FROM t) AS tasks,
       (SELECT count(*) FROM stopped) AS stopped, (SELECT count(*) FROM woke) AS woke,
       ARRAY(SELECT stop.ti_id FROM stop ORDER BY stop.ti_id) AS stop_ids,
       ARRAY(SELECT stop.try_number FROM stop ORDER BY stop.ti_id) AS stop_tries,
       ARRAY(SELECT stop.reason FROM stop ORDER BY stop.ti_id) AS stop_reasons;

-- name: claim_tasks
-- Claim up to $2 runnable task instances of the queues $3 for worker $1, admitted by
-- deferral_claim_tasks (schema.sql: pools, max_active_tasks, max_active_tis_per_dag and the
-- global parallelism $4, highest priority first). A new try counts up try_number, clears the
-- last try's error (kept in previous_error) and end time; a resume (next_method set) or a
-- reschedule continues the same try. missing_pool: the task names a pool that does not exist
-- (the worker fails it), as the admission saw it: this statement's own snapshot is older, taken
-- before the admission's lock was granted, and would call missing a pool created while the
-- claim waited for it.
-- run_after is returned for the resume latency (a resume's is when its event was written).
-- When nothing was claimed, the one row returned has a null id and next_in: seconds until the
-- earliest waiting task of those queues becomes runnable (retries, reschedules; database
-- clock), null when none waits. Tasks a limit holds back are runnable now and are not
-- counted: a slot that frees is seen by the next claim (the worker's own or its poll).
-- (One round trip either way: an empty claim is common when several workers wake for the
-- same notification.)
-- A resume's try gets a line in its log saying where it resumes and how long after its
-- trigger fired it was claimed (the trigger's own line, written as it fired, says what it
-- sent): written here, it costs the worker nothing and comes before any line of the resumed
-- method.
WITH admitted AS MATERIALIZED (
    SELECT a.id, a.missing_pool FROM deferral_claim_tasks($1, $2, $3::text[], $4) a
), claimed AS (
    UPDATE deferral_task_instances ti
    SET state = 'running', worker_id = $1, heartbeat_at = now(), started_at = now(),
        first_try_at = COALESCE(ti.first_try_at, now()),
        try_number = CASE WHEN ti.next_method IS NULL AND ti.state <> 'up_for_reschedule'
                          THEN ti.try_number + 1 ELSE ti.try_number END,
        try_started_at = CASE WHEN ti.next_method IS NULL AND ti.state <> 'up_for_reschedule'
                              THEN now() ELSE COALESCE(ti.try_started_at, now()) END,
        previous_error = CASE WHEN ti.next_method IS NULL AND ti.state <> 'up_for_reschedule'
                              THEN ti.error ELSE ti.previous_error END,
        error = CASE WHEN ti.next_method IS NULL AND ti.state <> 'up_for_reschedule'
                     THEN NULL ELSE ti.error END,
        -- the try's spans (the Gantt view): a new try was due since its run_after; a resume's
        -- run_after is when its trigger fired
        try_queued_at = CASE WHEN ti.next_method IS NULL AND ti.state <> 'up_for_reschedule'
                             THEN ti.run_after ELSE ti.try_queued_at END,
        deferred_at = CASE WHEN ti.next_method IS NULL AND ti.state <> 'up_for_reschedule'
                           THEN NULL ELSE ti.deferred_at END,
        fired_at = CASE WHEN ti.next_method IS NOT NULL THEN ti.run_after
                        WHEN ti.state <> 'up_for_reschedule' THEN NULL ELSE ti.fired_at END,
        ended_at = NULL,
        -- (a resume handed by a fire, then marked or cleared before its worker read it, keeps
        -- the flag: it must not mark this claim's try as unread)
        handed = false
    FROM deferral_dag_runs r
    -- (By an array of ids, as claim_triggers: a join with the function's rows was planned as
    -- a hash of every runnable row. No test of the state: the function locked these rows
    -- while runnable, and with a state test the planner read them all through the runnable
    -- index.)
    WHERE ti.id = ANY (ARRAY(SELECT a.id FROM admitted a))
      AND r.id = ti.dag_run_id
    RETURNING ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.try_number, ti.next_method,
              ti.next_kwargs, ti.next_event, ti.first_try_at, ti.try_started_at,
              ti.execution_timeout_s, ti.is_leaf, ti.run_after, r.logical_date, r.conf,
              r.data_interval_start, r.data_interval_end, r.run_type, ti.pool, ti.map_index,
              ti.map_value, ti.id = ANY (ARRAY(SELECT a.id FROM admitted a WHERE a.missing_pool))
                  AS missing_pool
), resumed AS (
    INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                    logger, message)
    SELECT c.dag_id, c.run_id, deferral_ti_name(c.task_id, c.map_index), c.try_number, now(),
           'INFO', 'log', 'engine.worker',
           format('resuming at %s on worker %s (%s, pid %s), claimed %ss after its trigger '
                  'fired', c.next_method, w.id, w.hostname, w.pid,
                  to_char(GREATEST(EXTRACT(EPOCH FROM now() - c.run_after), 0),
                          'FM9999999990.000'))
    FROM claimed c
    JOIN deferral_workers w ON w.id = $1
    WHERE c.next_method IS NOT NULL AND NOT c.missing_pool
), idle AS (
    SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM claimed) THEN (
        SELECT EXTRACT(EPOCH FROM min(run_after) - now())::double precision
        FROM deferral_task_instances
        WHERE state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
          AND run_after > now() AND queue = ANY ($3::text[])) END AS next_in,
           -- nothing claimed though tasks are runnable now: a limit (or another claim) holds
           -- them; the worker claims again when one of its tries ends
           CASE WHEN NOT EXISTS (SELECT 1 FROM claimed) THEN EXISTS (
        SELECT 1 FROM deferral_task_instances
        WHERE state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
          AND run_after <= now() AND queue = ANY ($3::text[])) END AS held
)
SELECT c.*, now() AS db_now, idle.next_in, idle.held FROM idle LEFT JOIN claimed c ON true;

-- name: unacknowledged_claims
-- The running task instances held by worker $1 other than the ones it runs ($2): claims that
-- committed while their reply was lost with the connection. Read only: the worker runs them in
-- the try they were claimed for (a claim of a task whose pool does not exist is failed, as the
-- claim would have: missing_pool). Same columns as claim_tasks.
SELECT ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.try_number, ti.next_method, ti.next_kwargs,
       ti.next_event, ti.first_try_at, ti.try_started_at, ti.execution_timeout_s, ti.is_leaf,
       ti.run_after, r.logical_date, r.conf, r.data_interval_start, r.data_interval_end, r.run_type,
       ti.pool, ti.map_index, ti.map_value, NOT EXISTS (SELECT 1 FROM deferral_pools p WHERE p.name = ti.pool) AS missing_pool,
       now() AS db_now
FROM deferral_task_instances ti
JOIN deferral_dag_runs r ON r.id = ti.dag_run_id
WHERE ti.worker_id = $1 AND ti.state = 'running' AND ti.id <> ALL ($2::bigint[])
  -- (a resume handed to it and not read yet is take_handed's: read here, it would run
  -- unacknowledged, and be given back to other workers while it runs)
  AND NOT ti.handed
ORDER BY ti.id;

-- name: take_handed
-- The resumes triggerers handed worker $1 as their triggers fired (migration 0033) that it has
-- not read yet, at most $2 of them (its free slots, as it counts them: a thread past its
-- timeout holds a slot the database does not see), highest priority first, marked read as
-- they are returned: from here on they are its tries, as claimed ones are. The rest are given
-- back at once (state 'scheduled', the same try) and the workers woken to claim them. Same
-- columns as claim_tasks; one row with a null id when nothing was read.
WITH locked AS MATERIALIZED (
    -- (locked as read: the scheduler's give-back of an unread resume waits, or is waited for)
    SELECT ti.id, ti.priority, ti.run_after FROM deferral_task_instances ti
    WHERE ti.worker_id = $1 AND ti.state = 'running' AND ti.handed
    FOR UPDATE
), unread AS MATERIALIZED (
    SELECT l.id, row_number() OVER (ORDER BY l.priority DESC, l.run_after, l.id) AS n
    FROM locked l
), taken AS (
    UPDATE deferral_task_instances ti SET handed = false
    FROM deferral_dag_runs r
    WHERE ti.id IN (SELECT u.id FROM unread u WHERE u.n <= $2) AND r.id = ti.dag_run_id
      AND ti.worker_id = $1 AND ti.state = 'running' AND ti.handed
    RETURNING ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.try_number, ti.next_method,
              ti.next_kwargs, ti.next_event, ti.first_try_at, ti.try_started_at,
              ti.execution_timeout_s, ti.is_leaf, ti.run_after, r.logical_date, r.conf,
              r.data_interval_start, r.data_interval_end, r.run_type, ti.pool, ti.map_index,
              ti.map_value,
              NOT EXISTS (SELECT 1 FROM deferral_pools p WHERE p.name = ti.pool) AS missing_pool
), back AS (
    UPDATE deferral_task_instances ti
    SET state = 'scheduled', worker_id = NULL, handed = false
    WHERE ti.id IN (SELECT u.id FROM unread u WHERE u.n > $2)
      AND ti.worker_id = $1 AND ti.state = 'running' AND ti.handed
    RETURNING ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number
), back_logged AS (
    INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                    logger, message)
    SELECT b.dag_id, b.run_id, deferral_ti_name(b.task_id, b.map_index), b.try_number, now(),
           'INFO', 'log', 'engine.worker',
           format('worker %s had no free slot for this resume handed to it; it is runnable '
                  'again for any worker', $1::bigint)
    FROM back b
), woke AS (
    SELECT count(*) AS n FROM (
        SELECT pg_notify('deferral_tasks', '') FROM (SELECT 1 FROM back LIMIT 1) one) w
)
SELECT t.*, now() AS db_now FROM woke LEFT JOIN taken t ON true;

-- name: finish_tasks
-- End a batch of running tries in one statement. Per task $1: $2 the worker that ran it and
-- $7 the try (only that try, still held by that worker, changes: an outcome written again
-- after a lost reply cannot end a later try), $3 the outcome kind (deferral_task_outcome),
-- 'success' / 'skipped' (with $4 its result) or 'failed' (with $5 the error; up_for_retry at
-- the policy's delay while retries remain, unless $6 says no retry). $8: the asset events the
-- successes record (a JSON array of {"ti": task instance, "asset", "extra"}; null: none),
-- written with them in this statement (a failure writes none; events of unknown assets are
-- dropped). A branching task's success skips the tasks of its run it does not follow, in the
-- same statement (both land or neither: a worker killed before this write leaves them
-- pending): pairs ($9 task instance, $10 task id), only those still pending. Returns the tries
-- that changed, then the tasks skipped (worker_id NULL). One statement per batch, not per
-- task: a worker resuming a thousand tasks a second would otherwise queue them on a thousand
-- fsynced commits.
WITH outcome AS (
    SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[]::deferral_task_outcome[],
                         $4::bytea[], $5::text[], $6::boolean[], $7::integer[])
        AS o(id, worker_id, kind, result, error, no_retry, try_number)
), done AS (
UPDATE deferral_task_instances ti
SET state = CASE o.kind WHEN 'success' THEN 'success'
                        WHEN 'skipped' THEN 'skipped'
                        WHEN 'failed' THEN CASE WHEN o.no_retry THEN 'failed'
                                                ELSE deferral_fail_state(ti.try_number,
                                                                         ti.retries) END
            END,
    result = CASE WHEN o.kind = 'failed' THEN ti.result ELSE o.result END,
    error = o.error,
    run_after = CASE WHEN o.kind = 'failed'
                     THEN deferral_retry_at(ti.try_number, ti.retry_delay_s,
                                            ti.retry_exponential_backoff, ti.max_retry_delay_s)
                     ELSE ti.run_after END,
    ended_at = now(), worker_id = NULL, next_method = NULL, next_kwargs = NULL,
    next_event = NULL
FROM outcome o
-- (IS NOT DISTINCT FROM: no plan looks rows up through the worker index, once per outcome;
-- without statistics a generic plan did. It may still read the running tasks once.)
WHERE ti.id = o.id AND ti.worker_id IS NOT DISTINCT FROM o.worker_id AND ti.state = 'running'
  AND ti.try_number = o.try_number
RETURNING ti.id, ti.dag_run_id, ti.task_id, ti.state, ti.is_leaf, o.worker_id, ti.dag_id,
          ti.run_id, ti.map_index
), asset_events AS (
    -- (the asset events of the successes: engine/store/assets.sql)
    INSERT INTO deferral_asset_events (asset, extra, source_kind, source_dag_id, source_run_id,
                                       source_task_id, source_map_index)
    SELECT ev->>'asset', COALESCE(ev->'extra', '{}'::jsonb), 'task', d.dag_id, d.run_id,
           d.task_id, d.map_index
    FROM jsonb_array_elements(COALESCE($8::jsonb, '[]'::jsonb)) ev
    JOIN done d ON d.id = (ev->>'ti')::bigint AND d.state = 'success'
    WHERE EXISTS (SELECT 1 FROM deferral_assets a WHERE a.name = ev->>'asset')
), skipped AS (
    -- (Pending rows: never one of the running rows `done` changes.)
    UPDATE deferral_task_instances t
    SET state = 'skipped', ended_at = now(), run_after = now()
    FROM done e
    JOIN unnest($9::bigint[], $10::text[]) AS k(id, task_id) ON k.id = e.id
    WHERE e.state = 'success' AND t.dag_run_id = e.dag_run_id AND t.task_id = k.task_id
      AND t.state = 'pending'
    RETURNING t.id, t.dag_run_id, t.task_id, t.state, t.is_leaf, NULL::bigint AS worker_id
)
SELECT id, dag_run_id, task_id, state, is_leaf, worker_id FROM done
UNION ALL
SELECT * FROM skipped;

-- name: reschedule_task
-- A sensor in reschedule mode gives its slot back until $3: try $4 of task instance $1, if
-- worker $2 still holds it (an earlier try's late reschedule cannot move a later try).
UPDATE deferral_task_instances
SET state = 'up_for_reschedule', run_after = $3, worker_id = NULL
WHERE id = $1 AND worker_id = $2 AND state = 'running' AND try_number = $4
RETURNING id;

-- name: expand_task
-- Expand mapped task instance $1 (map_index -1), whose try $3 worker $2 holds, into $4 (>= 1)
-- instances: it becomes instance 0, and instances 1..$4-1 are inserted as its copies, all
-- scheduled, none tried yet (the claim that expanded it does not count as a try); $5 (null,
-- or one a instance, in order) their own arguments, encoded and encrypted. Nothing is
-- written unless the worker still holds that try. Returns the instances made (no row:
-- nothing written) and wakes the workers.
WITH held AS (
    SELECT * FROM deferral_task_instances
    WHERE id = $1 AND worker_id = $2 AND state = 'running' AND try_number = $3
      AND map_index = -1
    FOR UPDATE
), first AS (
    UPDATE deferral_task_instances ti
    SET map_index = 0, state = 'scheduled', worker_id = NULL, heartbeat_at = NULL,
        try_number = held.try_number - 1, first_try_at = NULL, try_started_at = NULL,
        started_at = NULL, ended_at = NULL, try_queued_at = NULL, previous_error = NULL,
        error = NULL, run_after = now(), map_value = ($5::bytea[])[1]
    FROM held
    WHERE ti.id = held.id
    RETURNING ti.id
), more AS (
    INSERT INTO deferral_task_instances (
        dag_run_id, dag_id, run_id, task_id, map_index, state, try_number, retries,
        retry_delay_s, retry_exponential_backoff, max_retry_delay_s, execution_timeout_s,
        soft_fail, trigger_rule, upstream, is_leaf, priority, pool, no_retry_on_timeout,
        pool_slots, queue, trigger_queue, max_active_tis_per_dag, run_after, map_value,
        callbacks)
    SELECT h.dag_run_id, h.dag_id, h.run_id, h.task_id, g.i, 'scheduled', h.try_number - 1,
           h.retries, h.retry_delay_s, h.retry_exponential_backoff, h.max_retry_delay_s,
           h.execution_timeout_s, h.soft_fail, h.trigger_rule, h.upstream, h.is_leaf,
           h.priority, h.pool, h.no_retry_on_timeout, h.pool_slots, h.queue, h.trigger_queue,
           h.max_active_tis_per_dag, now(), ($5::bytea[])[g.i + 1], h.callbacks
    FROM held h, generate_series(1, $4::integer - 1) AS g(i)
    RETURNING 1
)
SELECT (SELECT count(*) FROM first) + (SELECT count(*) FROM more) AS made,
       pg_notify('deferral_tasks', '') AS notified
FROM first;

-- name: defer_tasks
-- Running tries wait on triggers, a batch of them in one statement (the worker writes every
-- deferral queued while its last write was in flight together). Per deferral: $1 the task
-- instance, held by worker $2 (try $9; null: whichever try it holds); nothing is written for
-- a try the worker no longer holds, and the others are written all the same. Each stores its
-- trigger (or joins the one already waiting with the same dedup key $5: identical classpath
-- and kwargs, or the key the trigger was given, keeping the earliest deadline) and parks its
-- task on it. Deferrals of one batch with the same key share one trigger row, with the
-- earliest of their deadlines (the first of them gives its classpath $3 and kwargs $4; a row
-- is inserted or joined once, as ON CONFLICT can touch a row only once per statement). A
-- deferral's deadline is the earliest of the trigger's ($6 seconds from now; null: none; a
-- sensor's own timeout when the task is a sensor) and the task's execution_timeout (counted
-- from the start of the try, which may have run a while before deferring), and deadline_kind
-- records which one it is (engine/states.py DeadlineKind; on a tie, execution_timeout). $7 and
-- $8: where the task resumes and with what. A new trigger row signals the triggerers (once per
-- batch); joining a trigger a triggerer already runs with a deadline earlier than its others
-- signals that triggerer (the payload is the trigger id), whose timer was set for the later
-- deadline. $10: each try's log line about its deferral (null: none), written with it, so
-- that it is stored before the trigger can fire (the trigger's line follows it). Returns the
-- task instances parked, each with its trigger.
WITH d AS (
    SELECT * FROM unnest($1::bigint[], $3::text[], $4::bytea[], $5::text[],
                         $6::double precision[], $7::text[], $8::bytea[], $9::integer[],
                         $10::text[]) WITH ORDINALITY
        AS d(id, classpath, kwargs, dedup_key, timeout_s, method, method_kwargs, try_number,
             line, ord)
), held AS (
    SELECT d.ord, ti.id, ti.no_retry_on_timeout, ti.trigger_queue, d.classpath, d.kwargs,
           d.method, d.method_kwargs, d.line,
           -- (a trigger runs in the task's trigger_queue: identical triggers of two queues are
           -- two rows, so the default queue's keys are the keys as computed)
           CASE WHEN ti.trigger_queue = 'default' THEN d.dedup_key
                ELSE d.dedup_key || '@' || ti.trigger_queue END AS key,
           now() + make_interval(secs => d.timeout_s) AS wait_until,
           -- (bounded: an execution_timeout of inf or a century makes no timestamp; LEAST
           -- skips nulls, so no execution_timeout is tested for first)
           CASE WHEN ti.execution_timeout_s IS NOT NULL
                THEN ti.try_started_at + make_interval(secs => LEAST(ti.execution_timeout_s,
                                                                     3153600000.0)) END
               AS run_until
    FROM d JOIN deferral_task_instances ti ON ti.id = d.id
    WHERE ti.worker_id = $2 AND ti.state = 'running'
      AND (d.try_number IS NULL OR ti.try_number = d.try_number)
      -- (a resume handed to this worker and not read yet is not the try that deferred: a
      -- deferral written again after its reply was lost must not park the resume its own
      -- trigger handed back. Once read, the same try is told from it no more: a claim token
      -- would be needed, as for a claim of the resume by this worker.)
      AND NOT ti.handed
    ORDER BY ti.id
    FOR UPDATE OF ti
), deadline AS (
    -- (one deferral per task: a task named twice in a batch is parked by the first)
    SELECT DISTINCT ON (id) ord, id, key, classpath, kwargs, trigger_queue, method,
           method_kwargs, line, LEAST(wait_until, run_until) AS at,
           CASE WHEN run_until IS NOT NULL AND (wait_until IS NULL OR run_until <= wait_until)
                THEN 'execution_timeout'
                WHEN wait_until IS NULL THEN NULL
                WHEN no_retry_on_timeout THEN 'sensor_timeout'
                ELSE 'trigger_timeout' END AS kind
    FROM held
    ORDER BY id, ord
), keyed AS (
    -- One row per trigger: the batch's first deferral of the key, the earliest deadline of all.
    SELECT DISTINCT ON (key) key, classpath, kwargs, trigger_queue,
           min(at) OVER (PARTITION BY key) AS at
    FROM deadline
    ORDER BY key, ord
), trig AS (
    -- (inserted in key order: two workers' batches sharing keys cannot deadlock on them)
    INSERT INTO deferral_triggers (classpath, kwargs, dedup_key, timeout_at, queue)
    SELECT classpath, kwargs, key, at, trigger_queue FROM keyed ORDER BY key
    ON CONFLICT (dedup_key) DO UPDATE
    SET timeout_at = LEAST(deferral_triggers.timeout_at, EXCLUDED.timeout_at)
    RETURNING id, dedup_key, (xmax = 0) AS inserted, triggerer_id, timeout_at
), parked AS (
    UPDATE deferral_task_instances ti
    SET state = 'deferred', trigger_id = trig.id, trigger_timeout_at = dl.at,
        deadline_kind = dl.kind, next_method = dl.method, next_kwargs = dl.method_kwargs,
        next_event = NULL, worker_id = NULL, deferred_at = now()
    FROM deadline dl JOIN trig ON trig.dedup_key = dl.key
    WHERE ti.id = dl.id
    RETURNING ti.id, ti.trigger_id, ti.dag_id, ti.run_id, ti.task_id, ti.try_number,
              ti.map_index, dl.line
), logged AS (
    INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                    logger, message)
    SELECT p.dag_id, p.run_id, deferral_ti_name(p.task_id, p.map_index), p.try_number, now(),
           'INFO', 'log', 'engine.worker', p.line
    FROM parked p
    WHERE p.line IS NOT NULL
), notified AS (
    SELECT (SELECT pg_notify('deferral_triggers', '')
            WHERE EXISTS (SELECT 1 FROM trig WHERE trig.inserted)) AS new_triggers,
           (SELECT count(pg_notify('deferral_deadlines', trig.id::text))
            FROM trig JOIN keyed k ON k.key = trig.dedup_key
            WHERE NOT trig.inserted AND trig.triggerer_id IS NOT NULL
              AND trig.timeout_at = k.at) AS earlier_deadlines
)
SELECT p.id, p.trigger_id, n.new_triggers, n.earlier_deadlines
FROM parked p CROSS JOIN notified n;

-- name: resolve_pending
-- Move pending task instances of the given runs on, by their trigger rule and the states of
-- their upstreams: to scheduled, skipped or upstream_failed. $2 limits the candidates to the
-- downstreams of those task ids (the ones that just finished); null considers every pending
-- task of the runs (the scheduler's backstop). Runs after the finishing statement committed,
-- so concurrent finishes cannot both miss each other; the state recheck in the UPDATE makes
-- two concurrent resolutions of one task move it once. Returns what moved.
WITH candidates AS (
    SELECT id, dag_run_id, trigger_rule, upstream FROM deferral_task_instances
    WHERE state = 'pending' AND dag_run_id = ANY ($1::bigint[])
      AND ($2::text[] IS NULL OR upstream && $2::text[])
), counts AS (
    SELECT ti.id, ti.trigger_rule,
           count(*) AS n,
           count(*) FILTER (WHERE u.state = 'success') AS ok,
           count(*) FILTER (WHERE u.state = 'skipped') AS skip,
           count(*) FILTER (WHERE u.state IN ('failed', 'upstream_failed')) AS fail,
           count(*) FILTER (WHERE u.state IN ('success', 'failed', 'skipped', 'upstream_failed'))
               AS done
    FROM candidates ti
    CROSS JOIN LATERAL unnest(ti.upstream) AS up(task_id)
    JOIN deferral_task_instances u ON u.dag_run_id = ti.dag_run_id AND u.task_id = up.task_id
    GROUP BY ti.id, ti.trigger_rule
), decided AS (
    SELECT id, CASE trigger_rule
        WHEN 'all_success' THEN CASE WHEN fail > 0 THEN 'upstream_failed'
                                     WHEN skip > 0 THEN 'skipped'
                                     WHEN ok = n THEN 'scheduled' END
        WHEN 'all_failed' THEN CASE WHEN ok + skip > 0 THEN 'skipped'
                                    WHEN fail = n THEN 'scheduled' END
        WHEN 'all_done' THEN CASE WHEN done = n THEN 'scheduled' END
        WHEN 'all_skipped' THEN CASE WHEN ok + fail > 0 THEN 'skipped'
                                     WHEN skip = n THEN 'scheduled' END
        WHEN 'one_success' THEN CASE WHEN ok > 0 THEN 'scheduled'
                                     WHEN done = n AND fail > 0 THEN 'upstream_failed'
                                     WHEN done = n THEN 'skipped' END
        WHEN 'one_failed' THEN CASE WHEN fail > 0 THEN 'scheduled'
                                    WHEN done = n THEN 'skipped' END
        WHEN 'one_done' THEN CASE WHEN ok + fail > 0 THEN 'scheduled'
                                  WHEN done = n THEN 'skipped' END
        WHEN 'none_failed' THEN CASE WHEN fail > 0 THEN 'upstream_failed'
                                     WHEN done = n THEN 'scheduled' END
        WHEN 'none_failed_min_one_success' THEN CASE WHEN fail > 0 THEN 'upstream_failed'
                                                     WHEN done = n AND ok > 0 THEN 'scheduled'
                                                     WHEN done = n THEN 'skipped' END
        WHEN 'none_skipped' THEN CASE WHEN skip > 0 THEN 'skipped'
                                      WHEN done = n THEN 'scheduled' END
        WHEN 'always' THEN 'scheduled'
    END AS new_state
    FROM counts
)
UPDATE deferral_task_instances ti
SET state = d.new_state, run_after = now(),
    ended_at = CASE WHEN d.new_state = 'scheduled' THEN NULL ELSE now() END
FROM decided d
WHERE ti.id = d.id AND d.new_state IS NOT NULL AND ti.state = 'pending'
RETURNING ti.id, ti.dag_run_id, ti.task_id, ti.state, ti.is_leaf;

-- name: lock_runs_to_finish
-- Lock the runs (of $1, or every running run when $1 is null) whose task instances all look
-- finished, before finish_dag_runs ends them in the same transaction. finish_dag_runs looks again
-- in a statement of its own (a fresh snapshot): a clear that reopened a run (clear_tasks, which
-- writes its row) while this waited for its lock is seen there, not ended over.
SELECT r.id FROM deferral_dag_runs r
WHERE r.state = 'running' AND ($1::bigint[] IS NULL OR r.id = ANY ($1::bigint[]))
  AND NOT EXISTS (
      SELECT 1 FROM deferral_task_instances ti
      WHERE ti.dag_run_id = r.id
        AND ti.state NOT IN ('success', 'failed', 'skipped', 'upstream_failed'))
ORDER BY r.id
-- (NO KEY UPDATE, what the UPDATE of finish_dag_runs takes anyway: a firing trigger's
-- callback request shares the run's key, and must not wait for a run whose end waits for
-- that trigger's lock.)
FOR NO KEY UPDATE OF r;

-- name: finish_dag_runs
-- End the runs $1 (locked by lock_runs_to_finish) whose task instances are all finished:
-- failed if a leaf task failed or could not run for a failed upstream, else success.
UPDATE deferral_dag_runs r
SET state = CASE WHEN EXISTS (
                SELECT 1 FROM deferral_task_instances ti
                WHERE ti.dag_run_id = r.id AND ti.is_leaf
                  AND ti.state IN ('failed', 'upstream_failed'))
            THEN 'failed' ELSE 'success' END,
    ended_at = now()
WHERE r.state = 'running' AND r.id = ANY ($1::bigint[])
  AND NOT EXISTS (
      SELECT 1 FROM deferral_task_instances ti
      WHERE ti.dag_run_id = r.id
        AND ti.state NOT IN ('success', 'failed', 'skipped', 'upstream_failed'))
RETURNING r.id, r.dag_id, r.run_id, r.state, r.run_type;

-- name: notify_finished_runs
-- Wake the scheduler for those of the given runs that have no unfinished task instance left
-- (it then ends them). For the others this is a read-only look, which costs no commit: a
-- NOTIFY per finished task would make every completion a serialized, flushed commit.
SELECT r.id, pg_notify('deferral_finished', r.id::text) AS notified
FROM unnest($1::bigint[]) AS r(id)
WHERE NOT EXISTS (
    SELECT 1 FROM deferral_task_instances ti
    WHERE ti.dag_run_id = r.id
      AND ti.state IN ('pending', 'scheduled', 'queued', 'running', 'deferred',
                       'up_for_reschedule', 'up_for_retry'));

-- name: runs_with_pending
-- Running runs that still have pending task instances (the scheduler's backstop resolves them).
SELECT DISTINCT dag_run_id AS id FROM deferral_task_instances WHERE state = 'pending';

-- name: list_task_instances
-- Task instances, optionally filtered by DAG, run and state (a mapped task's in map_index
-- order). retry_at: when a task waiting for
-- its next try (or check) becomes runnable; duration_s: from the start of the first try to the
-- end of the last (to now while the task has not ended), on the database clock.
SELECT ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.state, ti.try_number, ti.result, ti.error,
       ti.trigger_id, ti.next_method, ti.first_try_at, ti.started_at, ti.ended_at,
       ti.trigger_timeout_at, ti.run_after, ti.try_started_at, ti.previous_error,
       CASE WHEN ti.state IN ('up_for_retry', 'up_for_reschedule') THEN ti.run_after END
           AS retry_at,
       EXTRACT(EPOCH FROM COALESCE(ti.ended_at, now()) - ti.first_try_at)::double precision
           AS duration_s,
       ti.rendered_fields, ti.map_index
FROM deferral_task_instances ti
-- (by the runs named: task instances are found through their run, as in the statements
-- below; every one has its run)
WHERE ti.dag_run_id IN (SELECT r.id FROM deferral_dag_runs r
                        WHERE ($1::text IS NULL OR r.dag_id = $1)
                          AND ($2::text IS NULL OR r.run_id = $2))
  AND ($3::text IS NULL OR ti.state = $3)
ORDER BY ti.dag_run_id, ti.id
LIMIT $4;

-- name: list_dag_runs
-- Runs, newest first, optionally of one DAG ($1) and in one state ($2), at most $3, each with
-- how many of its task instances are in each state.
SELECT r.dag_id, r.run_id, r.run_type, r.logical_date, r.data_interval_start,
       r.data_interval_end, r.state, r.conf, r.created_at, r.ended_at,
       (SELECT COALESCE(jsonb_object_agg(c.state, c.n), '{}'::jsonb)
        FROM (SELECT ti.state, count(*) AS n FROM deferral_task_instances ti
              WHERE ti.dag_run_id = r.id GROUP BY ti.state) c) AS tasks
FROM deferral_dag_runs r
WHERE ($1::text IS NULL OR r.dag_id = $1) AND ($2::text IS NULL OR r.state = $2)
ORDER BY r.id DESC
LIMIT $3;

-- name: set_rendered_fields
-- What the templated fields of task instance $1 rendered to ($4, field → value) at the start
-- of try $3, written only while worker $2 still runs that try. Written only for tasks whose
-- fields held a template: one statement per such try, none for the others.
UPDATE deferral_task_instances SET rendered_fields = $4::jsonb
WHERE id = $1 AND worker_id = $2 AND try_number = $3 AND state = 'running'
RETURNING id;

-- name: prev_success_interval_start
-- The data interval start of the latest successful run of DAG $1 before logical date $2 (the
-- template variable prev_data_interval_start_success). Runs only when a template or a callable
-- asks for it. A run made before runs had data intervals (migration 0009) starts at its logical
-- date.
SELECT COALESCE(data_interval_start, logical_date) AS start FROM deferral_dag_runs
WHERE dag_id = $1 AND state = 'success' AND logical_date < $2
ORDER BY logical_date DESC
LIMIT 1;

-- name: dags_of_run_id
-- The DAGs that have a run with id $1 (a run id is unique within its DAG only).
SELECT dag_id FROM deferral_dag_runs WHERE run_id = $1 ORDER BY dag_id;

-- name: count_task_states
-- How many task instances are in each state (of one run, or all).
SELECT state, count(*) AS n FROM deferral_task_instances
WHERE ($1::bigint IS NULL OR dag_run_id = $1)
GROUP BY state ORDER BY state;

-- name: work_left
-- What an engine has left to do now (engine.testing's drain): task instances runnable now or
-- queued or running, tries told to stop that have not stopped yet, deferrals whose deadline is
-- due or whose trigger no triggerer has claimed yet, and runs whose tasks are all finished but
-- which are not ended yet, or that wait queued.
SELECT
    (SELECT count(*) FROM deferral_task_instances
     WHERE (state IN ('scheduled', 'up_for_retry', 'up_for_reschedule') AND run_after <= now())
        OR state IN ('queued', 'running'))
    + (SELECT count(*) FROM deferral_stopping_tries) AS runnable,
    (SELECT count(*) FROM deferral_task_instances ti
     LEFT JOIN deferral_triggers t ON t.id = ti.trigger_id
     WHERE ti.state = 'deferred'
       AND (ti.trigger_timeout_at <= now() OR t.id IS NULL OR t.triggerer_id IS NULL))
        AS deferred_due,
    (SELECT count(*) FROM deferral_dag_runs r
     WHERE r.state = 'queued' OR (r.state = 'running' AND NOT EXISTS (
         SELECT 1 FROM deferral_task_instances ti
         WHERE ti.dag_run_id = r.id
           AND ti.state NOT IN ('success', 'failed', 'skipped', 'upstream_failed'))))
        AS runs_to_end;

-- name: register_triggerer
-- A triggerer announces itself with a lease of $4 seconds on the database clock ($5: the
-- engine's version).
WITH t AS (
    INSERT INTO deferral_triggerers (hostname, pid, capacity, lease_expires_at, version, queues)
    VALUES ($1, $2, $3, now() + make_interval(secs => $4), $5, $6::text[])
    RETURNING id
), seen AS (
    INSERT INTO deferral_queues_seen (kind, queue, last_seen_at)
    SELECT 'triggerer', q, now() FROM unnest($6::text[]) AS q
    ON CONFLICT (kind, queue) DO UPDATE SET last_seen_at = EXCLUDED.last_seen_at
)
SELECT id FROM t;

-- name: register_triggerer_locked
-- A triggerer announces itself on its own lease connection and, in the same statement, takes
-- the session-level advisory lock (74657202, id) it holds for as long as it lives: its row
-- never becomes visible without the lock held. Lease of $4 seconds on the database clock;
-- $5: the engine's version; $6: the trigger queues it serves.
WITH registered AS (
    INSERT INTO deferral_triggerers
        (hostname, pid, capacity, lease_expires_at, session_locked, version, queues)
    VALUES ($1, $2, $3, now() + make_interval(secs => $4), true, $5, $6::text[])
    RETURNING id
), seen AS (
    INSERT INTO deferral_queues_seen (kind, queue, last_seen_at)
    SELECT 'triggerer', q, now() FROM unnest($6::text[]) AS q
    ON CONFLICT (kind, queue) DO UPDATE SET last_seen_at = EXCLUDED.last_seen_at
)
SELECT id, pg_advisory_lock(74657202, (id % 2147483647)::integer) AS locked FROM registered;

-- name: relock_triggerer
-- A triggerer's lease connection was replaced: take its session lock again (false: held).
SELECT pg_try_advisory_lock(74657202, ($1::bigint % 2147483647)::integer) AS locked;

-- name: unlock_triggerer
-- Let go of a triggerer's session lock (its registration was lost; a new one follows).
SELECT pg_advisory_unlock(74657202, ($1::bigint % 2147483647)::integer) AS unlocked;

-- name: count_owned_triggers
-- How many triggers a triggerer owns now.
SELECT count(*) AS n FROM deferral_triggers WHERE triggerer_id = $1;

-- name: renew_triggerer_lease
-- Extend a triggerer's lease. No row means the lease was lost and its triggers adopted.
-- Also counts the triggers it still owns, so it can notice ones removed under it. Carries the
-- loop's health for the status page (null: unchanged): $3 the p99 of its lag (ms), $4 the
-- blocks seen, $5 the trigger class of the longest block and $6 its length (ms).
-- Its queues are marked as served now (for `deferral tasks why` once it is gone).
WITH t AS (
    UPDATE deferral_triggerers
    SET heartbeat_at = now(), lease_expires_at = now() + make_interval(secs => $2),
        loop_lag_p99_ms = COALESCE($3, loop_lag_p99_ms),
        blocked_loops = COALESCE($4, blocked_loops),
        worst_blocker = COALESCE($5, worst_blocker),
        worst_block_ms = COALESCE($6, worst_block_ms)
    WHERE id = $1
    RETURNING queues
), seen AS (
    UPDATE deferral_queues_seen s SET last_seen_at = now()
    FROM t WHERE s.kind = 'triggerer' AND s.queue = ANY (t.queues)
)
SELECT (SELECT count(*) FROM deferral_triggers WHERE triggerer_id = $1) AS owned FROM t;

-- name: owned_trigger_ids
-- The triggers a triggerer owns now.
SELECT id, fence FROM deferral_triggers WHERE triggerer_id = $1;

-- name: release_triggers
-- Unown some of triggerer $1's triggers (ones it owns but does not run) and wake the others.
WITH released AS (
    UPDATE deferral_triggers SET triggerer_id = NULL
    WHERE id = ANY ($2::bigint[]) AND triggerer_id IS NOT DISTINCT FROM $1  -- see fire_triggers
    RETURNING id
)
SELECT id, pg_notify('deferral_triggers', '') AS notified FROM released;

-- name: release_triggerer
-- A triggerer stops gracefully: its triggers become unowned at once and the others are woken.
WITH released AS (
    UPDATE deferral_triggers SET triggerer_id = NULL WHERE triggerer_id = $1 RETURNING 1
), gone AS (
    DELETE FROM deferral_triggerers WHERE id = $1
)
SELECT count(*) AS released,
       CASE WHEN count(*) > 0 THEN pg_notify('deferral_triggers', '') END AS notified
FROM released;

-- name: reap_triggerers
-- Remove the triggerers that are gone: at once those registered with a session lock
-- (register_triggerer_locked) that no session holds any more (the process died, or its lease
-- connection dropped: PostgreSQL ends the session and its locks the moment the connection
-- closes), and any whose lease expired on the database clock. Cheap when nobody is gone: one
-- read of the lock table, nothing deleted. Returns the ids removed; release_reaped_triggers then
-- frees their triggers, in a statement of its own: a claim_triggers in flight holds the removed
-- row (FOR KEY SHARE) until it commits, so this DELETE waits for it, and only a later statement
-- (a fresh snapshot) sees what that claim took.
WITH locked AS MATERIALIZED (
    SELECT objid FROM pg_locks
    WHERE locktype = 'advisory' AND classid = 74657202 AND objsubid = 2 AND granted
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
)
DELETE FROM deferral_triggerers r
WHERE r.lease_expires_at < now()
   OR (r.session_locked AND (r.id % 2147483647)::oid NOT IN (SELECT objid FROM locked))
RETURNING id;

-- name: release_reaped_triggers
-- Free the triggers of the triggerers reap_triggerers removed ($1) and wake the claimers.
WITH released AS (
    UPDATE deferral_triggers SET triggerer_id = NULL
    WHERE triggerer_id = ANY ($1::bigint[])
    RETURNING 1
)
SELECT count(*) AS triggers,
       CASE WHEN count(*) > 0 THEN pg_notify('deferral_triggers', '') END AS notified
FROM released;

-- name: release_ownerless_triggers
-- The scheduler's backstop: free triggers whose owner is no registered triggerer (a reaper that
-- died between reap_triggerers and release_reaped_triggers leaves such triggers).
WITH released AS (
    UPDATE deferral_triggers t SET triggerer_id = NULL
    WHERE t.triggerer_id IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM deferral_triggerers r WHERE r.id = t.triggerer_id)
    RETURNING 1
)
SELECT count(*) AS triggers,
       CASE WHEN count(*) > 0 THEN pg_notify('deferral_triggers', '') END AS notified
FROM released;

-- name: claim_triggers
-- Claim up to $2 unowned triggers for triggerer $1 in one statement; each claim raises the
-- trigger's fencing token. Returns the database time too, to place deadlines on the loop clock.
-- The claimer's own row is read FOR KEY SHARE: a reap_triggerers removing it waits for this
-- claim to commit (and then frees what it took), or has removed it already (nothing claimed).
WITH me AS MATERIALIZED (
    SELECT id FROM deferral_triggerers
    WHERE id = $1 AND lease_expires_at > now()
    FOR KEY SHARE
), picked AS (
    SELECT id FROM deferral_triggers
    WHERE triggerer_id IS NULL AND EXISTS (SELECT 1 FROM me)
      AND queue = ANY ((SELECT queues FROM deferral_triggerers WHERE id = $1)::text[])
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE deferral_triggers t
SET triggerer_id = $1, fence = t.fence + 1
-- (By an array of ids, not a join with picked: with statistics the planner hashed the picked
-- rows against a sequential scan of every trigger; tests/test_query_plans.py pins this.)
WHERE t.id = ANY (ARRAY(SELECT id FROM picked))
RETURNING t.id, t.classpath, t.kwargs, t.fence, t.timeout_at, now() AS db_now;

-- name: count_unowned_triggers
-- Triggers waiting for a triggerer with room (the backlog).
SELECT count(*) AS n FROM deferral_triggers WHERE triggerer_id IS NULL;

-- name: fire_triggers
-- Write a batch of trigger outcomes in one call of deferral_fire_triggers (migration 0029):
-- lock_owned_triggers, then the fire, each a statement of that function with a snapshot of
-- its own (so that a task that joined a trigger as it fired is seen waiting; later joiners
-- wait for the lock, then find the trigger gone and insert a new one). Each trigger row is
-- deleted only while triggerer $1 still owns it with the fencing token it claimed, and only then are its waiting task instances moved, each by a
-- conditional update on state = 'deferred' AND trigger_id: a duplicate or stale event changes
-- nothing. Outcome kinds (deferral_trigger_outcome): 'event' (resume on a worker),
-- 'success' / 'skipped' (end the task), 'failed' (the retry policy applies). Returns one row
-- per accepted trigger (task columns null) and one per moved task instance. (A UNION ALL, not
-- a join of the two CTEs: the planner estimates one row for each and joins them in a nested
-- loop, quadratic in the batch: over a second of CPU for 1,000 outcomes.) When a task became
-- runnable, the same transaction wakes the workers (woke = 1): no second round trip.
-- Each moved task's try gets a line in its log saying how its wait ended (what the trigger
-- sent, $7: shown masked, null when it sent nothing to show): written here, with the outcome,
-- the line costs the worker nothing, and is there before a worker can claim the resume.
-- One round trip, in no transaction of the caller's: BEGIN, the lock, the fire and COMMIT
-- were four, and cost the triggerer's loop about as much as the fire's arrays and rows.
SELECT * FROM deferral_fire_triggers($1, $2, $3, $4, $5, $6, $7);

-- name: timeout_deferrals
-- End the deferrals that passed their deadline: of the given triggers ($1), or of every
-- trigger when $1 is null and the deadline passed more than $2 seconds ago (the scheduler's
-- backstop). The error names the deadline (deadline_kind, set by defer_tasks).
-- execution_timeout applies the retry policy, as it does on a worker; otherwise soft_fail
-- turns the timeout into skipped, a sensor (no_retry_on_timeout) fails without retries, and
-- the retry policy applies to the rest. Returns what moved, with the trigger each task waited
-- on (its id and classpath, read before the update clears the task's trigger_id).
WITH due AS (
    SELECT ti.id, ti.trigger_id, t.classpath
    FROM deferral_task_instances ti
    LEFT JOIN deferral_triggers t ON t.id = ti.trigger_id
    WHERE ti.state = 'deferred'
      AND (($1::bigint[] IS NULL AND ti.trigger_timeout_at < now() - make_interval(secs => $2))
           OR (ti.trigger_id = ANY ($1::bigint[]) AND ti.trigger_timeout_at <= now()))
    FOR UPDATE OF ti
)
UPDATE deferral_task_instances ti
SET state = CASE WHEN ti.deadline_kind = 'execution_timeout'
                 THEN deferral_fail_state(ti.try_number, ti.retries)
                 WHEN ti.soft_fail THEN 'skipped'
                 WHEN ti.no_retry_on_timeout THEN 'failed'
                 ELSE deferral_fail_state(ti.try_number, ti.retries) END,
    error = CASE ti.deadline_kind
        WHEN 'execution_timeout' THEN format(
            'execution_timeout of %ss passed while deferred (counted from the start of this '
            'try at %s, across deferrals); the trigger had not fired',
            ti.execution_timeout_s, to_char(ti.try_started_at AT TIME ZONE 'UTC',
                                            'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'))
        WHEN 'sensor_timeout' THEN format(
            'sensor timed out after %ss: its timeout of %ss (counted from its first try at %s) '
            'passed while deferred, before the trigger fired; not retried, on purpose: a '
            'sensor''s timeout ends it whatever retries are left (retries are for errors)',
            round(EXTRACT(EPOCH FROM now() - ti.first_try_at)::numeric, 1),
            round(EXTRACT(EPOCH FROM ti.trigger_timeout_at - ti.first_try_at)::numeric, 1),
            to_char(ti.first_try_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'))
        ELSE format('deferral timed out: the trigger did not fire by its deadline %s '
                    '(the timeout given to defer())',
                    to_char(ti.trigger_timeout_at AT TIME ZONE 'UTC',
                            'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')) END,
    run_after = deferral_retry_at(ti.try_number, ti.retry_delay_s,
                                  ti.retry_exponential_backoff, ti.max_retry_delay_s),
    ended_at = now(), trigger_id = NULL, trigger_timeout_at = NULL, deadline_kind = NULL,
    next_method = NULL, next_kwargs = NULL, next_event = NULL
FROM due
WHERE ti.id = due.id AND ti.state = 'deferred'
RETURNING ti.id, ti.dag_run_id, ti.task_id, ti.state, ti.is_leaf, due.trigger_id,
          due.classpath;

-- name: trigger_waiters
-- For each given trigger: how many task instances still wait on it, and the earliest deadline.
SELECT t.id, count(ti.id) AS waiting, min(ti.trigger_timeout_at) AS timeout_at, now() AS db_now
FROM unnest($1::bigint[]) AS t(id)
LEFT JOIN deferral_task_instances ti ON ti.trigger_id = t.id AND ti.state = 'deferred'
GROUP BY t.id;

-- name: lock_owned_triggers
-- Lock triggers before firing or dropping them: a task joining one holds its row until it
-- commits, and the fire's waiter update or the drop's waiter check must run after that, in a
-- statement of its own (a fresh snapshot that sees the joined task). Under READ COMMITTED a check inside the DELETE that waited for
-- the row would still use the snapshot taken before the join and drop a trigger in use.
SELECT id FROM deferral_triggers
WHERE id = ANY ($2::bigint[]) AND triggerer_id IS NOT DISTINCT FROM $1  -- by id: see fire_triggers
ORDER BY id
FOR UPDATE;

-- name: delete_owned_triggers
-- Drop triggers nobody waits on any more, if triggerer $1 still owns them (after
-- lock_owned_triggers, in the same transaction).
DELETE FROM deferral_triggers t
WHERE t.id = ANY ($2::bigint[]) AND t.triggerer_id IS NOT DISTINCT FROM $1  -- see fire_triggers
  AND NOT EXISTS (SELECT 1 FROM deferral_task_instances ti
                  WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
  AND NOT EXISTS (SELECT 1 FROM deferral_deadline_alerts dl WHERE dl.trigger_id = t.id)
  AND NOT EXISTS (SELECT 1 FROM deferral_asset_watchers w WHERE w.trigger_id = t.id)
RETURNING t.id;

-- name: lock_orphan_triggers
-- Lock the triggers that look unused; see lock_owned_triggers for why the check is repeated.
SELECT t.id FROM deferral_triggers t
WHERE t.created_at < now() - make_interval(secs => $1)
  AND NOT EXISTS (SELECT 1 FROM deferral_task_instances ti
                  WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
  AND NOT EXISTS (SELECT 1 FROM deferral_deadline_alerts dl WHERE dl.trigger_id = t.id)
  AND NOT EXISTS (SELECT 1 FROM deferral_asset_watchers w WHERE w.trigger_id = t.id)
ORDER BY t.id
FOR UPDATE OF t;

-- name: delete_orphan_triggers
-- Drop the locked triggers ($1, from lock_orphan_triggers) that no task instance waits on
-- (every waiter timed out or was cleared).
DELETE FROM deferral_triggers t
WHERE t.id = ANY ($1::bigint[])
  AND NOT EXISTS (SELECT 1 FROM deferral_task_instances ti
                  WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
  AND NOT EXISTS (SELECT 1 FROM deferral_deadline_alerts dl WHERE dl.trigger_id = t.id)
  AND NOT EXISTS (SELECT 1 FROM deferral_asset_watchers w WHERE w.trigger_id = t.id)
RETURNING t.id;

-- name: list_triggers
-- Triggers ($1 at most) with their owner, their (encrypted) kwargs, how many task instances
-- wait on each and the first $2 of them (by id).
SELECT t.id, t.classpath, t.kwargs, t.triggerer_id, t.fence, t.timeout_at, t.created_at,
       (SELECT count(*) FROM deferral_task_instances ti
        WHERE ti.trigger_id = t.id AND ti.state = 'deferred') AS waiting,
       (SELECT COALESCE(jsonb_agg(jsonb_build_object(
                   'dag_id', w.dag_id, 'run_id', w.run_id, 'task_id', w.task_id) ORDER BY w.id),
               '[]'::jsonb)
        FROM (SELECT ti.id, ti.dag_id, ti.run_id, ti.task_id FROM deferral_task_instances ti
              WHERE ti.trigger_id = t.id AND ti.state = 'deferred'
              ORDER BY ti.id LIMIT $2) w) AS tasks
FROM deferral_triggers t
ORDER BY t.id
LIMIT $1;

-- name: get_trigger
-- One trigger in full: its owner's host and pid, which deadline its timeout_at is (the
-- waiting task whose deadline is earliest says), and every task instance waiting on it.
SELECT t.id, t.classpath, t.kwargs, t.triggerer_id, t.fence, t.timeout_at, t.created_at,
       r.hostname AS triggerer_hostname, r.pid AS triggerer_pid,
       (SELECT ti.deadline_kind FROM deferral_task_instances ti
        WHERE ti.trigger_id = t.id AND ti.state = 'deferred'
          AND ti.trigger_timeout_at IS NOT NULL
        ORDER BY ti.trigger_timeout_at, ti.id LIMIT 1) AS deadline_kind,
       (SELECT count(*) FROM deferral_task_instances ti
        WHERE ti.trigger_id = t.id AND ti.state = 'deferred') AS waiting,
       (SELECT COALESCE(jsonb_agg(jsonb_build_object(
                   'dag_id', ti.dag_id, 'run_id', ti.run_id, 'task_id', ti.task_id)
                   ORDER BY ti.id), '[]'::jsonb)
        FROM deferral_task_instances ti
        WHERE ti.trigger_id = t.id AND ti.state = 'deferred') AS tasks
FROM deferral_triggers t
LEFT JOIN deferral_triggerers r ON r.id = t.triggerer_id
WHERE t.id = $1;

-- name: list_triggerers
-- Live and expired triggerers, with the number of triggers each owns.
SELECT r.id, r.hostname, r.pid, r.capacity, r.started_at, r.heartbeat_at, r.lease_expires_at,
       r.lease_expires_at < now() AS expired,
       (SELECT count(*) FROM deferral_triggers t WHERE t.triggerer_id = r.id) AS held
FROM deferral_triggerers r ORDER BY r.id;

-- name: reap_zombie_tasks
-- Running task instances whose worker stopped heartbeating $1 seconds ago fail their try
-- (retries apply), and the dead workers' rows go. Silence counts only from when a heartbeat
-- could have arrived: not before the server last started (an outage or restart is not the
-- workers' fault), nor before $2 (when the scheduler's current unbroken contact with the
-- database began, engine/scheduler/contact.py; null: not known).
-- Nothing is reaped when this statement starts more than $4 seconds after the scheduler's
-- last contact $3 (null: no check): the database (or the scheduler) was frozen in between,
-- and this may be the first statement it answers after the freeze, with every heartbeat as
-- old as the freeze.
-- A resume a fire handed to a worker (migration 0033) that no worker read within $5 seconds
-- is not failed: it is given back (state 'scheduled', returned with the reaped rows), under
-- the same rules of silence.
WITH contact AS (
    SELECT $3::timestamptz IS NULL
           OR now() <= $3::timestamptz + make_interval(secs => $4) AS unbroken
), given_back AS (
    -- Resumes a fire handed to a worker that has not read them $5 seconds later (it died, or
    -- missed the notification and its polls): back to 'scheduled', the same try, for any
    -- worker to claim. Its run_after stays when the trigger fired.
    UPDATE deferral_task_instances
    SET state = 'scheduled', worker_id = NULL, handed = false
    WHERE state = 'running' AND handed
      AND GREATEST(heartbeat_at, pg_postmaster_start_time(), $2::timestamptz)
          < now() - make_interval(secs => $5)
      AND (SELECT unbroken FROM contact)
    RETURNING id, dag_run_id, task_id, state, is_leaf, dag_id, run_id, map_index, try_number
), back_logged AS (
    INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                    logger, message)
    SELECT b.dag_id, b.run_id, deferral_ti_name(b.task_id, b.map_index), b.try_number, now(),
           'WARNING', 'log', 'engine.scheduler',
           format('the worker this resume was handed to did not read it within %ss; it is '
                  'runnable again for any worker', $5::double precision)
    FROM given_back b
), zombies AS (
    UPDATE deferral_task_instances
    SET state = deferral_fail_state(try_number, retries),
        run_after = deferral_retry_at(try_number, retry_delay_s, retry_exponential_backoff,
                                      max_retry_delay_s),
        error = format('worker %s stopped heartbeating while running this task', worker_id),
        ended_at = now(), worker_id = NULL, next_method = NULL, next_kwargs = NULL,
        next_event = NULL
    WHERE state = 'running' AND NOT handed
      AND GREATEST(heartbeat_at, pg_postmaster_start_time(), $2::timestamptz)
          < now() - make_interval(secs => $1)
      AND (SELECT unbroken FROM contact)
    RETURNING id, dag_run_id, task_id, state, is_leaf
), dead AS (
    DELETE FROM deferral_workers
    WHERE GREATEST(heartbeat_at, pg_postmaster_start_time(), $2::timestamptz)
          < now() - make_interval(secs => $1)
      AND (SELECT unbroken FROM contact)
)
SELECT * FROM zombies
UNION ALL
SELECT b.id, b.dag_run_id, b.task_id, b.state, b.is_leaf FROM given_back b;

-- name: rotation_triggers
-- A batch of stored triggers for `deferral keys rotate`: up to $2 rows with id above $1.
SELECT id, kwargs FROM deferral_triggers WHERE id > $1 ORDER BY id LIMIT $2;

-- name: rotate_trigger_kwargs
-- Store re-encrypted kwargs, each only if the row still holds the ciphertext that was read
-- (a row changed meanwhile is left as it is; the next rotation sees it). Returns what changed.
UPDATE deferral_triggers t SET kwargs = o.new
FROM unnest($1::bigint[], $2::bytea[], $3::bytea[]) AS o(id, old, new)
WHERE t.id = o.id AND t.kwargs = o.old
RETURNING t.id;

-- name: rotation_task_instances
-- A batch of task instances that hold encrypted columns, for `deferral keys rotate`: up to
-- $2 rows with id above $1.
SELECT id, next_kwargs, next_event, result FROM deferral_task_instances
WHERE id > $1 AND (next_kwargs IS NOT NULL OR next_event IS NOT NULL OR result IS NOT NULL)
ORDER BY id LIMIT $2;

-- name: rotate_task_values
-- Store re-encrypted next_kwargs, next_event and result, each column only if it still holds
-- the value that was read ($2/$4/$6 old, $3/$5/$7 new; a null old value leaves the column
-- alone).
-- Returns, for each row where some column changed, how many columns it rewrote.
UPDATE deferral_task_instances ti
SET next_kwargs = CASE WHEN ti.next_kwargs = o.old_kwargs THEN o.new_kwargs
                       ELSE ti.next_kwargs END,
    next_event = CASE WHEN ti.next_event = o.old_event THEN o.new_event ELSE ti.next_event END,
    result = CASE WHEN ti.result = o.old_result THEN o.new_result ELSE ti.result END
FROM unnest($1::bigint[], $2::bytea[], $3::bytea[], $4::bytea[], $5::bytea[], $6::bytea[],
            $7::bytea[]) AS o(id, old_kwargs, new_kwargs, old_event, new_event, old_result,
                              new_result)
WHERE ti.id = o.id
  AND (ti.next_kwargs = o.old_kwargs OR ti.next_event = o.old_event OR ti.result = o.old_result)
RETURNING ti.id,
          (o.new_kwargs IS NOT NULL AND ti.next_kwargs IS NOT DISTINCT FROM o.new_kwargs)::int
          + (o.new_event IS NOT NULL AND ti.next_event IS NOT DISTINCT FROM o.new_event)::int
          + (o.new_result IS NOT NULL AND ti.result IS NOT DISTINCT FROM o.new_result)::int
          AS rewritten;

-- name: count_dags
-- How many DAGs are recorded.
SELECT count(*) AS n FROM deferral_dags;

-- name: schedule_delays
-- Seconds from interval end to creation of the scheduled runs whose interval ended in
-- [$1, $2) (the schedule benchmark; Airflow's dagrun.schedule_delay).
SELECT EXTRACT(EPOCH FROM created_at - data_interval_end)::double precision AS delay
FROM deferral_dag_runs
WHERE run_type = 'scheduled' AND data_interval_end >= $1 AND data_interval_end < $2
ORDER BY delay;

-- ---------------------------------------------------------------------------------------------
-- The schedulers' registry and the status page (deferral webserver, engine/web/). Read-only
-- queries, except the page's actions (each also writes deferral_audit); none is on a hot path.

-- name: register_scheduler
-- A scheduler announces itself ($4: the engine's version).
INSERT INTO deferral_schedulers (hostname, pid, version) VALUES ($1, $2, $3) RETURNING id;

-- name: heartbeat_scheduler
-- A scheduler's housekeeping pass keeps its row (and inserts it again if it was removed, as
-- $2-$4 say), and drops the rows of schedulers silent for an hour (killed ones). Returns its id.
WITH gone AS (
    DELETE FROM deferral_schedulers
    WHERE heartbeat_at < now() - interval '1 hour' AND id <> $1
), kept AS (
    UPDATE deferral_schedulers SET heartbeat_at = now() WHERE id = $1 RETURNING id
), added AS (
    INSERT INTO deferral_schedulers (hostname, pid, version)
    SELECT $2, $3, $4 WHERE NOT EXISTS (SELECT 1 FROM kept)
    RETURNING id
)
SELECT id FROM kept UNION ALL SELECT id FROM added;

-- name: unregister_scheduler
-- A scheduler leaves after a graceful stop.
DELETE FROM deferral_schedulers WHERE id = $1;

-- name: fleet_schedulers
-- Every registered scheduler, with its heartbeat age on the database clock.
SELECT id, hostname, pid, version, started_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_s
FROM deferral_schedulers ORDER BY id;

-- name: fleet_workers
-- Every registered worker, with its heartbeat age and the slots it uses now (its running tries,
-- and the tries it was told to stop that have not stopped yet).
SELECT w.id, w.hostname, w.pid, w.version, w.slots, w.started_at, w.heartbeat_at,
       extract(epoch FROM now() - w.heartbeat_at)::float8 AS heartbeat_age_s,
       ((SELECT count(*) FROM deferral_task_instances ti
         WHERE ti.worker_id = w.id AND ti.state = 'running')
        + (SELECT count(*) FROM deferral_stopping_tries s WHERE s.worker_id = w.id))::int
           AS running
FROM deferral_workers w ORDER BY w.id;

-- name: fleet_triggerers
-- Every registered triggerer, with its heartbeat age, the triggers it holds and the health of
-- its event loop (written with its lease renewals).
SELECT r.id, r.hostname, r.pid, r.version, r.capacity, r.started_at, r.heartbeat_at,
       extract(epoch FROM now() - r.heartbeat_at)::float8 AS heartbeat_age_s,
       r.lease_expires_at < now() AS expired,
       (SELECT count(*) FROM deferral_triggers t WHERE t.triggerer_id = r.id)::int AS held,
       r.loop_lag_p99_ms, r.blocked_loops, r.worst_blocker, r.worst_block_ms
FROM deferral_triggerers r ORDER BY r.id;

-- name: fleet_backlog
-- What waits for the fleet: task instances runnable now that no worker claimed yet, and
-- triggers that no triggerer holds.
SELECT (SELECT count(*) FROM deferral_task_instances
        WHERE state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
          AND run_after <= now())::int AS runnable,
       (SELECT count(*) FROM deferral_triggers WHERE triggerer_id IS NULL)::int
           AS unowned_triggers;

-- name: dags_overview
-- Every known DAG with its task count, schedule, paused flag, next scheduled run, and its latest
-- runs (newest first, by logical date as the grid shows them, up to $1 of them: run id and
-- state); those whose id holds $2 or with a tag $2 (any case; null: all), whose latest run is
-- in state $3 (null: any) and paused or not as $4 says (null: either).
SELECT d.dag_id, d.fileloc, jsonb_array_length(d.tasks) AS tasks, d.description, d.updated_at,
       d.schedule, d.is_paused, d.next_dagrun, d.next_dagrun_create_after, d.is_active,
       COALESCE((SELECT jsonb_agg(jsonb_build_object('run_id', r.run_id, 'state', r.state)
                                  ORDER BY r.logical_date DESC, r.id DESC)
                 FROM (SELECT id, run_id, state, logical_date FROM deferral_dag_runs
                       WHERE dag_id = d.dag_id ORDER BY logical_date DESC, id DESC
                       LIMIT $1) r),
                '[]'::jsonb) AS last_runs
FROM deferral_dags d
WHERE ($2::text IS NULL OR strpos(lower(d.dag_id), lower($2)) > 0
       OR lower($2) = ANY (SELECT lower(tag) FROM unnest(d.tags) tag))
  AND ($3::text IS NULL
       OR $3 = (SELECT state FROM deferral_dag_runs
                WHERE dag_id = d.dag_id ORDER BY logical_date DESC, id DESC LIMIT 1))
  AND ($4::boolean IS NULL OR d.is_paused = $4)
ORDER BY d.dag_id;

-- name: run_task_grid
-- The task instances of one run, for the run's grid: state, try, times and duration; those in
-- state $2 only (NULL: all), a page of them ($3 rows, NULL: all, after skipping $4).
SELECT ti.id, ti.task_id, ti.state, ti.try_number, ti.first_try_at, ti.started_at, ti.ended_at,
       extract(epoch FROM COALESCE(ti.ended_at, now()) - ti.started_at)::float8 AS duration_s,
       ti.trigger_id, ti.upstream, ti.map_index
FROM deferral_task_instances ti
WHERE ti.dag_run_id = $1 AND ($2::text IS NULL OR ti.state = $2)
ORDER BY ti.id
LIMIT $3 OFFSET $4;

-- name: run_task_counts
-- How many task instances of one run are in each state.
SELECT state, count(*)::int AS n
FROM deferral_task_instances
WHERE dag_run_id = $1
GROUP BY state;

-- name: task_try
-- One task instance by DAG, run and name (its task id; TASK[i] for a mapped instance,
-- deferral_ti_name), with its trigger and the triggerer holding it, and what its templated
-- fields rendered to.
-- (next_kwargs, result and the trigger's kwargs are encrypted: the store opens them.)
SELECT ti.id, ti.dag_run_id, ti.dag_id, ti.run_id, ti.task_id, ti.state, ti.try_number,
       ti.retries, ti.priority, ti.pool, ti.trigger_rule, ti.upstream, ti.worker_id,
       ti.run_after, ti.first_try_at, ti.try_started_at, ti.started_at, ti.ended_at,
       ti.heartbeat_at, ti.execution_timeout_s, ti.next_method, ti.next_kwargs, ti.result,
       ti.error, ti.trigger_id, ti.trigger_timeout_at, ti.deadline_kind,
       t.classpath AS trigger_classpath, t.kwargs AS trigger_kwargs,
       t.triggerer_id, t.created_at AS trigger_created_at,
       tr.hostname AS triggerer_hostname, tr.pid AS triggerer_pid,
       now() AS db_now, ti.rendered_fields, ti.map_index
FROM deferral_task_instances ti
LEFT JOIN deferral_triggers t ON t.id = ti.trigger_id AND ti.state = 'deferred'
LEFT JOIN deferral_triggerers tr ON tr.id = t.triggerer_id
WHERE ti.dag_run_id = (SELECT r.id FROM deferral_dag_runs r WHERE r.dag_id = $1 AND r.run_id = $2)
  AND deferral_ti_name(ti.task_id, ti.map_index) = $3;

-- name: triggers_page
-- Triggers with their owner, waiters and age, filtered by classpath substring ($1), owner ($2;
-- 0: unowned) and minimum age in seconds ($3); oldest first, up to $4.
SELECT t.id, t.classpath, t.triggerer_id, tr.hostname AS triggerer_hostname,
       tr.pid AS triggerer_pid, t.timeout_at, t.created_at,
       extract(epoch FROM now() - t.created_at)::float8 AS age_s,
       (SELECT count(*) FROM deferral_task_instances ti
        WHERE ti.trigger_id = t.id AND ti.state = 'deferred')::int AS waiting
FROM deferral_triggers t
LEFT JOIN deferral_triggerers tr ON tr.id = t.triggerer_id
WHERE ($1::text IS NULL OR strpos(t.classpath, $1) > 0)
  AND ($2::bigint IS NULL OR t.triggerer_id IS NOT DISTINCT FROM NULLIF($2, 0))
  AND ($3::float8 IS NULL OR t.created_at <= now() - make_interval(secs => $3))
ORDER BY t.created_at, t.id
LIMIT $4;

-- name: oldest_waits
-- The $1 deferred task instances that have waited longest (on their trigger's age), with the
-- trigger's class and owner.
SELECT ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.try_number, ti.trigger_id,
       ti.trigger_timeout_at, t.classpath, t.triggerer_id, t.created_at AS waiting_since,
       extract(epoch FROM now() - t.created_at)::float8 AS age_s
FROM deferral_task_instances ti
JOIN deferral_triggers t ON t.id = ti.trigger_id
WHERE ti.state = 'deferred'
ORDER BY t.created_at, ti.id
LIMIT $1;

-- name: dag_runs_page
-- A page of DAG $1's runs for its grid, newest first (logical date, then id), filtered by
-- state ($2, null: any), run type ($3) and logical date in [$4, $5) (null: unbounded); $6 rows
-- after skipping $7. (The bounds as COALESCEs, not "IS NULL OR": every plan reads the range
-- from deferral_dag_runs_dag_date, also a generic one.)
SELECT r.id, r.dag_id, r.run_id, r.run_type, r.state, r.logical_date, r.data_interval_start,
       r.data_interval_end, r.created_at, r.started_at, r.ended_at
FROM deferral_dag_runs r
WHERE r.dag_id = $1 AND ($2::text IS NULL OR r.state = $2)
  AND ($3::text IS NULL OR r.run_type = $3)
  AND r.logical_date >= COALESCE($4::timestamptz, '-infinity')
  AND r.logical_date < COALESCE($5::timestamptz, 'infinity')
ORDER BY r.logical_date DESC, r.id DESC
LIMIT $6 OFFSET $7;

-- name: count_dag_runs
-- How many runs dag_runs_page can page through (the same filters).
SELECT count(*)::int AS n
FROM deferral_dag_runs r
WHERE r.dag_id = $1 AND ($2::text IS NULL OR r.state = $2)
  AND ($3::text IS NULL OR r.run_type = $3)
  AND r.logical_date >= COALESCE($4::timestamptz, '-infinity')
  AND r.logical_date < COALESCE($5::timestamptz, 'infinity');

-- name: runs_page
-- A page of every DAG's runs, newest first, filtered by state ($1), run type ($2) and logical
-- date in [$3, $4) as dag_runs_page; $5 rows after skipping $6.
SELECT r.id, r.dag_id, r.run_id, r.run_type, r.state, r.logical_date, r.data_interval_start,
       r.data_interval_end, r.created_at, r.started_at, r.ended_at
FROM deferral_dag_runs r
WHERE ($1::text IS NULL OR r.state = $1) AND ($2::text IS NULL OR r.run_type = $2)
  AND r.logical_date >= COALESCE($3::timestamptz, '-infinity')
  AND r.logical_date < COALESCE($4::timestamptz, 'infinity')
ORDER BY r.logical_date DESC, r.id DESC
LIMIT $5 OFFSET $6;

-- name: count_runs
-- How many runs runs_page can page through.
SELECT count(*)::int AS n
FROM deferral_dag_runs r
WHERE ($1::text IS NULL OR r.state = $1) AND ($2::text IS NULL OR r.run_type = $2)
  AND r.logical_date >= COALESCE($3::timestamptz, '-infinity')
  AND r.logical_date < COALESCE($4::timestamptz, 'infinity');

-- name: grid_cells
-- The grid's cells: for runs $1, the task instances of each task (of tasks $2 only; null:
-- all), one row per run and task with how many are in each state and the latest try. Grouped
-- by run and task, not one row per task instance: the instances of a mapped task (a map index
-- beside the task id) are one cell with their counts.
SELECT c.dag_run_id, c.task_id, sum(c.n)::int AS instances,
       jsonb_object_agg(c.state, c.n) AS states, max(c.try_number) AS try_number
FROM (
    SELECT ti.dag_run_id, ti.task_id, ti.state, count(*)::int AS n,
           max(ti.try_number) AS try_number
    FROM deferral_task_instances ti
    WHERE ti.dag_run_id = ANY ($1::bigint[])
      AND ($2::text[] IS NULL OR ti.task_id = ANY ($2::text[]))
    GROUP BY ti.dag_run_id, ti.task_id, ti.state
) c
GROUP BY c.dag_run_id, c.task_id;

-- name: task_tries
-- Every recorded try of one task instance ($1 DAG, $2 run, $3 its name: TASK[i] for a mapped
-- instance), oldest first: those kept
-- in deferral_task_tries and its current one (current: true; started: false when it was
-- cleared and not claimed since, and holds nothing of a try), with the database's now.
SELECT k.try_number, k.state, k.queued_at, k.started_at, k.resumed_at, k.deferred_at,
       k.fired_at, k.ended_at, k.error, k.rendered_fields, false AS current, true AS started,
       NULL::timestamptz AS run_after, now() AS db_now
FROM deferral_task_tries k
WHERE k.dag_id = $1 AND k.run_id = $2 AND k.task_id = $3
UNION ALL
SELECT ti.try_number, ti.state, ti.try_queued_at, ti.try_started_at, ti.started_at,
       ti.deferred_at, ti.fired_at, ti.ended_at, ti.error, ti.rendered_fields, true,
       ti.first_try_at IS NOT NULL, ti.run_after, now()
FROM deferral_task_instances ti
WHERE ti.dag_run_id = (SELECT r.id FROM deferral_dag_runs r WHERE r.dag_id = $1 AND r.run_id = $2)
  AND deferral_ti_name(ti.task_id, ti.map_index) = $3
ORDER BY 1, 11;

-- name: run_tries
-- The tries of a page of one run's task instances (run $1: DAG $2, run id $3; $4 task
-- instances in the DAG's order after skipping $5) for its Gantt view, as task_tries: the
-- kept ones and the current one of each; task_id is the name (TASK[i] for a mapped instance).
WITH page AS (
    SELECT ti.id, deferral_ti_name(ti.task_id, ti.map_index) AS task_id, ti.try_number, ti.state, ti.try_queued_at, ti.try_started_at,
           ti.started_at, ti.deferred_at, ti.fired_at, ti.ended_at, ti.first_try_at,
           ti.run_after
    FROM deferral_task_instances ti
    WHERE ti.dag_run_id = $1
    ORDER BY ti.id
    LIMIT $4 OFFSET $5
)
SELECT p.id AS ti_id, p.task_id, k.try_number, k.state, k.queued_at, k.started_at,
       k.resumed_at, k.deferred_at, k.fired_at, k.ended_at, false AS current, true AS started,
       NULL::timestamptz AS run_after, now() AS db_now
FROM page p
JOIN deferral_task_tries k ON k.dag_id = $2 AND k.run_id = $3 AND k.task_id = p.task_id
UNION ALL
SELECT p.id, p.task_id, p.try_number, p.state, p.try_queued_at, p.try_started_at,
       p.started_at, p.deferred_at, p.fired_at, p.ended_at, true, p.first_try_at IS NOT NULL,
       p.run_after, now()
FROM page p
ORDER BY 1, 3, 11;

-- name: trigger_groups
-- The triggers by class and owner (null: unowned): how many, how many tasks wait on them, and
-- since when the oldest waits (its trigger's creation). The page sums them by class and by
-- triggerer. (The waiting tasks counted in one read of the deferred ones, not a look-up per
-- trigger.)
WITH waits AS (
    SELECT ti.trigger_id, count(*) AS n FROM deferral_task_instances ti
    WHERE ti.state = 'deferred'
    GROUP BY ti.trigger_id
)
SELECT t.classpath, t.triggerer_id, count(*)::int AS triggers,
       COALESCE(sum(w.n), 0)::int AS waiting, min(t.created_at) AS oldest_since,
       extract(epoch FROM now() - min(t.created_at))::float8 AS oldest_age_s
FROM deferral_triggers t
LEFT JOIN waits w ON w.trigger_id = t.id
GROUP BY t.classpath, t.triggerer_id
ORDER BY t.classpath, t.triggerer_id NULLS FIRST;

-- name: pool_tasks
-- A page of the task instances pool $1 holds or will admit, in states $2 (due ones only when
-- $3: runnable tasks waiting for admission), highest priority first as admission reads them;
-- $4 rows after skipping $5.
SELECT ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.state, ti.try_number, ti.pool_slots,
       ti.priority, ti.run_after, ti.started_at, ti.worker_id, ti.trigger_id
FROM deferral_task_instances ti
WHERE ti.pool = $1 AND ti.state = ANY ($2::text[]) AND (NOT $3 OR ti.run_after <= now())
ORDER BY ti.priority DESC, ti.run_after, ti.id
LIMIT $4 OFFSET $5;

-- name: count_pool_tasks
-- How many task instances pool_tasks can page through.
SELECT count(*)::int AS n
FROM deferral_task_instances ti
WHERE ti.pool = $1 AND ti.state = ANY ($2::text[]) AND (NOT $3 OR ti.run_after <= now());

-- name: clear_tasks
-- Clear task instances $1 ($2 who did it, $3 how), as Airflow's clear: each runs again. The
-- try number is kept (the next claim counts it up) and the retries start again (retries become
-- the DAG's retries for the task past the tries made); its wait, result and error go. A task
-- without upstreams (or whose rule is 'always') is scheduled, the others pending (the caller
-- resolves them by their trigger rules: a task whose upstream failed does not run). A running
-- try is told to stop as mark_tasks tells it, and no new try of the task starts until it has
-- stopped; a deferred task leaves its trigger; its XComs go; an audit row and a line in the
-- log of its latest try; its run runs again if it had ended. Returns one row per task instance
-- cleared.
WITH old AS (
    SELECT ti.id, ti.dag_run_id, ti.state, ti.worker_id, ti.try_number, ti.trigger_id, ti.pool,
           ti.pool_slots, ti.dag_id, ti.run_id, ti.task_id,
           deferral_ti_name(ti.task_id, ti.map_index) AS name, ti.map_index,
           ti.max_active_tis_per_dag,
           ti.try_queued_at, ti.try_started_at, ti.started_at, ti.deferred_at, ti.fired_at,
           ti.ended_at, ti.error, ti.rendered_fields, ti.first_try_at
    FROM deferral_task_instances ti
    WHERE ti.id = ANY ($1::bigint[])
    ORDER BY ti.id
    FOR UPDATE
), archived AS (
    -- the cleared try as it stood, for its page (the next claim starts a new try). Not a try
    -- cleared before and not claimed since (first_try_at goes with a clear and comes back
    -- with a claim): that one was kept by the first clear, and holds nothing of its own now.
    INSERT INTO deferral_task_tries (dag_id, run_id, task_id, try_number, state, queued_at,
                                     started_at, resumed_at, deferred_at, fired_at, ended_at,
                                     error, rendered_fields)
    SELECT o.dag_id, o.run_id, o.name, o.try_number, o.state, o.try_queued_at,
           o.try_started_at, o.started_at, o.deferred_at, o.fired_at,
           COALESCE(o.ended_at, now()), o.error, o.rendered_fields
    FROM old o
    WHERE o.try_number > 0 AND o.first_try_at IS NOT NULL
    ON CONFLICT DO NOTHING
), cleared AS (
    UPDATE deferral_task_instances ti
    SET state = CASE WHEN cardinality(ti.upstream) = 0 OR ti.trigger_rule = 'always'
                     THEN 'scheduled' ELSE 'pending' END,
        run_after = now(), worker_id = NULL, heartbeat_at = NULL,
        trigger_id = NULL, trigger_timeout_at = NULL, deadline_kind = NULL,
        next_method = NULL, next_kwargs = NULL, next_event = NULL, result = NULL,
        error = NULL, ended_at = NULL, first_try_at = NULL,
        -- (a mapped instance reads its value again: its upstream may have changed)
        map_value = NULL,
        retries = ti.try_number + COALESCE(
            (SELECT (task ->> 'retries')::int
             FROM deferral_dags d, jsonb_array_elements(d.tasks) task
             WHERE d.dag_id = ti.dag_id AND task ->> 'task_id' = ti.task_id
             LIMIT 1),
            GREATEST(ti.retries - ti.try_number, 0))
    FROM old o
    WHERE ti.id = o.id
    RETURNING ti.id, ti.dag_run_id, ti.task_id, ti.state, ti.is_leaf
), live AS (
    -- the workers of the running tries, kept from going until this commits (a worker reaped
    -- meanwhile took its tries with it: nothing is left to stop)
    SELECT w.id FROM deferral_workers w
    WHERE w.id IN (SELECT o.worker_id FROM old o WHERE o.state IN ('running', 'queued'))
    FOR KEY SHARE
), stopping AS (
    INSERT INTO deferral_stopping_tries (ti_id, try_number, worker_id, pool, pool_slots, dag_id,
                                         task_id, max_active_tis_per_dag, reason)
    SELECT o.id, o.try_number, o.worker_id, o.pool, o.pool_slots, o.dag_id, o.task_id,
           o.max_active_tis_per_dag, format('cleared by %s from %s', $2::text, $3::text)
    FROM old o JOIN live ON live.id = o.worker_id
    WHERE o.state IN ('running', 'queued')
    ON CONFLICT DO NOTHING
    RETURNING ti_id, worker_id
), told AS (
    -- a wake-up for each worker told to stop a try (its heartbeat is the backstop)
    SELECT pg_notify('deferral_stop', s.worker_id::text)
    FROM (SELECT DISTINCT stopping.worker_id FROM stopping) s
), audited AS (
    INSERT INTO deferral_audit (who, action, target, detail)
    SELECT $2::text, 'clear', o.dag_id || '/' || o.run_id || '/' || o.name,
           jsonb_strip_nulls(jsonb_build_object(
               'ti', o.id, 'try', o.try_number, 'was', o.state, 'via', $3::text,
               'stopping_worker', s.worker_id, 'left_trigger', o.trigger_id))
    FROM old o LEFT JOIN stopping s ON s.ti_id = o.id
), logged AS (
    -- a line in the log of the try it happened to (the latest)
    INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                    logger, message)
    SELECT o.dag_id, o.run_id, o.name, o.try_number, now(), 'WARNING', 'log',
           'deferral.override',
           format('cleared by %s from %s', $2::text, $3::text) || CASE
               WHEN s.worker_id IS NOT NULL
               THEN format(' (was %s on worker %s: told to stop the try)', o.state, s.worker_id)
               WHEN o.trigger_id IS NOT NULL
               THEN format(' (was %s on trigger %s: left it)', o.state, o.trigger_id)
               ELSE format(' (was %s)', o.state) END
    FROM old o LEFT JOIN stopping s ON s.ti_id = o.id
), reopened AS (
    -- its run runs again if it had ended, to end anew. (Its row is written, and so locked,
    -- even while running: a scheduler ending the run meanwhile waits for this to commit, then
    -- looks again: finish_dag_runs.)
    UPDATE deferral_dag_runs r SET state = 'running', ended_at = NULL
    WHERE r.id IN (SELECT o.dag_run_id FROM old o)
), forgotten AS (
    -- the XComs it pushed go with the try (its return value, the result, went above): the
    -- next try starts with none, and nothing reads a cleared try's values meanwhile
    DELETE FROM deferral_xcom x USING old o WHERE x.ti_id = o.id
)
SELECT c.id, c.dag_run_id, c.task_id, c.state, c.is_leaf, o.dag_id, o.run_id,
       o.state AS was, o.try_number, s.worker_id AS stopping_worker_id,
       o.trigger_id AS left_trigger_id, o.map_index, (SELECT count(*) FROM told) AS told
FROM cleared c
JOIN old o ON o.id = c.id
LEFT JOIN stopping s ON s.ti_id = c.id
ORDER BY c.id;

-- name: mark_tasks
-- Mark task instances $1 as $2 ('success', 'failed' or 'skipped') whatever they were doing; $3
-- who did it, $4 how (e.g. 'the status page'). In one statement, per task instance not
-- already in state $2:
-- * it ends in state $2 (failed: with the error "marked failed by <who> from <how>");
-- * a running try is told to stop: recorded in deferral_stopping_tries until its worker
--   reports it gone (it keeps counting in its pool and limits meanwhile), its worker woken on
--   deferral_stop (payload: the worker id); the try's own outcome is refused from now on (it
--   no longer holds the task);
-- * a deferred task leaves its trigger (its event, should it come, moves nothing; the caller
--   drops the trigger if nobody else waits on it: lock_left_triggers, delete_orphan_triggers);
-- * an audit row, and a line in the log of its latest try;
-- * its run runs again if it had ended, to end anew.
-- Returns one row per task instance changed (the caller settles the downstream tasks).
WITH old AS (
    SELECT ti.id, ti.dag_run_id, ti.state, ti.worker_id, ti.try_number, ti.trigger_id, ti.pool,
           ti.pool_slots, ti.dag_id, ti.run_id, ti.task_id,
           deferral_ti_name(ti.task_id, ti.map_index) AS name, ti.map_index,
           ti.max_active_tis_per_dag
    FROM deferral_task_instances ti
    WHERE ti.id = ANY ($1::bigint[]) AND ti.state <> $2
    ORDER BY ti.id
    FOR UPDATE
), marked AS (
    UPDATE deferral_task_instances ti
    SET state = $2::deferral_task_outcome, ended_at = now(),
        started_at = COALESCE(ti.started_at, now()),
        worker_id = NULL, trigger_id = NULL, trigger_timeout_at = NULL, deadline_kind = NULL,
        next_method = NULL, next_kwargs = NULL, next_event = NULL,
        error = CASE WHEN $2 = 'failed'
                     THEN format('marked failed by %s from %s', $3::text, $4::text) END
    FROM old o
    WHERE ti.id = o.id
    RETURNING ti.id, ti.dag_run_id, ti.task_id, ti.state, ti.is_leaf
), live AS (
    -- the workers of the running tries, kept from going until this commits (a worker reaped
    -- meanwhile took its tries with it: nothing is left to stop)
    SELECT w.id FROM deferral_workers w
    WHERE w.id IN (SELECT o.worker_id FROM old o WHERE o.state IN ('running', 'queued'))
    FOR KEY SHARE
), stopping AS (
    INSERT INTO deferral_stopping_tries (ti_id, try_number, worker_id, pool, pool_slots, dag_id,
                                         task_id, max_active_tis_per_dag, reason)
    SELECT o.id, o.try_number, o.worker_id, o.pool, o.pool_slots, o.dag_id, o.task_id,
           o.max_active_tis_per_dag,
           format('marked %s by %s from %s', $2::text, $3::text, $4::text)
    FROM old o JOIN live ON live.id = o.worker_id
    WHERE o.state IN ('running', 'queued')
    ON CONFLICT DO NOTHING
    RETURNING ti_id, worker_id
), told AS (
    -- a wake-up for each worker told to stop a try (its heartbeat is the backstop)
    SELECT pg_notify('deferral_stop', s.worker_id::text)
    FROM (SELECT DISTINCT stopping.worker_id FROM stopping) s
), audited AS (
    INSERT INTO deferral_audit (who, action, target, detail)
    SELECT $3::text, 'mark_' || $2::text, o.dag_id || '/' || o.run_id || '/' || o.name,
           jsonb_strip_nulls(jsonb_build_object(
               'ti', o.id, 'try', o.try_number, 'was', o.state, 'via', $4::text,
               'stopping_worker', s.worker_id, 'left_trigger', o.trigger_id))
    FROM old o LEFT JOIN stopping s ON s.ti_id = o.id
), logged AS (
    -- a line in the log of the try it happened to (the latest)
    INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                    logger, message)
    SELECT o.dag_id, o.run_id, o.name, o.try_number, now(), 'WARNING', 'log',
           'deferral.override',
           format('marked %s by %s from %s', $2::text, $3::text, $4::text) || CASE
               WHEN s.worker_id IS NOT NULL
               THEN format(' (was %s on worker %s: told to stop the try)', o.state, s.worker_id)
               WHEN o.trigger_id IS NOT NULL
               THEN format(' (was %s on trigger %s: left it)', o.state, o.trigger_id)
               ELSE format(' (was %s)', o.state) END
    FROM old o LEFT JOIN stopping s ON s.ti_id = o.id
), reopened AS (
    -- its run runs again if it had ended, to end anew. (Its row is written, and so locked,
    -- even while running: a scheduler ending the run meanwhile waits for this to commit, then
    -- looks again: finish_dag_runs.)
    UPDATE deferral_dag_runs r SET state = 'running', ended_at = NULL
    WHERE r.id IN (SELECT o.dag_run_id FROM old o)
)
SELECT c.id, c.dag_run_id, c.task_id, c.state, c.is_leaf, o.dag_id, o.run_id,
       o.state AS was, o.try_number, s.worker_id AS stopping_worker_id,
       o.trigger_id AS left_trigger_id, o.map_index, (SELECT count(*) FROM told) AS told
FROM marked c
JOIN old o ON o.id = c.id
LEFT JOIN stopping s ON s.ti_id = c.id
ORDER BY c.id;

-- name: override_targets
-- The task instances of run $1 (its primary key) that a clear or a mark of tasks $2 (null: every
-- task of the run) reaches: those tasks (with $6, one map index per task of $2: only that
-- instance of a mapped task; -1: every instance); with $3 their downstream tasks, transitively
-- (along the upstream lists), whole; with $4 their upstream tasks, transitively, whole; $5:
-- only those failed or upstream_failed. relation says why each is in: 'task', 'downstream' or
-- 'upstream'.
WITH RECURSIVE tis AS (
    SELECT ti.id, ti.task_id, ti.map_index, ti.upstream, ti.state, ti.try_number
    FROM deferral_task_instances ti
    WHERE ti.dag_run_id = $1
), named AS (
    SELECT * FROM unnest($2::text[], $6::integer[]) AS n(task_id, map_index)
), roots AS (
    SELECT DISTINCT t.task_id FROM tis t WHERE $2::text[] IS NULL OR t.task_id = ANY ($2::text[])
), chosen AS (
    SELECT t.id FROM tis t
    WHERE $2::text[] IS NULL
       OR EXISTS (SELECT 1 FROM named n WHERE n.task_id = t.task_id
                  AND (n.map_index IS NULL OR n.map_index < 0 OR n.map_index = t.map_index))
), down (task_id) AS (
    SELECT t.task_id FROM tis t JOIN roots r ON r.task_id = ANY (t.upstream) WHERE $3::boolean
    UNION
    SELECT t.task_id FROM tis t JOIN down d ON d.task_id = ANY (t.upstream)
), up (task_id) AS (
    SELECT u.task_id FROM roots r JOIN tis t ON t.task_id = r.task_id
    CROSS JOIN LATERAL unnest(t.upstream) AS u(task_id)
    WHERE $4::boolean
    UNION
    SELECT u.task_id FROM up JOIN tis t ON t.task_id = up.task_id
    CROSS JOIN LATERAL unnest(t.upstream) AS u(task_id)
)
SELECT t.id, t.task_id, t.map_index, t.state, t.try_number,
       CASE WHEN t.id IN (SELECT id FROM chosen) THEN 'task'
            WHEN t.task_id IN (SELECT task_id FROM down) THEN 'downstream'
            ELSE 'upstream' END AS relation
FROM tis t
WHERE (t.id IN (SELECT id FROM chosen)
       OR t.task_id IN (SELECT task_id FROM down)
       OR t.task_id IN (SELECT task_id FROM up))
  AND (NOT $5::boolean OR t.state IN ('failed', 'upstream_failed'))
ORDER BY t.task_id, t.map_index, t.id;
-- name: run_task_ids
-- The task ids of run $1 (its primary key).
SELECT DISTINCT task_id FROM deferral_task_instances WHERE dag_run_id = $1 ORDER BY task_id;

-- name: run_state
-- The state of run $1 (its primary key), as a mark of the whole run finds it. Not locked: the
-- mark locks the run's row last (by writing it), after its triggers and task instances, in
-- the order a clear or a mark of tasks takes them; locking it first could deadlock with one.
SELECT r.state FROM deferral_dag_runs r WHERE r.id = $1;

-- name: collapse_cleared_mapped
-- After clear_tasks of task instances $1, in the same transaction: a mapped task every instance
-- of which was cleared (none of them still stopping a running try) goes back to one
-- unexpanded instance (map index -1, its instance 0's row), so that it expands again over what
-- its upstream returns by then, as many instances as there are values (the upstream's list
-- may have changed length). The other instances' rows go (their tries, archived by the clear,
-- stay). The instance's try number becomes the highest of them: every new instance's tries
-- number on from the tries made before. The callback requests not run yet that name a removed
-- instance (its own callbacks, a DAG callback naming it for its context) name the instance
-- left instead: a request's row would go with its instance's (ON DELETE CASCADE), and the
-- callback with it. Returns the rows removed.
WITH cleared AS (
    SELECT DISTINCT ti.dag_run_id, ti.task_id FROM deferral_task_instances ti
    WHERE ti.id = ANY ($1::bigint[]) AND ti.map_index >= 0
), whole AS (
    SELECT ti.dag_run_id, ti.task_id, max(ti.try_number) AS tries
    FROM deferral_task_instances ti
    JOIN cleared c ON c.dag_run_id = ti.dag_run_id AND c.task_id = ti.task_id
    GROUP BY ti.dag_run_id, ti.task_id
    HAVING bool_and(ti.id = ANY ($1::bigint[]))
       AND NOT EXISTS (SELECT 1 FROM deferral_stopping_tries s
                       WHERE s.ti_id = ANY (array_agg(ti.id)))
), kept AS (
    SELECT ti.id, ti.dag_run_id, ti.task_id FROM deferral_task_instances ti
    JOIN whole w ON ti.dag_run_id = w.dag_run_id AND ti.task_id = w.task_id
    WHERE ti.map_index = 0
), repointed AS (
    -- (done before the removal's cascade runs, at the statement's end, which sees it)
    UPDATE deferral_callback_requests c
    SET ti_id = k.id
    FROM deferral_task_instances ti
    JOIN kept k ON k.dag_run_id = ti.dag_run_id AND k.task_id = ti.task_id
    WHERE c.ti_id = ti.id AND ti.map_index > 0
    RETURNING c.id
), gone AS (
    DELETE FROM deferral_task_instances ti USING whole w
    WHERE ti.dag_run_id = w.dag_run_id AND ti.task_id = w.task_id AND ti.map_index > 0
    RETURNING ti.id
), folded AS (
    UPDATE deferral_task_instances ti
    SET map_index = -1, map_value = NULL, try_number = w.tries
    FROM whole w
    WHERE ti.dag_run_id = w.dag_run_id AND ti.task_id = w.task_id AND ti.map_index = 0
    RETURNING ti.id
)
SELECT g.id FROM gone g;

-- name: begin_override
-- This transaction marks or clears task instances (or a run) for a user: what it changes is
-- the user's override, not an outcome, and requests no callback (deferral_task_callback,
-- deferral_run_ended read the setting). Transaction-local.
SELECT set_config('deferral.override', 'on', true);

-- name: lock_run_triggers
-- Lock the triggers the deferred task instances of run $1 (its primary key) wait on, before a
-- mark of the whole run locks its task instances (as lock_left_triggers does for some), with
-- the timers of its deadline alerts, which the run's end deletes: all of them in id order, as
-- a triggerer firing a batch locks them (else a timer older than a task's trigger, firing in
-- one batch with it, was locked in the other order; delete_orphan_triggers keeps the timers).
SELECT t.id FROM deferral_triggers t
WHERE t.id IN (SELECT ti.trigger_id FROM deferral_task_instances ti
               WHERE ti.dag_run_id = $1 AND ti.state = 'deferred')
   OR t.id IN (SELECT dl.trigger_id FROM deferral_deadline_alerts dl WHERE dl.dag_run_id = $1)
ORDER BY t.id
FOR UPDATE OF t;

-- name: lock_run_tasks
-- Lock the task instances of run $1 (its primary key) for a mark of the whole run; their states.
SELECT ti.id, ti.state FROM deferral_task_instances ti
WHERE ti.dag_run_id = $1
ORDER BY ti.id
FOR UPDATE;

-- name: end_marked_run
-- End run $1 (its primary key) in state $2 ('success' or 'failed') after its unfinished task
-- instances were marked in the same transaction ($3 who, $4 how): the run's row, an audit row,
-- and the notifications of a run ended (deferral_runs: "dag run state", for those waiting on
-- it; deferral_finished: the scheduler, which may start a queued run now). Returns the run.
WITH ended AS (
    UPDATE deferral_dag_runs r
    -- (a run already so, none of whose tasks the mark changed, keeps when it ended)
    SET state = $2,
        ended_at = CASE WHEN r.state = $2 THEN COALESCE(r.ended_at, now()) ELSE now() END,
        started_at = COALESCE(r.started_at, now())
    WHERE r.id = $1
    RETURNING r.id, r.dag_id, r.run_id, r.state
), audited AS (
    INSERT INTO deferral_audit (who, action, target, detail)
    SELECT $3::text, 'mark_run_' || $2::text, e.dag_id || '/' || e.run_id,
           jsonb_build_object('run', e.id, 'via', $4::text)
    FROM ended e
), told AS (
    SELECT pg_notify('deferral_runs', e.dag_id || ' ' || e.run_id || ' ' || e.state),
           pg_notify('deferral_finished', e.id::text)
    FROM ended e
)
SELECT e.id, e.dag_id, e.run_id, e.state, (SELECT count(*) FROM told) AS told FROM ended e;

-- name: lock_left_triggers
-- Lock the triggers that the deferred task instances among $1 wait on, before a mark or a clear
-- makes them leave (in the same transaction, first: a trigger firing locks its row before its
-- waiters, and so does this). delete_orphan_triggers then drops those nobody waits on any more.
SELECT t.id FROM deferral_triggers t
WHERE t.id IN (SELECT ti.trigger_id FROM deferral_task_instances ti
               WHERE ti.id = ANY ($1::bigint[]) AND ti.state = 'deferred')
ORDER BY t.id
FOR UPDATE OF t;

-- name: cancel_trigger
-- The status page's "cancel a trigger": the task instances waiting on trigger $1 fail with the
-- message $2 (no retry: someone chose to stop them) and the trigger row goes (its triggerer
-- notices at its next lease renewal and stops running it). Returns what moved.
WITH failed AS (
    UPDATE deferral_task_instances ti
    SET state = 'failed', ended_at = now(), error = $2, trigger_id = NULL,
        trigger_timeout_at = NULL, deadline_kind = NULL, next_method = NULL,
        next_kwargs = NULL, next_event = NULL
    WHERE ti.trigger_id = $1 AND ti.state = 'deferred'
    RETURNING ti.id, ti.dag_run_id, ti.task_id, ti.state, ti.is_leaf
), silenced AS (
    -- (a run's deadline alert timed by this trigger is dropped, not fired: migration 0022)
    DELETE FROM deferral_deadline_alerts WHERE trigger_id = $1
), gone AS (
    DELETE FROM deferral_triggers WHERE id = $1 RETURNING id
)
SELECT f.id, f.dag_run_id, f.task_id, f.state, f.is_leaf, (SELECT count(*) FROM gone) AS deleted
FROM failed f;

-- name: record_audit
-- One action taken from the status page: who (the remote address), what, on what.
INSERT INTO deferral_audit (who, action, target, detail) VALUES ($1, $2, $3, $4)
RETURNING id, at;

-- name: list_audit
-- The latest $1 actions taken from the status page, newest first.
SELECT id, at, who, action, target, detail FROM deferral_audit ORDER BY id DESC LIMIT $1;

-- name: insert_trigger_logs
-- Store a batch of trigger log lines, in order: $1 trigger ids, $2 times (seconds since the
-- epoch, as the process logged them), $3 levels, $4 loggers, $5 messages. The task tries
-- waiting now on the triggers $6 are recorded with them (once each), so that the page of a
-- try finds its triggers' lines after they fired. One statement per batch.
WITH lines AS (
    INSERT INTO deferral_trigger_logs (trigger_id, at, level, logger, message)
    SELECT l.trigger_id, to_timestamp(l.at), l.level, l.logger, l.message
    FROM unnest($1::bigint[], $2::double precision[], $3::text[], $4::text[], $5::text[])
        WITH ORDINALITY AS l(trigger_id, at, level, logger, message, n)
    ORDER BY l.n
), waiters AS (
    INSERT INTO deferral_trigger_log_tasks (dag_id, run_id, task_id, try_number, trigger_id)
    SELECT ti.dag_id, ti.run_id, deferral_ti_name(ti.task_id, ti.map_index), ti.try_number,
           ti.trigger_id
    FROM deferral_task_instances ti
    WHERE ti.trigger_id = ANY ($6::bigint[]) AND ti.state = 'deferred'
    ON CONFLICT DO NOTHING
)
SELECT 1;

-- name: insert_task_logs
-- Store a batch of task log lines, in order: per line the task try ($1 DAG, $2 run, $3 task,
-- $4 try), $5 the time (seconds since the epoch), $6 level, $7 stream ('log', 'stdout',
-- 'stderr'), $8 logger, $9 message. One statement per batch.
INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream, logger,
                                message)
SELECT l.dag_id, l.run_id, l.task_id, l.try_number, to_timestamp(l.at), l.level, l.stream,
       l.logger, l.message
FROM unnest($1::text[], $2::text[], $3::text[], $4::integer[], $5::double precision[],
            $6::text[], $7::text[], $8::text[], $9::text[])
    WITH ORDINALITY AS l(dag_id, run_id, task_id, try_number, at, level, stream, logger,
                         message, n)
ORDER BY l.n;

-- name: trigger_log_bytes
-- Bytes of the messages stored so far for each trigger $1, in the order given (the bound of a
-- trigger's total, when a triggerer first writes lines of a trigger another may have run).
SELECT COALESCE((SELECT sum(octet_length(l.message)) FROM deferral_trigger_logs l
                 WHERE l.trigger_id = k.trigger_id), 0)::bigint AS bytes
FROM unnest($1::bigint[]) WITH ORDINALITY AS k(trigger_id, n)
ORDER BY k.n;

-- name: task_log_bytes
-- Bytes of the messages stored so far for each task try ($1 DAG, $2 run, $3 task, $4 try), in
-- the order given (the bound of a try's total, when a worker first writes lines of a try that
-- ran elsewhere before: resumed, rescheduled).
SELECT COALESCE((SELECT sum(octet_length(l.message)) FROM deferral_task_logs l
                 WHERE l.dag_id = k.dag_id AND l.run_id = k.run_id AND l.task_id = k.task_id
                   AND l.try_number = k.try_number), 0)::bigint AS bytes
FROM unnest($1::text[], $2::text[], $3::text[], $4::integer[])
    WITH ORDINALITY AS k(dag_id, run_id, task_id, try_number, n)
ORDER BY k.n;

-- name: trigger_logs
-- Up to $3 lines of trigger $1 after seq $2, oldest first, with whether the trigger still
-- waits (its row exists) and its classpath then. One statement, so one snapshot: a trigger
-- seen gone has every line it logged before it fired stored (the triggerer writes them
-- before the event). Without lines: one row with a null seq.
WITH page AS (
    SELECT seq, at, level, logger, message FROM deferral_trigger_logs
    WHERE trigger_id = $1 AND seq > $2
    ORDER BY seq
    LIMIT $3
)
SELECT t.classpath, t.id IS NOT NULL AS waiting, p.seq, p.at, p.level, p.logger, p.message
FROM (SELECT 1) one
LEFT JOIN deferral_triggers t ON t.id = $1
LEFT JOIN page p ON true
ORDER BY p.seq;

-- name: trigger_log_tasks
-- The task tries that waited on trigger $1 while it logged.
SELECT dag_id, run_id, task_id, try_number FROM deferral_trigger_log_tasks
WHERE trigger_id = $1
ORDER BY dag_id, run_id, task_id, try_number;

-- name: task_logs
-- Up to $6 lines of a task try ($1 DAG, $2 run, $3 task: its name, TASK[i] for a mapped
-- instance, deferral_ti_name; $4 try; null: the latest) after seq
-- $5, oldest first, with the task instance's state and latest try (null: no such task
-- instance). One statement, so one snapshot: a try seen ended has every line it logged before
-- its outcome stored (the worker writes them before the outcome). Without lines: one row with
-- a null seq.
WITH ti AS (
    SELECT state, try_number FROM deferral_task_instances
    WHERE dag_run_id = (SELECT r.id FROM deferral_dag_runs r
                        WHERE r.dag_id = $1 AND r.run_id = $2)
      AND deferral_ti_name(task_id, map_index) = $3
), try AS (
    SELECT COALESCE($4::integer, (SELECT try_number FROM ti)) AS n
), page AS (
    SELECT l.seq, l.at, l.level, l.stream, l.logger, l.message
    FROM deferral_task_logs l, try
    WHERE l.dag_id = $1 AND l.run_id = $2 AND l.task_id = $3 AND l.try_number = try.n
      AND l.seq > $5
    ORDER BY l.seq
    LIMIT $6
)
SELECT try.n AS try_number, ti.state, ti.try_number AS latest_try, p.seq, p.at, p.level,
       p.stream, p.logger, p.message
FROM try
LEFT JOIN ti ON true
LEFT JOIN page p ON true
ORDER BY p.seq;

-- name: task_log_triggers
-- The triggers that task try ($1 DAG, $2 run, $3 task, $4 try) waited on and that logged.
SELECT trigger_id FROM deferral_trigger_log_tasks
WHERE dag_id = $1 AND run_id = $2 AND task_id = $3 AND try_number = $4
ORDER BY trigger_id;

-- name: delete_old_trigger_logs
-- Retention: of the $2 oldest trigger lines after seq $3, delete those logged over $1 seconds
-- ago. Returns how many went, the last seq read (null: none left) and whether the newest line
-- read was old too (more old lines may follow; seq follows time, but for the clocks of
-- different hosts). Reads only those lines, by the primary key.
WITH oldest AS (
    SELECT seq, at FROM deferral_trigger_logs WHERE seq > $3 ORDER BY seq LIMIT $2
), gone AS (
    -- (By an array of seqs, not a join with oldest: the planner hashed the oldest lines
    -- against a sequential scan of the table; tests/test_query_plans.py pins this.)
    DELETE FROM deferral_trigger_logs
    WHERE seq = ANY (ARRAY(SELECT seq FROM oldest
                           WHERE at < now() - make_interval(secs => $1)))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, last.seq AS last_seq,
       last.at < now() - make_interval(secs => $1) AS more
FROM (SELECT 1) one
LEFT JOIN (SELECT seq, at FROM oldest ORDER BY seq DESC LIMIT 1) last ON true;

-- name: delete_old_task_logs
-- Retention: as delete_old_trigger_logs, for task lines.
WITH oldest AS (
    SELECT seq, at FROM deferral_task_logs WHERE seq > $3 ORDER BY seq LIMIT $2
), gone AS (
    -- (By an array of seqs, not a join with oldest: the planner hashed the oldest lines
    -- against a sequential scan of the table; tests/test_query_plans.py pins this.)
    DELETE FROM deferral_task_logs
    WHERE seq = ANY (ARRAY(SELECT seq FROM oldest
                           WHERE at < now() - make_interval(secs => $1)))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, last.seq AS last_seq,
       last.at < now() - make_interval(secs => $1) AS more
FROM (SELECT 1) one
LEFT JOIN (SELECT seq, at FROM oldest ORDER BY seq DESC LIMIT 1) last ON true;

-- name: delete_old_trigger_log_tasks
-- Retention: up to $2 records of which tries waited on which logging trigger, made over $1
-- seconds ago.
WITH gone AS (
    DELETE FROM deferral_trigger_log_tasks
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM deferral_trigger_log_tasks
                            WHERE at < now() - make_interval(secs => $1)
                            LIMIT $2))
    RETURNING 1
)
SELECT count(*) AS n FROM gone;

-- name: list_pools
-- Every pool with what it holds: running (pool slots of running tries, and of tries told to
-- stop that have not stopped yet, as deferral_claim_tasks counts them), deferred (of deferred
-- tasks, counted against the pool only where include_deferred), queued (runnable tasks waiting
-- for admission: due now, not running yet) and open (slots left; negative once a pool is
-- shrunk below what runs in it). $1: one pool (null: all).
WITH use AS (
    SELECT ti.pool,
           sum(ti.pool_slots) FILTER (WHERE ti.state IN ('running', 'queued')) AS running,
           sum(ti.pool_slots) FILTER (WHERE ti.state = 'deferred') AS deferred,
           count(*) FILTER (WHERE ti.state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
                              AND ti.run_after <= now()) AS queued
    FROM deferral_task_instances ti
    WHERE ti.state IN ('running', 'queued', 'deferred', 'scheduled', 'up_for_retry',
                       'up_for_reschedule')
      AND ($1::text IS NULL OR ti.pool = $1)
    GROUP BY ti.pool
), stopping AS (
    SELECT s.pool, sum(s.pool_slots) AS slots FROM deferral_stopping_tries s
    WHERE $1::text IS NULL OR s.pool = $1
    GROUP BY s.pool
)
SELECT p.name, p.slots, p.include_deferred, p.description,
       (COALESCE(u.running, 0) + COALESCE(st.slots, 0))::integer AS running,
       COALESCE(u.queued, 0)::integer AS queued,
       COALESCE(u.deferred, 0)::integer AS deferred,
       (p.slots - COALESCE(u.running, 0) - COALESCE(st.slots, 0)
        - CASE WHEN p.include_deferred THEN COALESCE(u.deferred, 0) ELSE 0 END)::integer AS open
FROM deferral_pools p LEFT JOIN use u ON u.pool = p.name
LEFT JOIN stopping st ON st.pool = p.name
WHERE $1::text IS NULL OR p.name = $1
ORDER BY p.name;

-- name: set_pool
-- Create pool $1 or change it: slots $2; include_deferred $3 and description $4 (null: keep
-- as they are; a new pool: false, none). Wakes the workers: a pool grown may admit at once.
WITH up AS (
    INSERT INTO deferral_pools (name, slots, include_deferred, description)
    VALUES ($1, $2, COALESCE($3, false), $4)
    ON CONFLICT (name) DO UPDATE
    SET slots = EXCLUDED.slots,
        include_deferred = COALESCE($3, deferral_pools.include_deferred),
        description = COALESCE($4, deferral_pools.description),
        updated_at = now()
    RETURNING name, (xmax = 0) AS created
)
SELECT up.name, up.created, pg_notify('deferral_tasks', '') IS NULL AS woke FROM up;

-- name: ensure_pool
-- Create pool $1 with $2 slots unless it exists (deferral tasks test, on its scratch database).
INSERT INTO deferral_pools (name, slots) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING;

-- name: delete_pool
-- Delete pool $1 unless a task instance not finished yet names it, or an active DAG has a
-- task that names it (its next run would fail at claim for want of the pool); returns whether
-- it existed, whether it was deleted, how many unfinished task instances use it and which
-- active DAGs name it.
WITH target AS (
    SELECT name FROM deferral_pools WHERE name = $1 FOR UPDATE
), used AS (
    SELECT count(*) AS n FROM deferral_task_instances
    WHERE pool = $1 AND state NOT IN ('success', 'failed', 'skipped', 'upstream_failed')
), naming AS (
    SELECT COALESCE(array_agg(d.dag_id ORDER BY d.dag_id), '{}') AS dag_ids
    FROM deferral_dags d
    WHERE d.is_active
      AND EXISTS (SELECT 1 FROM jsonb_array_elements(d.tasks) t WHERE t ->> 'pool' = $1)
), gone AS (
    DELETE FROM deferral_pools p USING target, used, naming
    WHERE p.name = target.name AND used.n = 0 AND cardinality(naming.dag_ids) = 0
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM target) AS found, EXISTS (SELECT 1 FROM gone) AS deleted,
       (SELECT n FROM used) AS in_use, (SELECT dag_ids FROM naming) AS dag_ids;

-- name: why_tasks
-- What may hold back each of the task instances $1 (any state), in one statement for a whole
-- listing: the states of its upstreams (while it is pending); its pool (slots, the slots held
-- by running tries and by deferred ones, which count where include_deferred) as
-- deferral_claim_tasks counts them; the running tries of its DAG and of its task against
-- max_active_tasks and max_active_tis_per_dag; the running tries of the whole fleet (against
-- the parallelism setting); the live workers serving its queue (live: a heartbeat within $2
-- seconds, silence counted as reap_zombie_tasks counts it) and when a worker serving it was
-- last seen; for a deferred task its trigger, the triggerer holding it and the live
-- triggerers (lease not expired, as claim_triggers requires) of its trigger queue, how many
-- of them have room, and when one was last seen; for a running task its worker; a try of it
-- told to stop (a mark or a clear) that its worker has not seen end yet. The tries told to
-- stop count as running, as deferral_claim_tasks counts them.
WITH t AS MATERIALIZED (
    SELECT ti.id, ti.dag_run_id, ti.dag_id, ti.run_id, ti.task_id, ti.state, ti.try_number,
           ti.retries, ti.run_after, ti.try_started_at, ti.ended_at, ti.error, ti.upstream,
           ti.trigger_rule, ti.pool, ti.pool_slots, ti.queue, ti.max_active_tis_per_dag,
           ti.worker_id, ti.trigger_id, ti.trigger_timeout_at, ti.deadline_kind,
           tr.classpath AS trigger_classpath, tr.triggerer_id, tr.created_at AS trigger_created_at,
           COALESCE(tr.queue, ti.trigger_queue) AS trigger_queue, tr.id IS NOT NULL AS trigger_found
    FROM deferral_task_instances ti
    LEFT JOIN deferral_triggers tr ON tr.id = ti.trigger_id AND ti.state = 'deferred'
    WHERE ti.id = ANY ($1::bigint[])
), busy AS MATERIALIZED (
    SELECT b.pool, b.dag_id, b.task_id, b.pool_slots
    FROM deferral_task_instances b WHERE b.state IN ('running', 'queued')
    UNION ALL
    SELECT s.pool, s.dag_id, s.task_id, s.pool_slots FROM deferral_stopping_tries s
), pool_use AS (
    SELECT p.name, p.slots, p.include_deferred,
           COALESCE((SELECT sum(b.pool_slots) FROM busy b WHERE b.pool = p.name), 0) AS running,
           COALESCE((SELECT sum(d.pool_slots) FROM deferral_task_instances d
                     WHERE d.state = 'deferred' AND d.pool = p.name), 0) AS deferred
    FROM deferral_pools p WHERE p.name IN (SELECT t.pool FROM t)
), dag_busy AS (
    SELECT b.dag_id, count(*) AS n FROM busy b GROUP BY b.dag_id
), task_busy AS (
    SELECT b.dag_id, b.task_id, count(*) AS n FROM busy b GROUP BY b.dag_id, b.task_id
), worker_queues AS (
    SELECT q.queue,
           count(w.id) FILTER (WHERE GREATEST(w.heartbeat_at, pg_postmaster_start_time())
                                     >= now() - make_interval(secs => $2)) AS live,
           max(w.heartbeat_at) AS last_heartbeat
    FROM (SELECT DISTINCT t.queue FROM t) q
    LEFT JOIN deferral_workers w ON q.queue = ANY (w.queues)
    GROUP BY q.queue
), triggerer_queues AS (
    SELECT q.queue,
           count(r.id) FILTER (WHERE r.lease_expires_at > now()) AS live,
           count(r.id) FILTER (WHERE r.lease_expires_at > now() AND r.held < r.capacity)
               AS with_room,
           max(r.heartbeat_at) AS last_heartbeat
    FROM (SELECT DISTINCT t.trigger_queue AS queue FROM t WHERE t.state = 'deferred') q
    LEFT JOIN LATERAL (
        SELECT r.id, r.capacity, r.heartbeat_at, r.lease_expires_at,
               (SELECT count(*) FROM deferral_triggers x WHERE x.triggerer_id = r.id) AS held
        FROM deferral_triggerers r WHERE q.queue = ANY (r.queues)
    ) r ON true
    GROUP BY q.queue
)
SELECT t.id, t.dag_id, t.run_id, t.task_id, t.state, t.try_number, t.retries, t.run_after,
       t.try_started_at, t.ended_at, t.error, t.trigger_rule,
       CASE WHEN t.state = 'pending' THEN (
           SELECT COALESCE(jsonb_object_agg(u.task_id, u.state), '{}'::jsonb)
           FROM deferral_task_instances u
           WHERE u.dag_run_id = t.dag_run_id AND u.task_id = ANY (t.upstream))
       END AS upstream_states,
       t.upstream,
       t.pool, t.pool_slots, pu.name IS NOT NULL AS pool_exists, pu.slots AS pool_total,
       COALESCE(pu.include_deferred, false) AS include_deferred,
       COALESCE(pu.running, 0)::integer AS pool_running,
       COALESCE(pu.deferred, 0)::integer AS pool_deferred,
       d.max_active_tasks, COALESCE(db.n, 0)::integer AS dag_running,
       t.max_active_tis_per_dag, COALESCE(tb.n, 0)::integer AS task_running,
       (SELECT count(*) FROM busy)::integer AS fleet_running,
       t.queue, COALESCE(wq.live, 0)::integer AS live_workers,
       GREATEST(ws.last_seen_at, wq.last_heartbeat) AS worker_last_seen,
       t.worker_id, w.hostname AS worker_hostname, w.pid AS worker_pid,
       t.trigger_id, t.trigger_found, t.trigger_classpath, t.trigger_created_at,
       t.trigger_timeout_at, t.deadline_kind, t.trigger_queue, t.triggerer_id,
       r.hostname AS triggerer_hostname, r.pid AS triggerer_pid,
       st.try_number AS stopping_try, st.worker_id AS stopping_worker_id,
       st.reason AS stopping_reason, st.since AS stopping_since,
       COALESCE(tq.live, 0)::integer AS live_triggerers,
       COALESCE(tq.with_room, 0)::integer AS triggerers_with_room,
       GREATEST(ts.last_seen_at, tq.last_heartbeat) AS triggerer_last_seen,
       now() AS db_now
FROM t
LEFT JOIN pool_use pu ON pu.name = t.pool
LEFT JOIN deferral_dags d ON d.dag_id = t.dag_id
LEFT JOIN dag_busy db ON db.dag_id = t.dag_id
LEFT JOIN task_busy tb ON tb.dag_id = t.dag_id AND tb.task_id = t.task_id
LEFT JOIN worker_queues wq ON wq.queue = t.queue
LEFT JOIN deferral_queues_seen ws ON ws.kind = 'worker' AND ws.queue = t.queue
LEFT JOIN deferral_workers w ON w.id = t.worker_id AND t.state = 'running'
LEFT JOIN deferral_triggerers r ON r.id = t.triggerer_id
LEFT JOIN triggerer_queues tq ON tq.queue = t.trigger_queue AND t.state = 'deferred'
LEFT JOIN deferral_queues_seen ts ON ts.kind = 'triggerer' AND ts.queue = t.trigger_queue
LEFT JOIN LATERAL (
    SELECT s.try_number, s.worker_id, s.reason, s.since FROM deferral_stopping_tries s
    WHERE s.ti_id = t.id ORDER BY s.try_number DESC LIMIT 1
) st ON true
ORDER BY t.id;

-- name: why_run
-- Run $2 of DAG $1, for "why is task $3 not running": its state and type, the DAG's
-- max_active_runs, its runs counted against it (running, not backfills: as start_queued_runs
-- counts them) and the queued ones that start before this one, whether the DAG has task $3,
-- and the id of its task instance of map index $4 (-1: not mapped) (null while the run is queued: its task instances are created
-- when it starts). No row: no such run.
SELECT r.id, r.dag_id, r.run_id, r.state, r.run_type, r.created_at, d.max_active_runs,
       (SELECT count(*) FROM deferral_dag_runs x
        WHERE x.dag_id = r.dag_id AND x.state = 'running' AND x.run_type <> 'backfill')::integer
           AS active_runs,
       (SELECT count(*) FROM deferral_dag_runs x
        WHERE x.dag_id = r.dag_id AND x.state = 'queued' AND x.run_type <> 'backfill'
          AND (x.logical_date, x.id) < (r.logical_date, r.id))::integer AS queued_before,
       COALESCE(d.tasks @> jsonb_build_array(jsonb_build_object('task_id', $3::text)), false)
           AS has_task,
       (SELECT ti.id FROM deferral_task_instances ti
        WHERE ti.dag_run_id = r.id AND ti.task_id = $3 AND ti.map_index = $4) AS ti_id,
       now() AS db_now
FROM deferral_dag_runs r
LEFT JOIN deferral_dags d ON d.dag_id = r.dag_id
WHERE r.dag_id = $1 AND r.run_id = $2;

-- -- The CLI's and the operators' reads: import errors, endpoints, run selectors, fleet
-- -- metrics (engine/store/importerrors.py, endpoints.py, runselect.py, fleetstats.py).

-- name: record_import_errors
-- The import errors of DAGs folder $1 (a path ending in '/') as a scan found them: $2 the files
-- that failed, $3 their errors; $4 the files whose import goes on (their rows stay as they
-- were). A row is written only when its error is new or changed; the rows of the folder's
-- other files go. Nothing is written when nothing changed (a scan every few seconds).
WITH found AS (
    SELECT f.fileloc, f.error FROM unnest($2::text[], $3::text[]) AS f (fileloc, error)
    WHERE NOT EXISTS (SELECT 1 FROM deferral_import_errors e
                      WHERE e.fileloc = f.fileloc AND e.error = f.error AND e.folder = $1)
), written AS (
    INSERT INTO deferral_import_errors (fileloc, folder, error)
    SELECT fileloc, $1, error FROM found
    ON CONFLICT (fileloc) DO UPDATE
        SET folder = EXCLUDED.folder, error = EXCLUDED.error, since = now()
    RETURNING fileloc
), gone AS (
    DELETE FROM deferral_import_errors e
    WHERE e.folder = $1 AND e.fileloc <> ALL ($2::text[]) AND e.fileloc <> ALL ($4::text[])
    RETURNING fileloc
)
SELECT (SELECT count(*) FROM written)::int AS written, (SELECT count(*) FROM gone)::int AS gone;

-- name: list_import_errors
-- The DAG files that failed to import, by path (at most $1).
SELECT fileloc, folder, error, since FROM deferral_import_errors ORDER BY fileloc LIMIT $1;

-- name: register_endpoint
-- A process listens: its row ($1 kind, $2 process, $3 hostname, $4 pid, $5 version, $6 url),
-- replacing any row of the same kind left by a process of the same host and pid (pids are
-- reused) and dropping the rows silent for an hour (processes that died). Returns its id.
WITH gone AS (
    DELETE FROM deferral_endpoints
    WHERE (hostname = $3 AND pid = $4 AND kind = $1) OR heartbeat_at < now() - interval '1 hour'
)
INSERT INTO deferral_endpoints (kind, process, hostname, pid, version, url)
VALUES ($1, $2, $3, $4, $5, $6) RETURNING id;

-- name: heartbeat_endpoint
-- Keep endpoint $1's row; no row back: it was removed (the process registers again).
UPDATE deferral_endpoints SET heartbeat_at = now() WHERE id = $1 RETURNING id;

-- name: unregister_endpoint
-- A process stops listening.
DELETE FROM deferral_endpoints WHERE id = $1;

-- name: list_endpoints
-- Where the processes listen: the rows whose heartbeat is at most $1 seconds old (on the
-- database clock), with its age.
SELECT id, kind, process, hostname, pid, version, url, started_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_s
FROM deferral_endpoints
WHERE heartbeat_at >= now() - make_interval(secs => $1)
ORDER BY process, hostname, pid, id;

-- name: select_runs_exact
-- The runs called $2, of DAG $1 (null: of every DAG), for a run selector.
SELECT dag_id, run_id, logical_date, run_type, state FROM deferral_dag_runs
WHERE ($1::text IS NULL OR dag_id = $1) AND run_id = $2
ORDER BY dag_id;

-- name: select_runs_latest
-- The newest run (the first that `deferral runs list` shows) of DAG $1 (null: of every DAG).
SELECT dag_id, run_id, logical_date, run_type, state FROM deferral_dag_runs
WHERE ($1::text IS NULL OR dag_id = $1)
ORDER BY id DESC LIMIT 1;

-- name: select_runs_dated
-- Runs of DAG $1 (null: of every DAG) whose logical date lies in [$2, $3), newest first, at
-- most $4.
SELECT dag_id, run_id, logical_date, run_type, state FROM deferral_dag_runs
WHERE ($1::text IS NULL OR dag_id = $1) AND logical_date >= $2 AND logical_date < $3
ORDER BY logical_date DESC, id DESC LIMIT $4;

-- name: select_runs_prefixed
-- Runs of DAG $1 (null: of every DAG) whose id starts with $2, newest first, at most $3.
SELECT dag_id, run_id, logical_date, run_type, state FROM deferral_dag_runs
WHERE ($1::text IS NULL OR dag_id = $1) AND starts_with(run_id, $2)
ORDER BY id DESC LIMIT $3;

-- name: recent_run_ids
-- The ids of the newest $2 runs of DAG $1 (null: of every DAG): what a run selector that
-- named none is compared with, to suggest the closest.
SELECT dag_id, run_id, logical_date, run_type, state FROM deferral_dag_runs
WHERE ($1::text IS NULL OR dag_id = $1)
ORDER BY id DESC LIMIT $2;

-- name: active_runs_by_dag
-- Runs queued or running, by DAG and state (the scheduler's gauges).
SELECT dag_id, state, count(*)::int AS n FROM deferral_dag_runs
WHERE state IN ('queued', 'running')
GROUP BY dag_id, state;

-- name: ended_run_facts
-- The runs $1 (just ended, by this scheduler): how long each took (from its start; a run that
-- never waited as queued: from its creation), how long after its data interval ended a
-- scheduled run started, and how long each of its task instances that ran took (from its first
-- try's start to its end, across deferrals and retries), by the state it ended in.
SELECT r.dag_id, r.state, r.run_type,
       extract(epoch FROM r.ended_at - COALESCE(r.started_at, r.created_at))::float8
           AS duration_s,
       CASE WHEN r.run_type = 'scheduled' AND r.data_interval_end IS NOT NULL
            THEN extract(epoch FROM COALESCE(r.started_at, r.created_at) - r.data_interval_end)
       END::float8 AS delay_s,
       COALESCE((SELECT jsonb_agg(jsonb_build_array(
                            ti.state, extract(epoch FROM ti.ended_at - ti.first_try_at)))
                 FROM deferral_task_instances ti
                 WHERE ti.dag_run_id = r.id AND ti.first_try_at IS NOT NULL
                   AND ti.ended_at IS NOT NULL), '[]'::jsonb) AS tasks
FROM deferral_dag_runs r
WHERE r.id = ANY ($1::bigint[]) AND r.ended_at IS NOT NULL;

-- name: backlog_groups
-- The runnable task instances no worker has claimed, by pool, DAG, task and slots, with the
-- room their pool, DAG (max_active_tasks) and task (max_active_tis_per_dag) have left, counted
-- as deferral_claim_tasks counts it (pool_room null: no such pool; dag_room, task_room null: no
-- limit). resuming: how many are deferred tasks resuming in a pool that includes deferred
-- ones (their slot is theirs already).
WITH runnable AS (
    SELECT ti.pool, ti.dag_id, ti.task_id, ti.pool_slots, ti.max_active_tis_per_dag,
           count(*)::int AS n, count(*) FILTER (WHERE ti.next_method IS NOT NULL)::int AS resumes
    FROM deferral_task_instances ti
    WHERE ti.state IN ('scheduled', 'up_for_retry', 'up_for_reschedule') AND ti.run_after <= now()
    GROUP BY ti.pool, ti.dag_id, ti.task_id, ti.pool_slots, ti.max_active_tis_per_dag
), busy AS MATERIALIZED (
    SELECT b.pool, b.dag_id, b.task_id, b.pool_slots
    FROM deferral_task_instances b WHERE b.state IN ('running', 'queued')
    UNION ALL
    SELECT s.pool, s.dag_id, s.task_id, s.pool_slots FROM deferral_stopping_tries s
)
SELECT r.pool, r.dag_id, r.task_id, r.pool_slots, r.n,
       CASE WHEN p.include_deferred THEN r.resumes ELSE 0 END AS resuming,
       (p.slots
        - COALESCE((SELECT sum(b.pool_slots) FROM busy b WHERE b.pool = r.pool), 0)
        - CASE WHEN p.include_deferred
               THEN COALESCE((SELECT sum(d.pool_slots) FROM deferral_task_instances d
                              WHERE (d.state = 'deferred'
                                     OR (d.state = 'scheduled' AND d.next_method IS NOT NULL))
                                AND d.pool = r.pool), 0)
               ELSE 0 END)::int AS pool_room,
       (d.max_active_tasks - (SELECT count(*) FROM busy b WHERE b.dag_id = r.dag_id))::int
           AS dag_room,
       (r.max_active_tis_per_dag
        - (SELECT count(*) FROM busy b WHERE b.dag_id = r.dag_id AND b.task_id = r.task_id))::int
           AS task_room
FROM runnable r
LEFT JOIN deferral_pools p ON p.name = r.pool
LEFT JOIN deferral_dags d ON d.dag_id = r.dag_id
ORDER BY r.pool, r.dag_id, r.task_id;

-- ---------------------------------------------------------------------------------------------
-- Variables, Connections and the previous successful run: what task code and templates read
-- at run time (engine/store/variables.py). A Variable's value and a Connection's secrets are
-- stored encrypted by the caller (the store's keyring); these statements never see plaintext.

-- name: set_variable
-- Create or replace Variable $1 with the sealed value $2; description $3 and is_secret $4
-- stay as they were when null. Returns whether it was created.
INSERT INTO deferral_variables (key, value, description, is_secret)
VALUES ($1, $2, $3, COALESCE($4::boolean, false))
ON CONFLICT (key) DO UPDATE
SET value = EXCLUDED.value,
    description = COALESCE($3, deferral_variables.description),
    is_secret = COALESCE($4::boolean, deferral_variables.is_secret),
    updated_at = now()
RETURNING (xmax = 0) AS created;

-- name: get_variable
-- Variable $1 (its value sealed).
SELECT key, value, description, is_secret, updated_at FROM deferral_variables WHERE key = $1;

-- name: list_variables
-- Every Variable, by key.
SELECT key, value, description, is_secret, updated_at FROM deferral_variables ORDER BY key;

-- name: delete_variable
-- Delete Variable $1; whether it existed.
WITH gone AS (DELETE FROM deferral_variables WHERE key = $1 RETURNING 1)
SELECT count(*) > 0 FROM gone;

-- name: add_connection
-- Store connection $1 unless one of that id exists; whether it was stored.
WITH added AS (
    INSERT INTO deferral_connections
        (conn_id, conn_type, host, schema, login, port, secrets, description)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
    ON CONFLICT (conn_id) DO NOTHING
    RETURNING 1
)
SELECT count(*) > 0 FROM added;

-- name: replace_connection
-- Store connection $1, replacing one of that id; whether it was created.
INSERT INTO deferral_connections
    (conn_id, conn_type, host, schema, login, port, secrets, description)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (conn_id) DO UPDATE
SET conn_type = EXCLUDED.conn_type, host = EXCLUDED.host, schema = EXCLUDED.schema,
    login = EXCLUDED.login, port = EXCLUDED.port, secrets = EXCLUDED.secrets,
    description = EXCLUDED.description, updated_at = now()
RETURNING (xmax = 0) AS created;

-- name: get_connection
-- Connection $1 (its secrets sealed).
SELECT conn_id, conn_type, host, schema, login, port, secrets, description, updated_at
FROM deferral_connections WHERE conn_id = $1;

-- name: list_connections
-- Every stored connection, by id.
SELECT conn_id, conn_type, host, schema, login, port, secrets, description, updated_at
FROM deferral_connections ORDER BY conn_id;

-- name: delete_connection
-- Delete connection $1; whether it existed.
WITH gone AS (DELETE FROM deferral_connections WHERE conn_id = $1 RETURNING 1)
SELECT count(*) > 0 FROM gone;

-- name: rotation_variables
-- Key rotation: the next $2 Variables after key $1, with their sealed values.
SELECT key AS id, value FROM deferral_variables WHERE key > $1 ORDER BY key LIMIT $2;

-- name: rotate_variable_values
-- Key rotation: set each Variable $1[i] to $3[i] if its value is still $2[i] (unchanged since
-- it was read); how many were rewritten.
WITH done AS (
    UPDATE deferral_variables v SET value = u.new
    FROM unnest($1::text[], $2::bytea[], $3::bytea[]) AS u(key, old, new)
    WHERE v.key = u.key AND v.value = u.old
    RETURNING 1
)
SELECT count(*)::integer FROM done;

-- name: rotation_connections
-- Key rotation: the next $2 connections with secrets after id $1.
SELECT conn_id AS id, secrets AS value FROM deferral_connections
WHERE conn_id > $1 AND secrets IS NOT NULL ORDER BY conn_id LIMIT $2;

-- name: rotate_connection_secrets
-- Key rotation: set each connection $1[i]'s secrets to $3[i] if they are still $2[i].
WITH done AS (
    UPDATE deferral_connections c SET secrets = u.new
    FROM unnest($1::text[], $2::bytea[], $3::bytea[]) AS u(conn_id, old, new)
    WHERE c.conn_id = u.conn_id AND c.secrets = u.old
    RETURNING 1
)
SELECT count(*)::integer FROM done;

-- name: prev_success_run
-- The latest successful run of DAG $1 before logical date $2: its data interval (a run made
-- before runs had data intervals, migration 0009, spans its logical date) and when it started
-- and ended (the template variables prev_*_success). Runs only when a template or a callable
-- asks for one of them.
SELECT COALESCE(data_interval_start, logical_date) AS data_interval_start,
       COALESCE(data_interval_end, logical_date) AS data_interval_end,
       COALESCE(started_at, created_at) AS start_date, ended_at AS end_date
FROM deferral_dag_runs
WHERE dag_id = $1 AND state = 'success' AND logical_date < $2
ORDER BY logical_date DESC
LIMIT 1;

-- XComs (engine/store/xcom.py). A task's return value is its result column; the values it
-- pushed under other keys are rows of deferral_xcom, each of the try that pushed it: a row of
-- an earlier try is never read (x.try_number = ti.try_number). Values are encrypted.

-- name: xcom_push
-- Store the values try $3 of task instance $1 pushed ($4 keys, $5 values), if worker $2 still
-- holds that try (else nothing is written: a late write of a reaped try cannot overwrite a
-- later try's values). A key pushed again replaces its value; a row of an earlier try is
-- replaced too. Returns one row per value written.
INSERT INTO deferral_xcom (ti_id, key, try_number, value)
SELECT ti.id, x.key, ti.try_number, x.value
FROM deferral_task_instances ti, unnest($4::text[], $5::bytea[]) AS x(key, value)
WHERE ti.id = $1 AND ti.worker_id = $2 AND ti.try_number = $3 AND ti.state = 'running'
ON CONFLICT (ti_id, key) DO UPDATE
SET try_number = EXCLUDED.try_number, value = EXCLUDED.value, pushed_at = now()
RETURNING key;

-- name: xcom_pull
-- The values under key $4 of the tasks $3 (null: every task) of run $2 of DAG $1, from the
-- current try of each task instance (the return value, key 'return_value', is its result, or
-- what it pushed under that key). Only tasks that have one; the latest first (a mapped task's
-- instances by map_index).
SELECT ti.task_id, ti.map_index, v.value
FROM deferral_dag_runs r
JOIN deferral_task_instances ti ON ti.dag_run_id = r.id
LEFT JOIN deferral_xcom x ON x.ti_id = ti.id AND x.key = $4 AND x.try_number = ti.try_number
CROSS JOIN LATERAL (
    SELECT CASE WHEN $4 = 'return_value' THEN COALESCE(ti.result, x.value) ELSE x.value END
        AS value
) v
WHERE r.dag_id = $1 AND r.run_id = $2
  AND ($3::text[] IS NULL OR ti.task_id = ANY ($3::text[]))
  AND v.value IS NOT NULL
ORDER BY ti.map_index >= 0, ti.map_index,
         COALESCE(x.pushed_at, ti.ended_at) DESC NULLS LAST, ti.task_id;

-- name: task_map_indexes
-- The map indexes of task $3's instances in run $2 of DAG $1, in order: [-1] for an unmapped
-- task (or a mapped one not expanded yet), 0..n-1 for a mapped one; none: no such task
-- instance.
SELECT ti.map_index FROM deferral_task_instances ti
WHERE ti.dag_run_id = (SELECT r.id FROM deferral_dag_runs r WHERE r.dag_id = $1 AND r.run_id = $2)
  AND ti.task_id = $3
ORDER BY ti.map_index;

-- name: xcom_of_tasks
-- The values task instances $1 pushed under keys of their own in their current tries (their
-- return values are their results), by task instance and key.
SELECT x.ti_id, x.key, x.value
FROM deferral_xcom x
JOIN deferral_task_instances ti ON ti.id = x.ti_id AND ti.try_number = x.try_number
WHERE x.ti_id = ANY ($1::bigint[])
ORDER BY x.ti_id, x.key;

-- name: xcom_of_task
-- Every XCom of one task instance (DAG $1, run $2, task $3, map index $4) in its current try: its result
-- under 'return_value' (over a value pushed under that key, as xcom_pull reads it) and the
-- values it pushed, by key. No row: no such task instance; a row with a null key: it has none.
SELECT ti.id AS ti_id, k.key, k.value
FROM deferral_task_instances ti
LEFT JOIN LATERAL (
    SELECT x.key, x.value FROM deferral_xcom x
    WHERE x.ti_id = ti.id AND x.try_number = ti.try_number
      AND NOT (x.key = 'return_value' AND ti.result IS NOT NULL)
    UNION ALL
    SELECT 'return_value', ti.result WHERE ti.result IS NOT NULL
) k ON true
WHERE ti.dag_run_id = (SELECT r.id FROM deferral_dag_runs r WHERE r.dag_id = $1 AND r.run_id = $2)
  AND ti.task_id = $3 AND ti.map_index = $4
ORDER BY k.key;

-- name: rotation_xcom
-- XCom values after (task instance, key) ($1, $2), in that order, $3 at a time, for key
-- rotation.
SELECT ti_id, key, value FROM deferral_xcom
WHERE (ti_id, key) > ($1, $2)
ORDER BY ti_id, key
LIMIT $3;

-- name: rotate_xcom_values
-- Store re-encrypted XCom values ($1 task instances, $2 keys, $3 old values, $4 new ones),
-- each only if it still holds the value that was read. Returns the rows rewritten.
UPDATE deferral_xcom x
SET value = o.new_value
FROM unnest($1::bigint[], $2::text[], $3::bytea[], $4::bytea[])
    AS o(ti_id, key, old_value, new_value)
WHERE x.ti_id = o.ti_id AND x.key = o.key AND x.value = o.old_value
RETURNING x.ti_id;

-- name: claim_callbacks
-- Claim up to $3 callback requests (migration 0022) for worker $1, of the queues $2 or of
-- none (a run's), oldest first: those nobody holds (never claimed, or their worker's row went)
-- and those whose lease passed. The claim holds each for $4 seconds. Returns what a worker
-- needs to build the callback's context (the task instance's try, its run).
WITH picked AS (
    SELECT c.id FROM deferral_callback_requests c
    WHERE (c.worker_id IS NULL OR c.lease_until < now())
      AND (c.queue IS NULL OR c.queue = ANY ($2::text[]))
    ORDER BY c.id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE deferral_callback_requests c
    SET worker_id = $1, lease_until = now() + make_interval(secs => $4), claims = c.claims + 1
    WHERE c.id = ANY (ARRAY(SELECT p.id FROM picked p))
    RETURNING c.*
)
SELECT c.id, c.kind, c.dag_id, c.ti_id, c.try_number, c.error, c.deadline_index,
       c.deadline_at, c.claims, c.created_at, r.run_id, r.logical_date, r.conf,
       r.data_interval_start, r.data_interval_end, r.run_type, r.state AS run_state,
       r.created_at AS queued_at, ti.task_id, ti.map_index, ti.first_try_at, ti.try_started_at,
       ti.execution_timeout_s, now() AS db_now
FROM claimed c
JOIN deferral_dag_runs r ON r.id = c.dag_run_id
LEFT JOIN deferral_task_instances ti ON ti.id = c.ti_id
ORDER BY c.id;

-- name: finish_callback
-- A callback request ran (or was given up): it goes, if worker $2 still holds it.
DELETE FROM deferral_callback_requests WHERE id = $1 AND worker_id = $2 RETURNING id;

-- name: list_callback_requests
-- The callback requests not run yet, oldest first (tests, the CLI).
SELECT c.id, c.kind, c.dag_id, c.ti_id, c.try_number, c.error, c.deadline_index,
       c.deadline_at, c.worker_id, c.lease_until, c.claims, c.created_at
FROM deferral_callback_requests c ORDER BY c.id;
