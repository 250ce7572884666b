-- The status page (deferral webserver): what each process of the fleet is (version), how each
-- triggerer's event loop fares (written with its lease renewal, no statement of its own), the
-- schedulers (which had no row anywhere), and the audit of the actions taken from the page.
ALTER TABLE deferral_workers ADD COLUMN version text;

ALTER TABLE deferral_triggerers
    ADD COLUMN version text,
    -- p99 of how late the loop ran its watchdog's ticks, over the recent ticks (milliseconds)
    ADD COLUMN loop_lag_p99_ms double precision,
    -- blocks of the event loop seen since the triggerer started, and the longest one's trigger
    ADD COLUMN blocked_loops integer NOT NULL DEFAULT 0,
    ADD COLUMN worst_blocker text,
    ADD COLUMN worst_block_ms double precision;

CREATE TABLE deferral_schedulers (
    id           bigserial PRIMARY KEY,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    version      text,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

-- One row per action taken from the status page: who (the remote address), what, on what.
CREATE TABLE deferral_audit (
    id      bigserial PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    who     text NOT NULL,
    action  text NOT NULL,
    target  text NOT NULL,
    detail  jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX deferral_audit_at ON deferral_audit (at);
