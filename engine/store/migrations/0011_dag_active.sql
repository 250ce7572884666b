-- A DAG whose file left the DAGs folder (or no longer defines it) is inactive: the scheduler
-- creates no more runs of it; its runs and history stay. It is active again once a scan finds
-- it (and its next run is computed again then).
ALTER TABLE deferral_dags ADD COLUMN is_active boolean NOT NULL DEFAULT true;
