//go:build !chaos

package main

import "github.com/onceco/once/outbox"

// chaosRelayPublisher returns p: the relay's crash point exists in the
// chaos build only (relaycrash_chaos.go).
func chaosRelayPublisher(p outbox.Publisher) outbox.Publisher { return p }
