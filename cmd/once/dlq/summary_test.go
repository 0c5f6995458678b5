package dlq

import (
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
)

// A Tally keeps at most TallyGroups consumer and kind pairs, and
// TallyNameBytes of their names, and counts the records of every other
// pair in one row: it kept a row per pair, and a destination written by
// another producer, with a consumer name per record or names of
// megabytes, made it as large as the records it counted (`once status
// -dlq`, the console's consumers page). Nothing is left out of the counts.
func TestTallyIsBounded(t *testing.T) {
	var tally Tally
	const distinct = 3 * TallyGroups
	for i := range distinct {
		tally.Add(rec(consumer.HeaderConsumer, "c-"+strconv.Itoa(i), consumer.HeaderErrorKind, "handler"))
	}
	tally.Add(rec(consumer.HeaderConsumer, "c-0", consumer.HeaderErrorKind, "handler")) // a pair kept
	counts := tally.Counts()
	require.Equal(t, TallyGroups+1, len(counts), "the pairs kept and one row of the others")
	total := 0
	for _, c := range counts[:TallyGroups] {
		assert.False(t, c.Others)
		total += c.Count
	}
	others := counts[TallyGroups]
	assert.Equal(t, KindCount{Others: true, Count: distinct - TallyGroups}, others)
	assert.Equal(t, distinct+1, total+others.Count, "every record is counted")
	assert.Equal(t, KindCount{Consumer: "c-0", Kind: "handler", Count: 2}, counts[0], "a pair kept is counted past the bound")

	// Names of a megabyte: as many as TallyNameBytes holds.
	var big Tally
	const huge = 1 << 20
	for i := range 10 {
		big.Add(rec(consumer.HeaderConsumer, strconv.Itoa(i)+strings.Repeat("n", huge), consumer.HeaderErrorKind, "handler"))
	}
	counts = big.Counts()
	kept := TallyNameBytes / (huge + 1 + len("handler"))
	require.Equal(t, kept+1, len(counts))
	assert.Equal(t, 10-kept, counts[kept].Count)
	assert.True(t, counts[kept].Others)
}
