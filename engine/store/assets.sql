-- Named queries of assets and their events (engine/store/assets.py; the schema: migration
-- 0024_assets.sql). Parsed with queries.sql into one set of names. A task's events are written
-- by finish_tasks (queries.sql) with its success; every other writer uses
-- record_asset_events. Either way the trigger deferral_asset_events_queue queues the events
-- for the DAGs scheduled on their assets, and create_asset_runs makes the runs.

-- name: upsert_assets
-- Record assets as a DAG file declares them ($1 names, $2 uris, $3 groups, $4 extras). A null
-- group and extra (a bare declaration while another active DAG declares the asset) keeps
-- those recorded. An asset recorded as it is now is not written.
INSERT INTO deferral_assets AS a (name, uri, asset_group, extra)
SELECT n.name, n.uri,
       COALESCE(n.grp, (SELECT o.asset_group FROM deferral_assets o WHERE o.name = n.name),
                'asset'),
       COALESCE(n.extra, (SELECT o.extra FROM deferral_assets o WHERE o.name = n.name),
                '{}'::jsonb)
FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[]) AS n(name, uri, grp, extra)
ON CONFLICT (name) DO UPDATE
SET uri = EXCLUDED.uri, asset_group = EXCLUDED.asset_group, extra = EXCLUDED.extra,
    updated_at = now()
WHERE (a.uri, a.asset_group, a.extra)
      IS DISTINCT FROM (EXCLUDED.uri, EXCLUDED.asset_group, EXCLUDED.extra);

-- name: asset_conflicts
-- Of the assets $2 (names) with uris $3 and declarations $4 (digest of group, extra and
-- watchers; null: bare) that DAG $1 declares, those another active DAG uses under another
-- uri, whose uri another active DAG uses under another name, or that another active DAG
-- declares otherwise (both not bare): the DAG cannot be recorded with them. Returns the
-- asset, the other DAG and what it has ('declared': it differs in group, extra or watchers).
SELECT n.name, a.name AS other_name, a.uri AS other_uri, da.dag_id AS other_dag,
       (a.name = n.name AND a.uri = n.uri) AS declared
FROM unnest($2::text[], $3::text[], $4::text[]) AS n(name, uri, declared)
JOIN deferral_assets a ON (a.name = n.name AND a.uri <> n.uri)
                       OR (a.uri = n.uri AND a.name <> n.name)
                       OR (a.name = n.name AND n.declared IS NOT NULL)
JOIN deferral_dag_assets da ON da.asset = a.name AND da.dag_id <> $1
JOIN deferral_dags d ON d.dag_id = da.dag_id AND d.is_active
WHERE a.name <> n.name OR a.uri <> n.uri
   OR (da.declared IS NOT NULL AND da.declared <> n.declared)
ORDER BY n.name, a.name, da.dag_id;

-- name: assets_declared_elsewhere
-- Of assets $2, those an active DAG other than $1 declares (not bare: group, extra or
-- watchers): their group, extra and watchers are that DAG's.
SELECT DISTINCT da.asset
FROM deferral_dag_assets da
JOIN deferral_dags d ON d.dag_id = da.dag_id AND d.is_active
WHERE da.asset = ANY ($2::text[]) AND da.dag_id <> $1 AND da.declared IS NOT NULL;

-- name: set_dag_assets
-- The assets DAG $1 uses now ($2 assets, $3 roles: 'schedule' or 'outlet', $4 what it
-- declares of them: see asset_conflicts), replacing what was recorded of it. Events queued
-- for the DAG of an asset it is no longer scheduled on are dropped from its queue (they stay
-- recorded).
WITH wanted AS (
    SELECT DISTINCT * FROM unnest($2::text[], $3::text[], $4::text[]) AS w(asset, role, declared)
), gone AS (
    DELETE FROM deferral_dag_assets da
    WHERE da.dag_id = $1
      AND NOT EXISTS (SELECT 1 FROM wanted w WHERE w.asset = da.asset AND w.role = da.role)
), unqueued AS (
    DELETE FROM deferral_asset_queue q
    WHERE q.dag_id = $1
      AND NOT EXISTS (SELECT 1 FROM wanted w WHERE w.asset = q.asset AND w.role = 'schedule')
)
INSERT INTO deferral_dag_assets AS da (dag_id, asset, role, declared)
SELECT $1, w.asset, w.role, w.declared FROM wanted w
ON CONFLICT (asset, role, dag_id) DO UPDATE SET declared = EXCLUDED.declared
WHERE da.declared IS DISTINCT FROM EXCLUDED.declared;

