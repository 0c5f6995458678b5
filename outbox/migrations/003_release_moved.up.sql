-- once: a refused row moved to another topic or key (by hand: a typo in a
-- parked row's topic fixed before it is requeued) gives back the rows
-- waiting behind it under the topic and key it leaves, as one that stops
-- being refused does. Before, they stayed waiting for ever.
-- once:additive
DROP TRIGGER IF EXISTS {{.ReleaseUpdateTrigger}} ON {{.Table}};
CREATE TRIGGER {{.ReleaseUpdateTrigger}} AFTER UPDATE ON {{.Table}} FOR EACH ROW
    WHEN (OLD.key IS NOT NULL AND OLD.sent_at IS NULL AND (OLD.attempts > 0 OR OLD.parked_at IS NOT NULL)
        AND (NOT (NEW.sent_at IS NULL AND (NEW.attempts > 0 OR NEW.parked_at IS NOT NULL))
            OR NEW.topic IS DISTINCT FROM OLD.topic OR NEW.key IS DISTINCT FROM OLD.key))
    EXECUTE FUNCTION {{.ReleaseFunction}}();
