-- Cheaper writes on the defer -> fire -> resume cycle (issue 21).
--
-- The fire of a batch of trigger outcomes in linear time. deferral_fire_triggers
-- (0029) runs its fire with a generic plan, planned once per session with the statistics of
-- the moment. Taken while no task waited (a fleet's first deferrals, every benchmark run:
-- ANALYZE sees only runnable tasks), they estimate one waiting task and one trigger, and the
-- plan joined both CTE pairs (the outcomes with the triggers, the fired triggers with their
-- tasks) in nested loops that scanned the inner side again for each row of the outer one:
-- quadratic in the batch (150 outcomes: 22,350 rows removed by join filters in each join),
-- each rescanned row also copied whole for EvalPlanQual (the junk whole-row column of a
-- non-target relation: the row copies were a tenth of PostgreSQL's CPU in bench
-- throughput). Server CPU of a 150-outcome fire: 19-24 ms, 7.6-9.6 ms now. The function
-- plans with enable_nestloop off: each join is a hash of the batch (one pass over each
-- side), whatever the statistics say; no statement of the function needs a nested loop
-- (the triggers are read by their ids, the waiting tasks by their triggers' ids,
-- `ti.trigger_id = ANY (p_ids)`, the same rows as the join's, so that no plan reads every
-- waiting task). The nested statements (constraint and row triggers) are single-table
-- lookups, unaffected. Results, locks (the same rows locked by the same statements) and
-- fencing are unchanged.

CREATE OR REPLACE FUNCTION deferral_fire_triggers(
    p_triggerer bigint, p_ids bigint[], p_fences bigint[], p_kinds text[], p_payloads bytea[],
    p_errors text[], p_shown text[]
) RETURNS TABLE (fired_id bigint, id bigint, dag_run_id bigint, task_id text, state text,
                 is_leaf boolean, woke bigint)
LANGUAGE plpgsql ROWS 100 SET plan_cache_mode = force_generic_plan SET enable_nestloop = off
AS $$
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

-- One index fewer to write on every change of a task instance (issue 21). Each state change
-- of a task instance is a new row version (state is indexed), so it writes an entry in every
-- index of the table that covers it: four full ones and the partial ones its state matches,
-- about six a change and four changes a defer -> fire -> resume cycle. deferral_ti_names
-- (dag_id, run_id, task_id: three text keys, the costliest to compare) served only the
-- statements that find task instances by their DAG's and run's names (the status page, logs,
-- tries, XComs, listing); they now find the run by its unique (dag_id, run_id) and its task
-- instances by the unique key (dag_run_id, task_id, map_index), which reads the same rows
-- (a task instance's dag_id and run_id are always its run's). A fire of 150 outcomes spent
-- ~0.7 of its ~9 ms on that index.
DROP INDEX deferral_ti_names;
