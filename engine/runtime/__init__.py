"""The ground floor of every process (runner, metrics, logs, retries, outbox): no store."""
