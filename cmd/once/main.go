package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, cancel := interruptible(context.Background())
	code := newApp(os.Stdout, os.Stderr, os.Getenv).run(ctx, os.Args[1:])
	cancel()
	os.Exit(code)
}

// interruptible returns a context that the first SIGINT or SIGTERM
// cancels, so that a command stops cleanly (a replay reports what it
// did). A second one kills the process: a call that does not stop with
// the context (the broker clients' do not watch it, and are made to stop
// by closing their connections) must not leave a Ctrl-C ignored.
func interruptible(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(parent)
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		defer signal.Stop(sigs)
		select {
		case s := <-sigs:
			// With no channel left for them, the signals kill the
			// process again.
			signal.Stop(sigs)
			fmt.Fprintf(os.Stderr, "once: %v: stopping (once more to quit at once)\n", s)
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}
