// Command once operates once consumers: their dead letters, their tables
// and a web console.
//
//	once dlq list     list dead letters of a Kafka topic or RabbitMQ queue
//	once dlq show     one dead letter: headers, reason, payload
//	once dlq replay   redrive dead letters to where they were first published
//	once migrate      move the processed-events tables up or down; status
//	once status       per consumer: rows, crash suspects, dead letters, lag
//	once retention    delete one consumer's old rows in bounded batches
//	once ui           the web console
//	once help [cmd]   help, for every command
//
// A redrive carries the event id the record was dead-lettered under in the
// once-redrive-event-id header, which the consumer that dead-lettered it
// prefers over every other id source: replaying a record twice, or a record
// handled meanwhile, has one effect; the topic's other consumers identify
// the copy as they did its first delivery. docs/operations.md has the runbook.
//
// Exit codes: 0 success; 1 a failure (a broker or the database unreachable,
// a replay that stopped); 2 a usage error (unknown command, bad or missing
// flag); 4 nothing matched (dlq show, dlq replay: its report printed). 3 is
// reserved. A first Ctrl-C asks the command to stop, a second quits at once.
package main
