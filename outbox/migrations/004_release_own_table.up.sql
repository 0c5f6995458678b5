-- once: the release function updates the table whose trigger fired it,
-- named by its oid (TG_RELID; the root of its partition tree when it is
-- partitioned, as the whole table was updated before). It named the table
-- as Config gives it, unqualified with Schema "", and PostgreSQL resolved
-- that through the search_path of the session that fired it: a row
-- requeued from a session on another search_path (a DBA naming the schema
-- in psql) failed ("relation does not exist"), or gave back the rows of
-- another outbox of the name on that path instead.
-- once:additive
CREATE OR REPLACE FUNCTION {{.ReleaseFunction}}() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    t regclass := TG_RELID;
BEGIN
    -- A partition's trigger fires with the partition: the rows waiting
    -- may be in any partition of the tree.
    WHILE (SELECT relispartition FROM pg_class WHERE oid = t) LOOP
        SELECT inhparent INTO t FROM pg_inherits WHERE inhrelid = t;
    END LOOP;
    EXECUTE format('UPDATE %s SET waiting = false WHERE waiting AND topic = $1 AND key = $2', t)
        USING OLD.topic, OLD.key;
    RETURN NULL;
END
$$;

-- The triggers are made again on the function just replaced: with Schema
-- "" it is created in the first schema of the search_path, which need not
-- be the one version 2 made it in (the path changed since), and the
-- triggers would call the old one.
DROP TRIGGER IF EXISTS {{.ReleaseUpdateTrigger}} ON {{.Table}};
CREATE TRIGGER {{.ReleaseUpdateTrigger}} AFTER UPDATE ON {{.Table}} FOR EACH ROW
    WHEN (OLD.key IS NOT NULL AND OLD.sent_at IS NULL AND (OLD.attempts > 0 OR OLD.parked_at IS NOT NULL)
        AND (NOT (NEW.sent_at IS NULL AND (NEW.attempts > 0 OR NEW.parked_at IS NOT NULL))
            OR NEW.topic IS DISTINCT FROM OLD.topic OR NEW.key IS DISTINCT FROM OLD.key))
    EXECUTE FUNCTION {{.ReleaseFunction}}();
DROP TRIGGER IF EXISTS {{.ReleaseDeleteTrigger}} ON {{.Table}};
CREATE TRIGGER {{.ReleaseDeleteTrigger}} AFTER DELETE ON {{.Table}} FOR EACH ROW
    WHEN (OLD.key IS NOT NULL AND OLD.sent_at IS NULL AND (OLD.attempts > 0 OR OLD.parked_at IS NOT NULL))
    EXECUTE FUNCTION {{.ReleaseFunction}}();
