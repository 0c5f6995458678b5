// Package robust holds tests that cross package lines: every invalid
// configuration of the consumer, the dedup store and both broker adapters
// fails fast with an error naming the field or the server, and no log line
// or error carries a payload or a credential. It has no code of its own.
package robust
