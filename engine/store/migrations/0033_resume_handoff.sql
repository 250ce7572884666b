-- Resumes handed to a worker as their triggers fire (issue 21).
--
-- A resume cost two writes of its task instance before the resumed method ran: the fire made
-- it runnable ('scheduled'), and a worker's claim, woken by the fire's notification, took the
-- admission's lock and made it 'running'. Every worker woke for each fire and all but one
-- claimed nothing. Now the fire itself claims the resumes it can admit for one worker: the
-- live worker that takes resumes (takes_resumes, set by the worker while it runs, cleared as it
-- stops) with the most free slots. It takes the admission's lock as a claim does and admits
-- conservatively: a resume of a queue that worker serves, in a pool that exists (whose room
-- holds it, or that counts deferred tasks: the slot is the resume's already), of a DAG without
-- max_active_tasks and a task without max_active_tis_per_dag, no earlier try stopping, at most
-- the worker's free slots, and only while no live worker counts a global parallelism. The
-- task instance goes from 'deferred' to 'running' on that worker in the fire's one write, its
-- "resuming at" log line is written with it, and the worker is told by a notification naming
-- it ('handed <id>'); it reads what it was handed (the rows marked handed, below: at most its
-- free slots, the rest given back). Every other resume is made runnable as before, for a claim.
-- A handed resume stays marked unread (handed) until its worker reads it (take_handed). One
-- that no worker read (the worker died or left first, or missed the notification and its
-- poll) is given back, the same try, for any worker to claim: by the worker's unregistration
-- at once, or by the scheduler a few seconds after the fire (reap_zombie_tasks). So a worker
-- that dies never fails a resume it did not start, as no claim it did not make fails.
-- A worker that takes resumes claims no more than its slots hold once the admission's lock is
-- granted (deferral_claim_tasks, below): its claim's limit was counted before, and a fire may
-- have handed it resumes meanwhile.

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

CREATE OR REPLACE FUNCTION deferral_fire_triggers(
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

-- The claim as 0032 left it, except that a worker that takes resumes claims no more than its
-- slots hold once the lock is granted (v_room).
CREATE OR REPLACE FUNCTION deferral_claim_tasks(
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
