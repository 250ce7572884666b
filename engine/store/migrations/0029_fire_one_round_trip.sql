-- A batch of trigger outcomes in one round trip (issue 21): the triggerer locked its triggers
-- (lock_owned_triggers) and then fired them (fire_triggers) in a transaction of its own, four
-- round trips a batch (BEGIN, the lock, the fire, COMMIT) that cost the triggerer's loop about
-- as much CPU as the fire's arrays and rows, and the server four commands. This function runs
-- the same two statements in one call: each statement of a volatile PL/pgSQL function takes a
-- snapshot of its own (READ COMMITTED), so the fire still sees a task that joined a trigger
-- while the lock waited for it, as the second statement of the transaction did. The fire runs
-- with a generic plan (planning it on every call cost about as much as running a small batch;
-- tests/test_query_plans.py pins its generic plan, taken from this function).
--
-- deferral_ti_name is inlined again: its integer || text is the STABLE textanycat, which an
-- IMMUTABLE SQL function may not inline, so each use ran as a function call of its own (one
-- per moved task in fire_triggers and per ended try in finish_tasks). The cast to text is the
-- same text (int4out), and immutable.
CREATE OR REPLACE FUNCTION deferral_ti_name(task_id text, map_index integer) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN map_index < 0 THEN task_id ELSE task_id || '[' || map_index::text || ']' END
$$;

-- Write a batch of trigger outcomes of triggerer p_triggerer (fire_triggers in queries.sql
-- calls it: what it guarantees is said there): lock the triggers, then fire them.
CREATE FUNCTION deferral_fire_triggers(
    p_triggerer bigint, p_ids bigint[], p_fences bigint[], p_kinds text[], p_payloads bytea[],
    p_errors text[], p_shown text[]
) RETURNS TABLE (fired_id bigint, id bigint, dag_run_id bigint, task_id text, state text,
                 is_leaf boolean, woke bigint)
LANGUAGE plpgsql ROWS 100 SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    -- lock_owned_triggers: a task joining a trigger holds its row until it commits; the fire
    -- below, a statement of its own, then sees that task waiting.
    PERFORM 1 FROM deferral_triggers
    WHERE deferral_triggers.id = ANY (p_ids)
      AND deferral_triggers.triggerer_id IS NOT DISTINCT FROM p_triggerer
    ORDER BY deferral_triggers.id
    FOR UPDATE;
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
        SET state = CASE f.kind WHEN 'event' THEN 'scheduled'
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
            trigger_id = NULL, trigger_timeout_at = NULL, deadline_kind = NULL
        FROM fired f
        WHERE ti.trigger_id = f.id AND ti.state = 'deferred'
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
                                            'at %s when a worker claims it', m.trigger_id,
                                            m.classpath, COALESCE(m.shown, 'null'), m.next_method)
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
    ), woke AS (
        SELECT pg_notify('deferral_tasks', '') FROM moved WHERE state = 'scheduled' LIMIT 1
    )
    SELECT f.id AS fired_id, NULL::bigint AS id, NULL::bigint AS dag_run_id, NULL::text AS task_id,
           NULL::text AS state, NULL::boolean AS is_leaf, (SELECT count(*) FROM woke) AS woke
    FROM fired f
    UNION ALL
    SELECT m.trigger_id, m.id, m.dag_run_id, m.task_id, m.state, m.is_leaf, NULL FROM moved m;
END;
$$;