-- name: set_asset_watchers
-- The watchers of assets $1 as declared now ($2 assets, $3 names, $4 classpaths, $5 kwargs:
-- encoded and encrypted), replacing the ones recorded of those assets: a watcher no longer
-- declared goes, a changed one is updated (by asset and name). $1 leaves out the assets a
-- DAG uses bare while another active DAG declares them: it leaves that DAG's watchers.
WITH wanted AS (
    SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::bytea[])
        AS w(asset, name, classpath, kwargs)
), gone AS (
    DELETE FROM deferral_asset_watchers aw
    WHERE aw.asset = ANY ($1::text[])
      AND NOT EXISTS (SELECT 1 FROM wanted w WHERE w.asset = aw.asset AND w.name = aw.name)
)
INSERT INTO deferral_asset_watchers (asset, name, classpath, kwargs)
SELECT * FROM wanted
ON CONFLICT (asset, name) DO UPDATE
SET classpath = EXCLUDED.classpath, kwargs = EXCLUDED.kwargs
WHERE (deferral_asset_watchers.classpath, deferral_asset_watchers.kwargs)
      IS DISTINCT FROM (EXCLUDED.classpath, EXCLUDED.kwargs);

-- name: record_asset_events
-- THE way to record asset events outside a task's success (watchers, the webhook, the CLI):
-- per event $1 the asset, $2 its extra (JSON), $3 the source kind ('watcher', 'webhook',
-- 'cli', 'task'), $4 the source's name (a watcher's name; who, for the webhook and the CLI),
-- $5..$8 the source task's dag, run, task and map index (null unless a task). Events of
-- unknown assets are not written: the rows returned (id, asset, created_at, in the order
-- given) are those that were. The trigger on the table queues them for the DAGs scheduled
-- on their assets and wakes the schedulers, in this statement's transaction.
INSERT INTO deferral_asset_events (asset, extra, source_kind, source_name, source_dag_id,
                                   source_run_id, source_task_id, source_map_index)
SELECT e.asset, COALESCE(e.extra, '{}'::jsonb), e.kind, e.name, e.dag_id, e.run_id, e.task_id,
       e.map_index
FROM unnest($1::text[], $2::jsonb[], $3::text[], $4::text[], $5::text[], $6::text[],
            $7::text[], $8::integer[])
    WITH ORDINALITY AS e(asset, extra, kind, name, dag_id, run_id, task_id, map_index, n)
WHERE EXISTS (SELECT 1 FROM deferral_assets a WHERE a.name = e.asset)
ORDER BY e.n
RETURNING id, asset, created_at;

-- name: lock_asset_ready_dags
-- Of the DAGs with queued events, up to $1 whose asset condition holds over the assets of
-- their queued events (deferral_asset_condition) and that have fewer than max_active_runs
-- runs queued or running, locked (SKIP LOCKED: another scheduler takes the others). The
-- first statement of create_asset_runs' transaction: this statement's snapshot predates
-- the locks, so create_asset_runs judges the locked DAGs again on a snapshot taken under
-- them. Returns their ids.
WITH RECURSIVE pairs AS (
    -- the distinct (DAG, asset) pairs of the queue, one index probe each (a loose index scan:
    -- not a read of every queued event)
    (SELECT q.dag_id, q.asset FROM deferral_asset_queue q ORDER BY q.dag_id, q.asset LIMIT 1)
    UNION ALL
    SELECT n.dag_id, n.asset
    FROM pairs p
    CROSS JOIN LATERAL (
        SELECT q.dag_id, q.asset FROM deferral_asset_queue q
        WHERE (q.dag_id, q.asset) > (p.dag_id, p.asset)
        ORDER BY q.dag_id, q.asset LIMIT 1
    ) n
), pending AS (
    SELECT dag_id, array_agg(asset) AS assets FROM pairs GROUP BY dag_id
)
SELECT d.dag_id
FROM deferral_dags d
JOIN pending p ON p.dag_id = d.dag_id
WHERE d.is_active AND NOT d.is_paused AND d.timetable->>'kind' = 'assets'
  AND deferral_asset_condition(d.timetable->'condition', p.assets)
  AND (SELECT count(*) FROM deferral_dag_runs r
       WHERE r.dag_id = d.dag_id AND r.state IN ('queued', 'running')
         AND r.run_type <> 'backfill') < d.max_active_runs
ORDER BY d.dag_id
LIMIT $1
FOR UPDATE OF d SKIP LOCKED;

