-- The error of the try before the current one. A new try clears error (a retry that is
-- running shows no error until it fails itself) and keeps the last try's here, so listings
-- can still say why the task is being retried.
ALTER TABLE deferral_task_instances ADD COLUMN previous_error text;
