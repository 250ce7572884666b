-- A hash of everything a DAG's row records from its file (structure, schedule, ...), written
-- with it: a rescan of an unchanged folder compares hashes and writes nothing, instead of
-- sending every DAG (megabytes for a DAG of 5,000 tasks) for the database to compare. Null:
-- recorded by a writer that computed none (compared as different).
ALTER TABLE deferral_dags ADD COLUMN fingerprint text;
