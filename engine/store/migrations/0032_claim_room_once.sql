-- The admission counts each limit once per claim, not once per candidate (issue 21). The room a
-- candidate's DAG and task had left was a count over every busy task for each candidate, twice,
-- whether or not the DAG has a max_active_tasks or the task a max_active_tis_per_dag (the
-- count was then subtracted from null): at bench throughput (~77 candidates, ~400 busy) that was
-- ~60,000 rows read under the admission lock, most of the query's time. Now the busy tasks are
-- counted in one pass, by DAG for the candidates' DAGs that have a max_active_tasks and by task
-- for the candidates' tasks that have a max_active_tis_per_dag; a DAG or task without a limit is
-- not counted. The rooms are the same numbers as before (null where there is no limit), so
-- every limit is exactly as before.
CREATE OR REPLACE FUNCTION deferral_claim_tasks(
    p_worker bigint, p_limit integer, p_queues text[], p_parallelism integer
) RETURNS TABLE (id bigint, missing_pool boolean) LANGUAGE plpgsql ROWS 16
SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off
SET enable_seqscan = off AS $$
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
