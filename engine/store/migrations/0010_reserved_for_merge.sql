-- Placeholder kept only on the i13-logs branch so that its migration 0012 applies in order
-- (migrations are numbered 1..n without gaps). The migration of that number from another
-- branch replaces this file at merge: delete this one then.
SELECT 1;
