-- Asset watchers on the triggerer (issue 22). Each watcher of an asset an active DAG uses runs
-- as a row of deferral_triggers (claimed with leases, adopted on failover, fenced, like every
-- trigger) that no task waits on and that never fires: its events are written as asset events
-- with its cursor (record_watcher_events). The watcher's row keeps what must outlive a trigger
-- row: the cursor, and the faults that are shown by `deferral assets list`.
ALTER TABLE deferral_asset_watchers
    -- the trigger row that runs it now (null: none, e.g. no active DAG uses its asset)
    ADD COLUMN trigger_id    bigint REFERENCES deferral_triggers (id) ON DELETE SET NULL,
    -- digest of the trigger that row runs (classpath and kwargs as declared): a watcher whose
    -- trigger changed starts again without a cursor
    ADD COLUMN trigger_key   text,
    -- the event trigger's cursor after the last event recorded (MessagePack; null: none yet)
    ADD COLUMN cursor        bytea,
    ADD COLUMN events        bigint NOT NULL DEFAULT 0,
    -- the (fence, sequence number) of the last item written: a batch written again after its
    -- reply was lost writes nothing twice
    ADD COLUMN written_fence bigint NOT NULL DEFAULT 0,
    ADD COLUMN written_seq   bigint NOT NULL DEFAULT 0,
    ADD COLUMN restarts      integer NOT NULL DEFAULT 0,
    ADD COLUMN last_error    text,
    ADD COLUMN last_error_at timestamptz,
    -- when a watcher whose trigger raised starts again (its backoff)
    ADD COLUMN retry_at      timestamptz;
CREATE UNIQUE INDEX deferral_asset_watchers_trigger ON deferral_asset_watchers (trigger_id)
    WHERE trigger_id IS NOT NULL;
