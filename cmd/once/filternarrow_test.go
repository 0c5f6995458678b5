package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A filter that is given but cannot narrow the selection (-id '*', the
// empty prefix, as a script's "${ORDER}*" makes of an empty variable;
// -search of blanks alone, which nearly every error holds) counted as a
// filter: dlq replay redrove the whole destination without -all. It is
// refused as an empty filter is, by every dlq command.
func TestDLQRefusesAFilterThatCannotNarrow(t *testing.T) {
	env, _, topic := kafkaDLQ(t)
	dlqName := topic + ".dlq"
	for _, args := range [][]string{{"-id", "*"}, {"-search", " "}, {"-search", " \t"}, {"-kind", "handler", "-id", "*"}} {
		for _, cmd := range []string{"replay", "list", "show"} {
			code, out, errOut := cli(t, env, append([]string{"dlq", cmd, "-dlq", dlqName}, args...)...)
			assert.Equal(t, exitUsage, code, "dlq %s %q: %s%s", cmd, args, out, errOut)
			assert.NotContains(t, out, "replayed", "dlq %s %q", cmd, args)
		}
	}
	code, _, errOut := cli(t, env, "dlq", "replay", "-dlq", dlqName, "-id", "*")
	require.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, `-id "*": give a prefix before the * (a * alone selects every record, with an id or without)`)
	code, _, errOut = cli(t, env, "dlq", "replay", "-dlq", dlqName, "-search", " ")
	require.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, `-search " ": give text to look for (blanks alone are in nearly every record)`)

	// A prefix, and a search with blanks inside text, still select.
	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", dlqName, "-id", "fail*")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "1 of 4 records in kafka topic "+dlqName+" match")
	code, out, errOut = cli(t, env, "dlq", "list", "-dlq", dlqName, "-search", "REJECTED event 5")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "1 of 4 records in kafka topic "+dlqName+" match")
}
