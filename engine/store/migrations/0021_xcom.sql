-- XComs pushed by tasks under keys of their own (context["ti"].xcom_push). A task's return
-- value (key 'return_value') is its task instance's result column, written with its outcome.
-- Each row belongs to one try: a new try of the task does not see the rows of an earlier one
-- (readers compare try_number with the task instance's), and its own push of the same key
-- replaces them. value is encrypted at rest as results are.
CREATE TABLE deferral_xcom (
    ti_id      bigint NOT NULL REFERENCES deferral_task_instances (id) ON DELETE CASCADE,
    key        text NOT NULL CHECK (key <> ''),
    try_number integer NOT NULL,
    value      bytea NOT NULL,
    pushed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (ti_id, key)
);
