//go:build chaos

package consumer

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
)

// CrashPoints lists the steps where the chaos build can kill the process:
// set ONCE_CRASH_POINT=name:n to exit with status 86 at the n-th time (from
// 1) the process reaches the step.
var CrashPoints = []string{"after-claim", "after-handler", "after-commit", "after-dead-letter", "mid-batch"}

var (
	crashName  string
	crashAfter int64
	crashHits  atomic.Int64
)

func init() {
	spec := os.Getenv("ONCE_CRASH_POINT")
	if spec == "" {
		return
	}
	name, n, _ := strings.Cut(spec, ":")
	after, err := strconv.ParseInt(n, 10, 64)
	if err != nil || after < 1 {
		after = 1
	}
	crashName, crashAfter = name, after
}

// crashPoint kills the process at the configured step and count.
func crashPoint(name string) {
	if name != crashName {
		return
	}
	if crashHits.Add(1) == crashAfter {
		fmt.Fprintf(os.Stderr, "once: chaos crash at %s #%d\n", name, crashAfter)
		os.Exit(86)
	}
}
