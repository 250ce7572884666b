-- The task instances of a run, from its DAG's serialized tasks (deferral_dags.tasks): one row a
-- task, its columns as deferral_task_instances names them. Tasks without upstreams (or whose
-- rule is 'always') start scheduled, the others pending. tries_before ({task_id: try number};
-- null: none) is what a run a backfill reprocessed had reached: its tries number on from there,
-- and its retries count past them (as a clear does). create_dag_run and start_queued_runs
-- insert these rows; a single SELECT in SQL, so the planner inlines it into their plans.
CREATE FUNCTION deferral_task_rows(tasks jsonb, tries_before jsonb)
RETURNS TABLE (
    task_id text, state text, try_number integer, retries integer,
    retry_delay_s double precision, retry_exponential_backoff boolean,
    max_retry_delay_s double precision, execution_timeout_s double precision, soft_fail boolean,
    trigger_rule text, upstream text[], is_leaf boolean, priority integer, pool text,
    no_retry_on_timeout boolean, pool_slots integer, queue text, trigger_queue text,
    max_active_tis_per_dag integer
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
           t.max_active_tis_per_dag
    FROM jsonb_to_recordset(tasks) AS t(
        task_id text, upstream text[], trigger_rule text, retries integer,
        retry_delay_s double precision, retry_exponential_backoff boolean,
        max_retry_delay_s double precision, execution_timeout_s double precision,
        soft_fail boolean, is_leaf boolean, priority integer, pool text,
        no_retry_on_timeout boolean, pool_slots integer, queue text, trigger_queue text,
        max_active_tis_per_dag integer)
$$;
