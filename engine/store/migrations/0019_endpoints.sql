-- Where the engine's processes listen, for `deferral status`: the metrics server of a
-- scheduler, worker or triggerer (matched to its registration row by host and pid) and the
-- status page of a webserver. Written once the process listens, kept by a heartbeat, removed
-- when it stops; a row whose heartbeat is old is a process that died.
CREATE TABLE deferral_endpoints (
    id           bigserial PRIMARY KEY,
    kind         text NOT NULL CHECK (kind IN ('metrics', 'webserver')),
    -- the process: scheduler, worker, triggerer or webserver
    process      text NOT NULL,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    version      text,
    url          text NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX deferral_endpoints_process ON deferral_endpoints (hostname, pid);
