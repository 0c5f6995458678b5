DROP TRIGGER IF EXISTS {{.ReleaseUpdateTrigger}} ON {{.Table}};
CREATE TRIGGER {{.ReleaseUpdateTrigger}} AFTER UPDATE ON {{.Table}} FOR EACH ROW
    WHEN (OLD.key IS NOT NULL AND OLD.sent_at IS NULL AND (OLD.attempts > 0 OR OLD.parked_at IS NOT NULL)
        AND NOT (NEW.sent_at IS NULL AND (NEW.attempts > 0 OR NEW.parked_at IS NOT NULL)))
    EXECUTE FUNCTION {{.ReleaseFunction}}();
