-- The DAG files that failed to import, as the latest scan of their folder found them: written
-- by the scheduler's scan (and by the commands that parse a folder themselves, `deferral dags
-- list --dags` ...), read by `deferral dags list` and the status page's banner, which show
-- them until the file imports again or is gone.
CREATE TABLE deferral_import_errors (
    fileloc text PRIMARY KEY,
    -- the DAGs folder the file was found in (a path ending in '/'): a scan of that folder
    -- drops the rows of its files that import again or are gone
    folder  text NOT NULL,
    -- the error, its traceback included
    error   text NOT NULL,
    -- when this error (this text) was first recorded
    since   timestamptz NOT NULL DEFAULT now()
);
