-- Variables and Connections in the database (issue 18). Values a task reads at run time:
-- a Variable's value and a Connection's password and extra are encrypted with the store's
-- keys (engine/security/keys.py: a Fernet token behind the 0xc1 marker, or plaintext with no
-- key configured), and re-encrypted by `deferral keys rotate` with the other stored values.
CREATE TABLE deferral_variables (
    key         text PRIMARY KEY CHECK (key <> '' AND length(key) <= 250),
    -- the value, UTF-8 text, encrypted
    value       bytea NOT NULL,
    description text,
    -- masked wherever the engine shows it, whatever its key is called
    is_secret   boolean NOT NULL DEFAULT false,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE deferral_connections (
    conn_id     text PRIMARY KEY CHECK (conn_id <> '' AND length(conn_id) <= 250),
    conn_type   text,
    host        text,
    schema      text,
    login       text,
    port        integer CHECK (port BETWEEN 0 AND 65535),
    -- {"password": ..., "extra": {...}} as JSON, encrypted (null: neither)
    secrets     bytea,
    description text,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
