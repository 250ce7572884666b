-- The throughput benchmark's own read-outs (the engine's statements are its own, in
-- engine/store/queries.sql). Read with triggers.sqlfiles.read_queries.

-- name: workers_registered
-- How many worker processes registered in the benchmark's database.
SELECT count(*) FROM deferral_workers

-- name: task_times
-- Each task instance of a DAG: its state, tries, first claim, latest claim and end (epoch s).
SELECT id, state, try_number,
       extract(epoch FROM first_try_at)::float8 AS first_try,
       extract(epoch FROM started_at)::float8 AS claimed,
       extract(epoch FROM ended_at)::float8 AS ended
FROM deferral_task_instances
WHERE dag_id = $1

-- name: postgres_pids
-- The server's processes that serve the benchmark: the backends (and autovacuum workers) of
-- its databases, and the background processes every database shares (WAL writer,
-- checkpointer, ...); the backends of other databases on a shared server are left out.
SELECT pid FROM pg_stat_activity
WHERE datname = ANY($1::text[]) OR (datname IS NULL AND backend_type <> 'client backend')

-- name: pgq_log_times
-- pgqueuer's log of its jobs: when each was picked and when it ended successfully (epoch s).
SELECT job_id, status::text AS status, extract(epoch FROM created)::float8 AS at
FROM pgqueuer_log
WHERE status IN ('picked', 'successful')

-- name: pgq_left
-- Jobs still in pgqueuer's queue (0 after a drain that lost nothing).
SELECT count(*) FROM pgqueuer

-- name: count_progress
-- How many task instances of a DAG ended, and how many of them were deferred at least once or
-- ended (the benchmark's progress poll: deferring is progress too).
SELECT count(*) FILTER (WHERE state IN ('success', 'failed', 'skipped', 'upstream_failed'))
           AS ended,
       count(*) FILTER (WHERE state IN ('success', 'failed', 'skipped', 'upstream_failed')
                        OR next_method IS NOT NULL OR state = 'deferred') AS moved
FROM deferral_task_instances
WHERE dag_id = $1
