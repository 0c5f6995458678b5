package isnil

import (
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
)

type reader struct{}

func (*reader) Read([]byte) (int, error) { return 0, io.EOF }

func TestValue(t *testing.T) {
	var typedNil *reader
	var r io.Reader = typedNil
	assert.True(t, Value(nil))
	assert.True(t, Value(r), "a nil pointer in an interface")
	assert.True(t, Value(map[string]int(nil)))
	assert.True(t, Value((func())(nil)))
	assert.False(t, Value(&reader{}))
	assert.False(t, Value(0))
	assert.False(t, Value(struct{}{}))
}
