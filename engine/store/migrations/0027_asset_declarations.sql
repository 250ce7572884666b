-- What each DAG declares of an asset beyond its name and uri: a digest of its group, extra
-- and watchers (null: a bare declaration, e.g. a producer's Asset("orders"): default group,
-- no extra, no watchers). Two active DAGs may not declare one asset differently
-- (asset_conflicts); a bare declaration leaves what another DAG declared.
ALTER TABLE deferral_dag_assets ADD COLUMN declared text;
-- The DAGs that use assets are written again by the next scan (as forget_dag_fingerprint
-- does), which records what they declare.
UPDATE deferral_dags SET fingerprint = NULL
WHERE dag_id IN (SELECT DISTINCT dag_id FROM deferral_dag_assets);
