-- A deferral timeout of a sensor ends it as failed without using its retries, as in Airflow
-- (AirflowSensorTimeout): retrying a sensor whose time is up would only wait again.
ALTER TABLE deferral_task_instances
    ADD COLUMN no_retry_on_timeout boolean NOT NULL DEFAULT false;
