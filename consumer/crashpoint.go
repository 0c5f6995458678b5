//go:build !chaos

package consumer

// crashPoint marks a step of a message's way where the chaos build
// (-tags chaos) can kill the process; in every other build it is empty and
// inlined away.
func crashPoint(string) {}
