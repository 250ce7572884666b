-- The outcome kinds, named once in SQL (engine/states.py names them in Python; a test keeps
-- the two equal): finish_tasks and fire_triggers cast the kinds they receive to these
-- domains, so an unknown kind is refused instead of falling into some CASE's ELSE.
CREATE DOMAIN deferral_task_outcome AS text
    CHECK (VALUE IN ('success', 'skipped', 'failed'));
CREATE DOMAIN deferral_trigger_outcome AS text
    CHECK (VALUE IN ('event', 'success', 'skipped', 'failed'));

-- Which deadline trigger_timeout_at is (the earliest, chosen by defer_task): the trigger's
-- defer(timeout=), the task's execution_timeout, or a sensor's timeout. A timeout error
-- names it. Null: no deadline, or a deferral stored before this migration.
ALTER TABLE deferral_task_instances
    ADD COLUMN deadline_kind text
        CHECK (deadline_kind IN ('trigger_timeout', 'execution_timeout', 'sensor_timeout'));
