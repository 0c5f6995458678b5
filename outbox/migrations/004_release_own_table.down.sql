CREATE OR REPLACE FUNCTION {{.ReleaseFunction}}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {{.Table}} SET waiting = false
    WHERE waiting AND topic = OLD.topic AND key = OLD.key;
    RETURN NULL;
END
$$;
