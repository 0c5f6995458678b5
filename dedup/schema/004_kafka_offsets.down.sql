-- once dedup, back from version 4.
DROP TABLE IF EXISTS {{.Offsets}};