-- name: create_asset_runs
-- Create a queued asset-triggered run for each of the DAGs $1 (locked by
-- lock_asset_ready_dags in this transaction) whose asset condition holds over the assets of
-- their queued events, unless the DAG already has max_active_runs runs queued or running:
-- every event queued for the DAG is consumed by that one run (events queued while a DAG
-- waits, for its condition or for a free run, collapse into one run). Judged again here, on
-- this statement's snapshot, taken once the DAGs were locked: it sees every run and every
-- consumption another scheduler committed while holding a DAG's lock, so a run is never
-- made of what another scheduler consumed, nor beyond max_active_runs. The run's logical
-- date is its newest event's time, its data interval spans its events'. Returns the runs.
WITH pending AS (
    SELECT q.dag_id, array_agg(DISTINCT q.asset) AS assets
    FROM deferral_asset_queue q
    WHERE q.dag_id = ANY ($1::text[])
    GROUP BY q.dag_id
), ready AS (
    SELECT d.dag_id
    FROM deferral_dags d
    JOIN pending p ON p.dag_id = d.dag_id
    WHERE d.is_active AND NOT d.is_paused AND d.timetable->>'kind' = 'assets'
      AND deferral_asset_condition(d.timetable->'condition', p.assets)
      AND (SELECT count(*) FROM deferral_dag_runs r
           WHERE r.dag_id = d.dag_id AND r.state IN ('queued', 'running')
             AND r.run_type <> 'backfill') < d.max_active_runs
), taken AS (
    -- (by an array of ids: a join with ready was planned as a read of the whole queue)
    DELETE FROM deferral_asset_queue q
    WHERE q.dag_id = ANY (ARRAY(SELECT ready.dag_id FROM ready))
    RETURNING q.dag_id, q.event_id
), span AS (
    SELECT t.dag_id, min(e.created_at) AS first_at, max(e.created_at) AS last_at,
           count(*) AS events
    FROM taken t JOIN deferral_asset_events e ON e.id = t.event_id
    GROUP BY t.dag_id
), runs AS (
    INSERT INTO deferral_dag_runs (dag_id, run_id, logical_date, data_interval_start,
                                   data_interval_end, run_type, state, created_at)
    SELECT s.dag_id,
           'asset_triggered__'
           || to_char(s.last_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')
           || '_' || substr(md5(random()::text), 1, 8),
           s.last_at, s.first_at, s.last_at, 'asset_triggered', 'queued', clock_timestamp()
    FROM span s
    RETURNING id, dag_id, run_id
), links AS (
    INSERT INTO deferral_run_asset_events (dag_run_id, event_id)
    SELECT runs.id, t.event_id FROM runs JOIN taken t ON t.dag_id = runs.dag_id
)
SELECT runs.id, runs.dag_id, runs.run_id, s.events
FROM runs JOIN span s ON s.dag_id = runs.dag_id;

-- name: run_asset_events
-- The events that triggered runs $1 (ids), oldest first per run.
SELECT l.dag_run_id, e.id, e.asset, a.uri, e.extra, e.source_kind, e.source_dag_id,
       e.source_run_id, e.source_task_id, e.source_map_index, e.source_name, e.created_at
FROM deferral_run_asset_events l
JOIN deferral_asset_events e ON e.id = l.event_id
JOIN deferral_assets a ON a.name = e.asset
WHERE l.dag_run_id = ANY ($1::bigint[])
ORDER BY l.dag_run_id, e.id;

-- name: list_assets
-- The assets some active DAG uses (or every recorded one, $1), by name: their watchers (name
-- and classpath), latest event, and the DAGs scheduled on them.
SELECT a.name, a.uri, a.asset_group, a.extra, a.updated_at,
       -- (with each watcher's runtime, migration 0025_watchers.sql: state 'running' on a
       -- triggerer, 'restarting' after a fault until retry_at, 'unclaimed' waiting for a
       -- triggerer, 'stopped' with no trigger row: no active, unpaused DAG is scheduled on it)
       COALESCE((SELECT jsonb_agg(jsonb_build_object(
                            'name', w.name, 'classpath', w.classpath,
                            'state', CASE WHEN t.id IS NULL THEN 'stopped'
                                          WHEN t.triggerer_id IS NULL THEN 'unclaimed'
                                          WHEN w.retry_at > now() THEN 'restarting'
                                          ELSE 'running' END,
                            'triggerer', CASE WHEN r.id IS NOT NULL
                                              THEN r.hostname || ':' || r.pid END,
                            'triggerer_id', t.triggerer_id,
                            'events', w.events, 'restarts', w.restarts,
                            'last_error', w.last_error, 'last_error_at', w.last_error_at,
                            'retry_at', w.retry_at)
                                  ORDER BY w.name)
                 FROM deferral_asset_watchers w
                 LEFT JOIN deferral_triggers t ON t.id = w.trigger_id
                 LEFT JOIN deferral_triggerers r ON r.id = t.triggerer_id
                 WHERE w.asset = a.name), '[]'::jsonb)
           AS watchers,
       last.id AS last_event_id, last.created_at AS last_event_at,
       last.source_kind AS last_event_source,
       ARRAY(SELECT da.dag_id FROM deferral_dag_assets da
             JOIN deferral_dags d ON d.dag_id = da.dag_id AND d.is_active
             WHERE da.asset = a.name AND da.role = 'schedule' ORDER BY da.dag_id)
           AS scheduled_dags,
       ARRAY(SELECT da.dag_id FROM deferral_dag_assets da
             JOIN deferral_dags d ON d.dag_id = da.dag_id AND d.is_active
             WHERE da.asset = a.name AND da.role = 'outlet' ORDER BY da.dag_id)
           AS producing_dags
FROM deferral_assets a
LEFT JOIN LATERAL (
    SELECT e.id, e.created_at, e.source_kind FROM deferral_asset_events e
    WHERE e.asset = a.name ORDER BY e.id DESC LIMIT 1
) last ON true
WHERE $1::boolean OR EXISTS (
    SELECT 1 FROM deferral_dag_assets da JOIN deferral_dags d ON d.dag_id = da.dag_id
    WHERE da.asset = a.name AND d.is_active)
ORDER BY a.name;

-- name: get_asset
-- One asset by name.
SELECT name, uri, asset_group, extra, updated_at FROM deferral_assets WHERE name = $1;

-- name: asset_events
-- The latest $2 events of asset $1, newest first.
SELECT e.id, e.asset, a.uri, e.extra, e.source_kind, e.source_dag_id, e.source_run_id,
       e.source_task_id, e.source_map_index, e.source_name, e.created_at
FROM deferral_asset_events e JOIN deferral_assets a ON a.name = e.asset
WHERE e.asset = $1
ORDER BY e.id DESC
LIMIT $2;

-- name: asset_watchers
-- The watchers of every asset some active DAG uses, with their trigger as stored (classpath,
-- encrypted kwargs).
SELECT w.asset, w.name, w.classpath, w.kwargs
FROM deferral_asset_watchers w
WHERE EXISTS (SELECT 1 FROM deferral_dag_assets da JOIN deferral_dags d ON d.dag_id = da.dag_id
              WHERE da.asset = w.asset AND d.is_active)
ORDER BY w.asset, w.name;

-- name: queued_asset_events
-- The events queued for DAG $1 (none: every DAG), not yet consumed by a run.
SELECT q.dag_id, q.asset, q.event_id FROM deferral_asset_queue q
WHERE $1::text IS NULL OR q.dag_id = $1
ORDER BY q.dag_id, q.event_id;

-- name: forget_dag_fingerprint
-- DAG $1's assets could not be recorded: its row is written again by the next scan.
UPDATE deferral_dags SET fingerprint = NULL WHERE dag_id = $1;

-- name: triggering_asset_events
-- The events that triggered run $2 of DAG $1 (none: not an asset-triggered run), oldest first.
SELECT l.dag_run_id, e.id, e.asset, a.uri, e.extra, e.source_kind, e.source_dag_id,
       e.source_run_id, e.source_task_id, e.source_map_index, e.source_name, e.created_at
FROM deferral_dag_runs r
JOIN deferral_run_asset_events l ON l.dag_run_id = r.id
JOIN deferral_asset_events e ON e.id = l.event_id
JOIN deferral_assets a ON a.name = e.asset
WHERE r.dag_id = $1 AND r.run_id = $2
ORDER BY e.id;

-- name: runs_asset_events
-- The events that triggered the runs ($1 DAG ids, $2 run ids, pairwise), oldest first per
-- run (runs list --json).
SELECT r.dag_id, r.run_id, e.id, e.asset, a.uri, e.extra, e.source_kind, e.source_dag_id,
       e.source_run_id, e.source_task_id, e.source_map_index, e.source_name, e.created_at
FROM unnest($1::text[], $2::text[]) AS u(dag_id, run_id)
JOIN deferral_dag_runs r ON r.dag_id = u.dag_id AND r.run_id = u.run_id
JOIN deferral_run_asset_events l ON l.dag_run_id = r.id
JOIN deferral_asset_events e ON e.id = l.event_id
JOIN deferral_assets a ON a.name = e.asset
ORDER BY r.dag_id, r.run_id, e.id;
