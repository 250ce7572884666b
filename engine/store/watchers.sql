-- Named queries of asset watchers on the triggerer (engine/store/watchers.py; the schema:
-- migration 0025_watchers.sql). Parsed with queries.sql into one set of names. A watcher runs
-- as a trigger row (dedup_key 'watcher:<digest>') that no task waits on: claimed, leased,
-- fenced and adopted like any trigger; its events never delete it.

-- name: watcher_sync_lock
-- One reconciliation at a time (the schedulers' duty and every DAG scan may run it).
SELECT pg_advisory_xact_lock(74657203, 0);

-- name: watcher_declarations
-- Every declared watcher: its trigger as declared (classpath, encrypted kwargs), whether it
-- runs (an active, unpaused DAG is scheduled on its asset: a watcher is for the DAGs that wait
-- on its events, not for an asset only written by tasks' outlets, as in Airflow), and the
-- trigger row that runs it now, if any.
SELECT w.asset, w.name, w.classpath, w.kwargs, w.trigger_key,
       t.id AS trigger_id,
       EXISTS (SELECT 1 FROM deferral_dag_assets da
               JOIN deferral_dags d ON d.dag_id = da.dag_id AND d.is_active
                                   AND NOT d.is_paused
               WHERE da.asset = w.asset AND da.role = 'schedule') AS active
FROM deferral_asset_watchers w
LEFT JOIN deferral_triggers t ON t.id = w.trigger_id
ORDER BY w.asset, w.name;

-- name: sync_watcher_triggers
-- Make the watchers' trigger rows match their declarations, after watcher_sync_lock in the
-- same transaction: delete the rows $6 (watchers stopped or changed) and the watcher rows no
-- watcher refers to any more (watcher declared no more), and insert a row for each watcher
-- $1 (asset), $2 (name) to start ($3 classpath, $4 encrypted kwargs, $5 digest), linking it
-- to its watcher. A watcher whose trigger changed (another digest) starts without a cursor
-- and with its faults forgotten. Wakes the triggerers when it made rows.
WITH gone AS (
    DELETE FROM deferral_triggers t
    WHERE t.dedup_key LIKE 'watcher:%'
      AND (t.id = ANY ($6::bigint[])
           OR NOT EXISTS (SELECT 1 FROM deferral_asset_watchers w WHERE w.trigger_id = t.id))
    RETURNING t.id
), wanted AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[])
        AS n(asset, name, classpath, kwargs, key)
), made AS (
    INSERT INTO deferral_triggers (classpath, kwargs, dedup_key)
    SELECT n.classpath, n.kwargs, 'watcher:' || n.key FROM wanted n
    ON CONFLICT (dedup_key) DO NOTHING
    RETURNING id, dedup_key
), linked AS (
    UPDATE deferral_asset_watchers w
    SET trigger_id = m.id, trigger_key = n.key,
        cursor = CASE WHEN w.trigger_key = n.key THEN w.cursor END,
        events = CASE WHEN w.trigger_key = n.key THEN w.events ELSE 0 END,
        restarts = CASE WHEN w.trigger_key = n.key THEN w.restarts ELSE 0 END,
        last_error = CASE WHEN w.trigger_key = n.key THEN w.last_error END,
        last_error_at = CASE WHEN w.trigger_key = n.key THEN w.last_error_at END,
        retry_at = NULL, written_fence = 0, written_seq = 0  -- (a new row's fences start at 1)
    FROM wanted n JOIN made m ON m.dedup_key = 'watcher:' || n.key
    WHERE w.asset = n.asset AND w.name = n.name
    RETURNING w.trigger_id
)
SELECT (SELECT count(*) FROM gone) AS stopped, (SELECT count(*) FROM linked) AS started,
       CASE WHEN EXISTS (SELECT 1 FROM made) THEN pg_notify('deferral_triggers', '') END
           AS notified;

-- name: claimed_watchers
-- Of the triggers $2 triggerer $1 just claimed, those that run a watcher: the watcher and the
-- cursor its trigger starts from (read after the claim committed, so it is the last one
-- written under the previous owner's fence, which can write nothing any more).
SELECT w.trigger_id, w.asset, w.name, w.cursor, w.restarts
FROM deferral_asset_watchers w
JOIN deferral_triggers t ON t.id = w.trigger_id
WHERE w.trigger_id = ANY ($2::bigint[]) AND t.triggerer_id IS NOT DISTINCT FROM $1;

-- name: record_watcher_events
-- Write a batch of watchers' events in one statement, fenced: only for the trigger rows
-- triggerer $1 still owns with the fence each event was produced under (the rows are locked
-- FOR SHARE: a claim that took one commits before or waits until after this write, and a
-- write after it finds the new fence and writes nothing). Per item: $2 trigger id, $3 fence,
-- $4 the event's extra (JSON), $5 whether it is an asset event (false: a checkpoint, only its
-- cursor), $6 the cursor after it (MessagePack), $7 whether it carries one, $8 its sequence
-- number in its run: items at or below the watcher's written (fence, seq) were written
-- already (a batch retried after its reply was lost) and are skipped. Each asset
-- event is inserted into deferral_asset_events (whose trigger queues it for the DAGs
-- scheduled on its asset) and each watcher's cursor becomes the last one given for it.
-- Returns the trigger ids whose items were written, or were written already (every item of a
-- retried batch skipped: the trigger is still this triggerer's).
WITH item AS (
    SELECT * FROM unnest($2::bigint[], $3::bigint[], $4::jsonb[], $5::boolean[], $6::bytea[],
                         $7::boolean[], $8::bigint[])
        WITH ORDINALITY AS i(trigger_id, fence, extra, is_event, cursor, has_cursor, seq, n)
), owned AS MATERIALIZED (
    SELECT t.id, t.fence FROM deferral_triggers t
    WHERE t.id = ANY ($2::bigint[]) AND t.triggerer_id IS NOT DISTINCT FROM $1  -- see fire_triggers
    FOR SHARE
), ok AS MATERIALIZED (
    SELECT i.*, w.asset, w.name
    FROM item i
    JOIN owned o ON o.id = i.trigger_id AND o.fence = i.fence
    JOIN deferral_asset_watchers w ON w.trigger_id = i.trigger_id
    WHERE (i.fence, i.seq) > (w.written_fence, w.written_seq)
), recorded AS (
    INSERT INTO deferral_asset_events (asset, extra, source_kind, source_name)
    SELECT ok.asset, COALESCE(ok.extra, '{}'::jsonb), 'watcher', ok.name
    FROM ok WHERE ok.is_event
    ORDER BY ok.n
    RETURNING id
), last_cursor AS (
    SELECT DISTINCT ON (trigger_id) trigger_id, cursor FROM ok WHERE has_cursor
    ORDER BY trigger_id, n DESC
), counts AS (
    SELECT trigger_id, count(*) FILTER (WHERE is_event) AS events, max(fence) AS fence,
           max(seq) AS seq
    FROM ok GROUP BY trigger_id
), moved AS (
    UPDATE deferral_asset_watchers w
    SET cursor = CASE WHEN lc.trigger_id IS NULL THEN w.cursor ELSE lc.cursor END,
        events = w.events + c.events, written_fence = c.fence, written_seq = c.seq,
        retry_at = NULL
    FROM counts c LEFT JOIN last_cursor lc ON lc.trigger_id = c.trigger_id
    WHERE w.trigger_id = c.trigger_id
    RETURNING w.trigger_id
)
SELECT DISTINCT i.trigger_id, (SELECT count(*) FROM recorded) AS recorded,
       (SELECT count(*) FROM moved) AS moved
FROM item i
JOIN owned o ON o.id = i.trigger_id AND o.fence = i.fence
JOIN deferral_asset_watchers w ON w.trigger_id = i.trigger_id;

-- name: watcher_failed
-- Triggerer $1's run of watcher trigger $2 (fence $3) raised or ended: record the error $4,
-- count the restart and say when it starts again ($5 seconds), fenced like its events. $6
-- false: no restart (an event of a trigger that runs on could not be stored): only the error.
UPDATE deferral_asset_watchers w
SET last_error = $4, last_error_at = now(),
    restarts = w.restarts + CASE WHEN $6::boolean THEN 1 ELSE 0 END,
    retry_at = CASE WHEN $6::boolean THEN now() + make_interval(secs => $5) ELSE w.retry_at END
FROM deferral_triggers t
WHERE w.trigger_id = $2 AND t.id = $2 AND t.triggerer_id IS NOT DISTINCT FROM $1
  AND t.fence = $3
RETURNING w.restarts;

-- name: watcher_states
-- Every watcher with what runs it: its trigger row's owner (id, host, pid), its counts and
-- last fault (the CLI's `assets list`, the tests).
SELECT w.asset, w.name, w.classpath, w.trigger_id, t.triggerer_id, r.hostname, r.pid,
       w.events, w.restarts, w.last_error, w.last_error_at, w.retry_at, w.cursor
FROM deferral_asset_watchers w
LEFT JOIN deferral_triggers t ON t.id = w.trigger_id
LEFT JOIN deferral_triggerers r ON r.id = t.triggerer_id
ORDER BY w.asset, w.name;
