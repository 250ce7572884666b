-- Assets and asset-triggered runs (issue 22). An asset is named data that tasks update
-- (outlets) and DAGs are scheduled on; each update is an asset event. Every writer of events
-- (a task's success, a watcher, the webhook, the CLI) inserts into deferral_asset_events and
-- nothing else: a trigger on that table queues each event for the DAGs scheduled on its asset,
-- and the scheduler turns queued events into runs (create_asset_runs).

ALTER TABLE deferral_dag_runs DROP CONSTRAINT deferral_dag_runs_run_type_check;
ALTER TABLE deferral_dag_runs ADD CONSTRAINT deferral_dag_runs_run_type_check
    CHECK (run_type IN ('scheduled', 'manual', 'backfill', 'asset_triggered'));

-- The assets the DAG files declare (recorded by the DAG scan with the DAGs that use them,
-- record_dag_assets). A row stays when no DAG uses it any more (its events keep their
-- asset); deferral_dag_assets says which DAGs use it now.
CREATE TABLE deferral_assets (
    name        text PRIMARY KEY,
    uri         text NOT NULL,
    asset_group text NOT NULL DEFAULT 'asset',
    extra       jsonb NOT NULL DEFAULT '{}'::jsonb,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Which DAG uses which asset, and how: 'schedule' (the DAG's runs are triggered by its
-- events) or 'outlet' (a task of the DAG records events of it). Replaced whole for a DAG each
-- time the DAG is recorded.
CREATE TABLE deferral_dag_assets (
    dag_id  text NOT NULL REFERENCES deferral_dags (dag_id) ON DELETE CASCADE,
    asset   text NOT NULL REFERENCES deferral_assets (name),
    role    text NOT NULL CHECK (role IN ('schedule', 'outlet')),
    PRIMARY KEY (asset, role, dag_id)
);
CREATE INDEX deferral_dag_assets_dag ON deferral_dag_assets (dag_id);

-- The watchers the assets declare (AssetWatcher: a name, unique per asset, and an event
-- trigger, stored as triggers are: classpath and encrypted, encoded kwargs). Replaced with
-- their asset's record. The triggerer's runtime of watchers adds its own columns or table.
CREATE TABLE deferral_asset_watchers (
    asset     text NOT NULL REFERENCES deferral_assets (name) ON DELETE CASCADE,
    name      text NOT NULL,
    classpath text NOT NULL,
    kwargs    bytea NOT NULL,
    PRIMARY KEY (asset, name)
);

-- One row per asset event. extra: JSON data set by whoever recorded it; source_kind: who did,
-- with its details (a task: dag/run/task/map index; a watcher: source_name is its name; the
-- webhook and the CLI: source_name says who, when known).
CREATE TABLE deferral_asset_events (
    id               bigserial PRIMARY KEY,
    asset            text NOT NULL REFERENCES deferral_assets (name),
    extra            jsonb NOT NULL DEFAULT '{}'::jsonb,
    source_kind      text NOT NULL CHECK (source_kind IN ('task', 'watcher', 'webhook', 'cli')),
    source_dag_id    text,
    source_run_id    text,
    source_task_id   text,
    source_map_index integer,
    source_name      text,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX deferral_asset_events_asset ON deferral_asset_events (asset, id);

-- Events not yet consumed by a run of a DAG scheduled on their asset: one row per (DAG,
-- event). The scheduler consumes all of a DAG's rows into one run once its condition holds
-- (queued events collapse into one run).
-- (No foreign keys here and in deferral_run_asset_events: their rows are written by the
-- trigger and by create_asset_runs from rows that exist, and a check per row cost more than
-- the insert, thousands of them per event burst.)
CREATE TABLE deferral_asset_queue (
    dag_id   text NOT NULL,
    event_id bigint NOT NULL,
    asset    text NOT NULL,
    PRIMARY KEY (dag_id, event_id)
);
-- (which assets a DAG has events of queued: one probe per (DAG, asset), however many events
-- are queued: create_asset_runs)
CREATE INDEX deferral_asset_queue_asset ON deferral_asset_queue (dag_id, asset);

-- The events that triggered each asset-triggered run.
CREATE TABLE deferral_run_asset_events (
    dag_run_id bigint NOT NULL,
    event_id   bigint NOT NULL,
    PRIMARY KEY (dag_run_id, event_id)
);
CREATE INDEX deferral_run_asset_events_event ON deferral_run_asset_events (event_id);

-- Every inserted event is queued for the active, unpaused DAGs scheduled on its asset, in the
-- inserting statement's transaction (an event of a task is queued with its success, or not at
-- all), and the schedulers are woken (NOTIFY deferral_assets, a signal only) when one was.
-- (A row trigger: a statement that inserts no event, finish_tasks for tasks without outlets,
-- runs nothing; a statement trigger ran its function for each of them, some 20-70 us.)
CREATE FUNCTION deferral_queue_asset_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferral_asset_queue (dag_id, event_id, asset)
    SELECT s.dag_id, NEW.id, NEW.asset
    FROM deferral_dag_assets s
    JOIN deferral_dags d ON d.dag_id = s.dag_id
    WHERE s.asset = NEW.asset AND s.role = 'schedule' AND d.is_active AND NOT d.is_paused
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        PERFORM pg_notify('deferral_assets', '');
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER deferral_asset_events_queue AFTER INSERT ON deferral_asset_events
    FOR EACH ROW EXECUTE FUNCTION deferral_queue_asset_event();

-- Whether an asset condition holds when the assets named in $2 have queued events: a
-- condition is {"asset": name}, {"all": [conditions]} or {"any": [conditions]} (engine's
-- AssetAll, AssetAny; a schedule list is "all").
CREATE FUNCTION deferral_asset_condition(cond jsonb, present text[]) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    part jsonb;
BEGIN
    IF cond ? 'asset' THEN
        RETURN (cond->>'asset') = ANY (present);
    ELSIF cond ? 'all' THEN
        FOR part IN SELECT jsonb_array_elements(cond->'all') LOOP
            IF NOT deferral_asset_condition(part, present) THEN
                RETURN false;
            END IF;
        END LOOP;
        RETURN true;
    ELSIF cond ? 'any' THEN
        FOR part IN SELECT jsonb_array_elements(cond->'any') LOOP
            IF deferral_asset_condition(part, present) THEN
                RETURN true;
            END IF;
        END LOOP;
        RETURN false;
    END IF;
    RETURN false;
END;
$$;
