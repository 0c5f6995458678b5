// Package freeport picks loopback TCP ports for the throwaway servers of
// the tests, the benchmark and the chaos runs (PostgreSQL, Apache Kafka).
//
// A port from the kernel (listening on port 0) lies in the ephemeral
// range, from which every outgoing connection also takes its local port.
// A server killed and restarted on its port (what the chaos runs do) then
// finds it taken now and then by a client's connection, and fails with
// "address already in use". Pick takes ports below that range instead,
// where only listeners go.
package freeport
