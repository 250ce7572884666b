-- A triggerer holds a session-level advisory lock on a connection of its own while it lives.
-- PostgreSQL ends the session, and frees the lock, the moment the process dies: the other
-- triggerers adopt its triggers at once instead of after its lease. Rows registered without
-- the lock (session_locked false) are reaped by their lease only.
ALTER TABLE deferral_triggerers
    ADD COLUMN session_locked boolean NOT NULL DEFAULT false;
