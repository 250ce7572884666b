-- Admission (issue: pools, priorities, limits, queues). A worker's claim admits what every
-- limit has room for, one claim at a time (deferral_claim_tasks below).

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

ALTER TABLE deferral_task_instances
    ADD COLUMN pool_slots integer NOT NULL DEFAULT 1 CHECK (pool_slots >= 1),
    ADD COLUMN queue text NOT NULL DEFAULT 'default',
    ADD COLUMN max_active_tis_per_dag integer CHECK (max_active_tis_per_dag >= 1),
    ADD COLUMN trigger_queue text NOT NULL DEFAULT 'default';
-- the deferred tasks of a pool, counted when the pool includes them
CREATE INDEX deferral_ti_deferred_pool ON deferral_task_instances (pool) WHERE state = 'deferred';

-- running tasks of one DAG at once (null: no limit)
ALTER TABLE deferral_dags ADD COLUMN max_active_tasks integer CHECK (max_active_tasks >= 1);

-- a trigger runs on a triggerer serving its queue
ALTER TABLE deferral_triggers ADD COLUMN queue text NOT NULL DEFAULT 'default';
ALTER TABLE deferral_workers ADD COLUMN queues text[] NOT NULL DEFAULT '{default}';
ALTER TABLE deferral_triggerers ADD COLUMN queues text[] NOT NULL DEFAULT '{default}';

-- When a queue last had a live worker or triggerer serving it (for "why is this task not
-- running"): written at registration and by the scheduler's housekeeping.
CREATE TABLE deferral_queues_seen (
    kind         text NOT NULL CHECK (kind IN ('worker', 'triggerer')),
    queue        text NOT NULL,
    last_seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, queue)
);

-- Admit and claim up to p_limit runnable task instances of the queues p_queues for worker
-- p_worker, highest priority first (ties: oldest run_after, then id), within every limit:
-- the pool's slots (running tasks, and deferred ones where the pool includes them), the DAG's
-- max_active_tasks, the task's max_active_tis_per_dag and p_parallelism (running tasks across
-- all workers; 0: no limit). A task whose pool does not exist is claimed too, with
-- missing_pool set: the worker fails it at once naming the pool.
-- Admission is serial: a transaction-scoped advisory lock, then the counts, each statement of
-- this function with a snapshot taken after the lock, so two claims never both spend the same
-- free slot. The claim itself is the one UPDATE (scheduled/up_for_retry/up_for_reschedule ->
-- running); what a limit holds back stays where it is, never failed.
CREATE FUNCTION deferral_claim_tasks(
    p_worker bigint, p_limit integer, p_queues text[], p_parallelism integer
) RETURNS TABLE (id bigint, missing_pool boolean) LANGUAGE plpgsql ROWS 16 AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(74657203);
    RETURN QUERY
    WITH busy AS MATERIALIZED (
        SELECT b.pool, b.dag_id, b.task_id, b.pool_slots
        FROM deferral_task_instances b WHERE b.state IN ('running', 'queued')
    ), pool_room AS MATERIALIZED (
        SELECT p.name, p.slots
             - COALESCE((SELECT sum(b.pool_slots) FROM busy b WHERE b.pool = p.name), 0)
             - CASE WHEN p.include_deferred
                    THEN COALESCE((SELECT sum(d.pool_slots) FROM deferral_task_instances d
                                   WHERE d.state = 'deferred' AND d.pool = p.name), 0)
                    ELSE 0 END AS room
        FROM deferral_pools p
    ), dag_busy AS MATERIALIZED (
        SELECT b.dag_id, count(*) AS n FROM busy b GROUP BY b.dag_id
    ), task_busy AS MATERIALIZED (
        SELECT b.dag_id, b.task_id, count(*) AS n FROM busy b GROUP BY b.dag_id, b.task_id
    ), candidate AS MATERIALIZED (
        SELECT ti.id, ti.pool, ti.pool_slots, ti.dag_id, ti.task_id, ti.priority, ti.run_after,
               pr.name IS NULL AS missing, pr.room AS pool_room,
               d.max_active_tasks - COALESCE(db.n, 0) AS dag_room,
               ti.max_active_tis_per_dag - COALESCE(tb.n, 0) AS task_room
        FROM deferral_task_instances ti
        LEFT JOIN pool_room pr ON pr.name = ti.pool
        LEFT JOIN deferral_dags d ON d.dag_id = ti.dag_id
        LEFT JOIN dag_busy db ON db.dag_id = ti.dag_id
        LEFT JOIN task_busy tb ON tb.dag_id = ti.dag_id AND tb.task_id = ti.task_id
        WHERE ti.state IN ('scheduled', 'up_for_retry', 'up_for_reschedule')
          AND ti.run_after <= now() AND ti.queue = ANY (p_queues)
          -- what a full limit holds back is not even looked at
          AND (pr.name IS NULL OR ti.pool_slots <= pr.room)
          AND (d.max_active_tasks IS NULL OR COALESCE(db.n, 0) < d.max_active_tasks)
          AND (ti.max_active_tis_per_dag IS NULL OR COALESCE(tb.n, 0) < ti.max_active_tis_per_dag)
        ORDER BY ti.priority DESC, ti.run_after, ti.id
        LIMIT p_limit * 4
        FOR UPDATE OF ti SKIP LOCKED
    ), ranked AS (
        -- what the candidates before each one (in claim order) would take of each limit
        SELECT c.*,
               sum(c.pool_slots) OVER (PARTITION BY c.pool ORDER BY c.priority DESC,
                                       c.run_after, c.id) AS pool_take,
               row_number() OVER (PARTITION BY c.dag_id ORDER BY c.priority DESC, c.run_after,
                                  c.id) AS dag_take,
               row_number() OVER (PARTITION BY c.dag_id, c.task_id ORDER BY c.priority DESC,
                                  c.run_after, c.id) AS task_take,
               row_number() OVER (ORDER BY c.priority DESC, c.run_after, c.id) AS all_take
        FROM candidate c
    )
    SELECT r.id, r.missing FROM ranked r
    WHERE (r.missing OR r.pool_take <= r.pool_room)
      AND (r.dag_room IS NULL OR r.dag_take <= r.dag_room)
      AND (r.task_room IS NULL OR r.task_take <= r.task_room)
      AND (p_parallelism <= 0 OR r.all_take <= p_parallelism - (SELECT count(*) FROM busy))
    ORDER BY r.priority DESC, r.run_after, r.id
    LIMIT p_limit;
END;
$$;
