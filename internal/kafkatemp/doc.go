// Package kafkatemp starts throwaway Apache Kafka clusters for tests,
// benchmarks and the chaos run: one or three KRaft nodes (each a combined
// controller and broker, no ZooKeeper) on free loopback ports, each with a
// data directory of its own under a temporary directory that Close removes.
//
// The nodes run from the jars of a pinned Apache Kafka release (Version)
// that scripts/kafka.sh fetches from Maven Central once and caches; Start
// does not download anything and fails with a message saying how to fetch
// the release when it is missing. A node runs with a small heap (Options)
// and production-like settings where they matter to the library's
// promises: topic auto-creation off, message.max.bytes at Kafka's default
// (about 1 MB); and settings that keep tests fast: no initial rebalance
// delay, a minimum session timeout of 200 ms, internal topics with the
// replication factor the cluster can hold.
//
// Each node is its own JVM in its own process group, so a test's interrupt
// does not end it before Close. A watchdog started with the cluster kills
// the nodes and removes the directory within about a second of the
// starting process's death (a test binary killed at its timeout leaves no
// broker behind). Kill, Stop and Restart break and mend single nodes.
package kafkatemp
