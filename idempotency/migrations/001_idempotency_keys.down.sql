-- once: removes the idempotency keys table and every stored response.
DROP TABLE IF EXISTS idempotency_keys;
